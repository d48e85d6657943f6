"""`bench.py --timeline`: where a request's first token spends its time, stage by stage, for
every target the same way (see timeline_probe/sitecustomize.py for the marks).

Requests run one at a time, so a mark belongs to the request whose span (the client's send
to its last message) contains it. Every figure is milliseconds after the client's send, the
median over the measured requests (then over rounds), on one clock: CLOCK_MONOTONIC, which
the client (time.perf_counter), the front end and the engine core all read.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from workload import Record

PROBE = Path(__file__).resolve().parent / "timeline_probe"
# The marks in the order a request meets them; a target shows those its processes have
# (the Rust front ends have no Python marks of their own).
STAGES = (
    ("fe_handler", "ours: the stream handler starts"),
    ("fe_add_sent", "front end: the request sent to the engine core (ZMQ)"),
    ("core_decoded", "engine core: decoded by its input thread"),
    ("core_queued", "engine core: on its input queue"),
    ("core_add", "engine core: taken by its busy loop (add_request)"),
    ("step_start", "engine core: the first step starts"),
    ("step_end", "engine core: the first step ends"),
    ("core_out_put", "engine core: output on its output queue"),
    ("core_out_taken", "engine core: taken by its output thread"),
    ("core_out_sent", "engine core: sent (ZMQ)"),
    ("fe_out_decoded", "front end: output decoded"),
    ("fe_out_taken", "front end: taken by its output loop"),
    ("fe_yield1", "ours: the handler yields its first message"),
    ("fe_yield2", "ours: its second (native contract: the first token; else a later step)"),
    ("client_first_message", "client: first message read"),
    ("client_first_token", "client: first token read"),
)


def read_marks(directory: Path) -> list[tuple[float, str]]:
    marks = []
    for path in directory.glob("marks-*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                mark = json.loads(line)
                marks.append((mark["at"], mark["kind"]))
    return sorted(marks)


def per_request(records: list[Record], marks: list[tuple[float, str]]) -> dict[str, float]:
    """The median of each mark's offset (ms after the client's send) over `records`."""
    offsets: dict[str, list[float]] = {}
    ok = sorted((r for r in records if r.error is None and r.message_times), key=lambda r: r.start)
    for record in ok:
        end = record.message_times[-1]
        seen: dict[str, float] = {}
        for at, kind in marks:
            if record.start <= at <= end and kind not in seen:
                seen[kind] = at
        if record.first_message_at is not None:
            seen["client_first_message"] = record.first_message_at
        seen["client_first_token"] = record.message_times[0]
        for kind, at in seen.items():
            offsets.setdefault(kind, []).append((at - record.start) * 1000)
    return {kind: statistics.median(values) for kind, values in offsets.items()}


def table(timelines: dict[str, list[dict[str, float]]]) -> str:
    """Rows: the stages; columns: the targets (medians over rounds). Each cell is the
    mark's time after the client's send, and the step from the target's previous mark (less
    than zero where two stages overlap: a mark taken after a call returns, e.g. the engine
    core's send, can follow the receiver's)."""
    targets = list(timelines)
    merged = {
        target: {
            kind: statistics.median(r[kind] for r in rounds if kind in r)
            for kind in {k for r in rounds for k in r}
        }
        for target, rounds in timelines.items()
    }
    lines = [
        "| stage | " + " | ".join(targets) + " |",
        "|---|" + "---|" * len(targets),
    ]
    previous: dict[str, float] = dict.fromkeys(targets, 0.0)
    for kind, meaning in STAGES:
        if not any(kind in merged[t] for t in targets):
            continue
        cells = []
        for target in targets:
            at = merged[target].get(kind)
            if at is None:
                cells.append("-")
                continue
            cells.append(f"{at:.2f} ({at - previous[target]:+.2f})")
            previous[target] = at
        lines.append(f"| {kind}: {meaning} | " + " | ".join(cells) + " |")
    # The first step is the engine's own work, the same for every front end but for the
    # noise of a shared machine: what is left is what each front end adds.
    cells = []
    for target in targets:
        m = merged[target]
        if {"step_start", "step_end", "client_first_token"} <= m.keys():
            own = m["client_first_token"] - (m["step_end"] - m["step_start"])
            cells.append(f"{own:.2f}")
        else:
            cells.append("-")
    lines.append(
        "| the first token less the first step (the front end's part) | " + " | ".join(cells) + " |"
    )
    return "\n".join(lines)
