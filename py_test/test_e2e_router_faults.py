"""Worker faults under steady streaming load, through both real routers (SMG and vllm-router),
two mock-engine workers behind each (issue 33, items 3 and 4).

A worker SIGKILLed, then restarted on the same address; a worker drained by SIGTERM (a rolling
restart); a worker whose engine hangs (the progress watchdog reports NOT_SERVING and exits 1).
Each test drives a few client threads streaming chats back to back through the router and
sorts every request: served (HTTP 200 and a finish_reason), failed (an HTTP error, an error
event, a broken stream) or lost (no answer and no error within the client's timeout: never
allowed). The figures give, per router and fault, those counts and the time the router took
to route around the fault. The routers run with their own retry and circuit-breaker defaults
and quick health checks (HEALTH below), as a deployment that wants fast fail-over would.

Last, the API key: whether a router can send a bearer token to a gRPC worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

import servers
from harness import require
from native_servers import vllm_router, vllm_router_path
from real_engine import tiny_model
from routers import CHAT, _running, in_thread, smg_path, smg_router
from vllm_servers import free_port

pytestmark = pytest.mark.slow

STEP_DELAY = 0.02  # seconds per token on the mock: a MAX_TOKENS stream lasts ~0.6 s
MAX_TOKENS = 30
CLIENTS = 4  # client threads, each streaming one chat after another
CLIENT_TIMEOUT = 15.0  # seconds without a byte: the request is lost
STALL_TIMEOUT = 2.0  # the workers' --engine-stall-timeout-seconds: out of rotation
STALL_EXIT = 4.0  # and --engine-stall-exit-seconds: streams failed, exit 1
# Quick health checks (both routers' defaults: every 60 s, 3 failures to mark unhealthy, 2
# successes to mark healthy again); retries and circuit breakers stay at their defaults.
HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
          "--health-success-threshold", "1", "--health-check-timeout-secs", "1")  # fmt: skip
ROUTER_FLAGS = {router: ("--policy", "round_robin", *HEALTH) for router in ("smg", "vllm-router")}
# What each router does, at its defaults (seen in its logs in these tests).
RETRIES = {
    "smg": "retries (5, 50 ms backoff) a request whose worker failed before its first token; "
    "circuit breaker after 10 failures; probes the contract's HealthCheck RPC; an unhealthy "
    "worker stays registered and is probed until it is back",
    "vllm-router": "retries (5, 50 ms backoff) a request whose worker failed before its first "
    "token; circuit breaker after 10 failures; probes grpc.health.v1; an unhealthy worker "
    "stays registered and is probed until it is back",
}
# What the tests hold each router to.
ERROR_WITHIN = 5.0  # seconds from the fault to the error of a request in flight on it
REUSED_WITHIN = 10.0  # seconds from a restarted worker's ready line to its first request
OUT_OF_ROTATION_WITHIN = 2.0  # seconds from NOT_SERVING (drain) to the last request it gets

ADMITTED = re.compile(r"request \S+: (\d+) prompt tokens")  # --enable-log-requests
DRAINING = re.compile(r"draining \(grace [\d.]+s, (\d+) requests in flight\)")
STALLED = re.compile(r"Engine stalled: no step for ([\d.]+)s")
STUCK = re.compile(r"Engine stuck: no step for ([\d.]+)s")
REJECTED = re.compile(r'^vllm_servicer:rejected_total\{cause="not_serving"\} (\S+)$', re.M)

SERVED, FAILED, LOST = "served", "failed", "lost"


# -- workers ----------------------------------------------------------------------------------


def _worker_flags(port: int, metrics_port: int, *extra: str) -> list[str]:
    # The mock stands in for the tiny model (same name, vocabulary and context), so each
    # router's tokenizer (loaded from the tiny model's folder) matches it.
    return ["--mock-engine", "--port", str(port), "--metrics-port", str(metrics_port),
            "--mock-model-name", str(tiny_model()), "--mock-vocab-size", "512",
            "--mock-max-model-len", "256", "--mock-eos-token-id", "1",
            "--mock-step-delay", str(STEP_DELAY), "--enable-log-requests",
            "--shutdown-grace-seconds", "30",
            "--engine-stall-timeout-seconds", str(STALL_TIMEOUT),
            "--engine-stall-exit-seconds", str(STALL_EXIT), *extra]  # fmt: skip


class Worker:
    """One mock-engine worker process on a fixed port (restarts reuse it); its output lines,
    each with the time it arrived."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.metrics_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.lines: list[tuple[float, str]] = []
        self.ready_at = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, *extra: str, timeout: float = 60.0) -> None:
        lines: list[tuple[float, str]] = []
        self.lines = lines
        process = subprocess.Popen(
            servers.command(*_worker_flags(self.port, self.metrics_port, *extra)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, for kill()
        )
        self.process = process
        ready = threading.Event()

        def pump() -> None:
            assert process.stdout is not None
            for raw in process.stdout:
                line = raw.decode(errors="replace")
                lines.append((time.monotonic(), line))
                if servers.READY.search(line):
                    ready.set()

        threading.Thread(target=pump, name=f"worker-{self.name}", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1):
            if process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"worker {self.name} did not start:\n{self.text()}")
        self.ready_at = time.monotonic()

    def kill(self) -> None:
        """SIGKILL, as an OOM kill or a lost node."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def terminate(self) -> None:
        """SIGTERM, as a rolling restart does."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def admitted(self, since: float = 0.0, min_prompt: int = 0) -> list[float]:
        """When this process admitted requests (its log lines), from `since` on."""
        return [
            at
            for at, line in self.lines
            if at >= since and (m := ADMITTED.search(line)) and int(m.group(1)) >= min_prompt
        ]

    def first(self, pattern: re.Pattern[str]) -> tuple[float, re.Match[str]] | None:
        for at, line in self.lines:
            if match := pattern.search(line):
                return at, match
        return None

    def rejected_not_serving(self) -> float | None:
        """Generation requests it refused as not serving (draining, stuck); None if down."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                match = REJECTED.search(response.read().decode())
        except OSError:
            return None
        return float(match.group(1)) if match else None

    def text(self) -> str:
        return "".join(line for _, line in self.lines)[-4000:]


# -- load ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    started: float
    ended: float
    result: str  # SERVED, FAILED or LOST
    detail: str = ""


def _body(content: str = "Hello", max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": str(tiny_model()), "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}  # fmt: skip


def stream_chat(base: str, body: dict) -> Outcome:
    """One streamed chat through the router, sorted as a client sees it."""
    host, port = base.removeprefix("http://").split(":")
    started = time.monotonic()

    def done(result: str, detail: str = "") -> Outcome:
        return Outcome(started, time.monotonic(), result, detail)

    connection = http.client.HTTPConnection(host, int(port), timeout=CLIENT_TIMEOUT)
    try:
        connection.request("POST", CHAT, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return done(FAILED, f"HTTP {response.status}: {response.read()[:200]!r}")
        finish = None
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return done(FAILED, f"error event: {str(event['error'])[:200]}")
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
        return done(SERVED, finish) if finish else done(FAILED, "stream ended, no finish_reason")
    except TimeoutError:
        return done(LOST, f"nothing for {CLIENT_TIMEOUT} s")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return done(FAILED, f"broken: {exc!r}"[:200])
    finally:
        connection.close()


class Load:
    """CLIENTS threads streaming chats through the router back to back, until the block ends."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, name=f"client-{i}", daemon=True)
            for i in range(CLIENTS)
        ]

    def _client(self) -> None:
        while not self._stop.is_set():
            self.outcomes.append(stream_chat(self.base, _body()))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT + 10)
            assert not thread.is_alive(), "a client thread never returned"


def row(router: str, fault: str, outcomes: list[Outcome], around: str, notes: str) -> str:
    """One line of the fault table: router, fault, the requests sorted, route-around time."""
    tally = {result: sum(o.result == result for o in outcomes) for result in (SERVED, FAILED, LOST)}
    return (
        f"{router} | {fault} | sent {len(outcomes)} | served {tally[SERVED]} | "
        f"failed {tally[FAILED]} | lost {tally[LOST]} | route-around {around} | {notes}"
    )


def route_around(outcomes: list[Outcome], fault_at: float) -> float:
    """Seconds from the fault to the start of the first request from which on every request
    was served (0: no request that started after the fault failed)."""
    late = [o.started - fault_at for o in outcomes if o.started >= fault_at and o.result != SERVED]
    return max(late, default=0.0)


def latency(outcomes: list[Outcome], fault_at: float) -> str:
    """The usual duration of a served request before the fault, and the slowest one served
    around it (started up to 3 s after it, or still running when it struck)."""
    before = sorted(
        o.ended - o.started for o in outcomes if o.ended < fault_at and o.result == SERVED
    )
    around = [
        o.ended - o.started
        for o in outcomes
        if o.result == SERVED and o.ended >= fault_at and o.started < fault_at + 3
    ]
    usual = before[len(before) // 2] if before else 0.0
    return f"served in {usual:.2f} s before, slowest around it {max(around, default=0.0):.2f} s"


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.result != SERVED]


def not_lost(outcomes: list[Outcome]) -> None:
    lost = [o for o in outcomes if o.result == LOST]
    assert not lost, f"{len(lost)} request(s) got neither an answer nor an error: {lost[:3]}"


# -- the routers ----------------------------------------------------------------------------------


@dataclass
class Fleet:
    router: str
    base: str
    workers: list[Worker]
    log: Path

    def serve_both(self, timeout: float = 30.0) -> None:
        """(Re)start any worker that is down; return once the router sends each a request."""
        for worker in self.workers:
            if not worker.alive:
                worker.start()
        since = time.monotonic()
        while not all(worker.admitted(since) for worker in self.workers):
            assert time.monotonic() - since < timeout, (
                f"{self.router} does not use both workers: see {self.log}"
            )
            stream_chat(self.base, _body(max_tokens=2))
            time.sleep(0.05)


def _router(kind: str, workers: list[str], log: Path) -> contextlib.AbstractContextManager[str]:
    if kind == "smg":
        return smg_router(workers, tiny_model(), log, *ROUTER_FLAGS[kind])
    return vllm_router(workers, tiny_model(), log, *ROUTER_FLAGS[kind], as_deployed=True)


def _installed(kind: str) -> bool:
    return (smg_path() if kind == "smg" else vllm_router_path()) is not None


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["smg", "vllm-router"])
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """One router (request.param) in front of two mock workers, for every fault of the module:
    a test leaves a worker down; the next one restarts it on the same address. Started in
    threads, so that the session's loop keeps serving its in-process workers meanwhile."""
    kind: str = request.param
    require(_installed(kind), f"{kind} is not installed (make test)")
    workers = [Worker("A"), Worker("B")]
    log = tiny_model().parent / f"router-faults-{kind}.log"
    try:
        for worker in workers:
            await asyncio.to_thread(worker.start)
        async with in_thread(_router(kind, [w.address for w in workers], log)) as base:
            yield Fleet(kind, base, workers, log)
    finally:
        for worker in workers:
            worker.kill()


# -- the faults ---------------------------------------------------------------------------------


def test_a_killed_worker_then_restarted(fleet: Fleet, figures: Callable[[str], None]) -> None:
    """SIGKILL one worker under load: what was in flight on it fails fast, everything else is
    served by the other; restarted on the same address, the router uses it again."""
    fleet.serve_both()
    victim = fleet.workers[0]
    with Load(fleet.base) as load:
        time.sleep(1.5)
        killed_at = time.monotonic()
        victim.kill()
        time.sleep(4.0)
        victim.start()  # the same port
        while not victim.admitted(victim.ready_at) and time.monotonic() < victim.ready_at + 30:
            time.sleep(0.05)
        reused = victim.admitted(victim.ready_at)
        time.sleep(1.0)
    outcomes = load.outcomes
    failed = failures(outcomes)
    figures(f"{fleet.router} settings: {' '.join(ROUTER_FLAGS[fleet.router])}; "
            f"{RETRIES[fleet.router]}")  # fmt: skip
    figures(
        row(fleet.router, "SIGKILL", outcomes, f"{route_around(outcomes, killed_at):.2f} s",
            f"{len(failed)} in flight on it ended with an error "
            f"{max((o.ended - killed_at for o in failed), default=0.0):.2f} s after the kill "
            f"({failed[0].detail if failed else '-'}); {latency(outcomes, killed_at)}")
    )  # fmt: skip
    figures(
        row(fleet.router, "restart", [o for o in outcomes if o.started >= victim.ready_at],
            "-", "used again " + (f"{reused[0] - victim.ready_at:.2f} s" if reused else "never")
            + " after the restarted worker's ready line")
    )  # fmt: skip
    not_lost(outcomes)
    for outcome in failed:  # only what was in flight on it, and it ended, fast
        assert outcome.started < killed_at, outcome
        assert outcome.ended - killed_at < ERROR_WITHIN, outcome
    assert len(failed) <= CLIENTS
    after = [o for o in outcomes if o.started >= killed_at]
    assert after and all(o.result == SERVED for o in after), failures(after)[:3]
    assert reused, f"the restarted worker got no request in 30 s: see {fleet.log}"
    assert reused[0] - victim.ready_at < REUSED_WITHIN


def test_a_drained_worker(fleet: Fleet, figures: Callable[[str], None]) -> None:
    """SIGTERM one worker under load, as a rolling restart does: no client sees an error, the
    streams in flight on it finish, and the router stops sending it requests once it reports
    NOT_SERVING (while it still drains a long stream)."""
    fleet.serve_both()
    # A long stream (its prompt longer than the load's) holds one worker in its drain for
    # seconds: that worker is the one drained.
    long_outcome: list[Outcome] = []
    long_body = _body("x " * 20, max_tokens=180)  # ~55 prompt tokens, ~3.6 s
    long_client = threading.Thread(
        target=lambda: long_outcome.append(stream_chat(fleet.base, long_body))
    )
    since = time.monotonic()
    long_client.start()
    while not (holders := [w for w in fleet.workers if w.admitted(since, min_prompt=40)]):
        assert time.monotonic() - since < 10, "the long request reached no worker"
        time.sleep(0.02)
    victim = holders[0]
    refusals: list[tuple[float, float]] = []  # (when, its refused-as-not-serving count)

    def sample() -> None:
        while (value := victim.rejected_not_serving()) is not None:
            refusals.append((time.monotonic(), value))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    with Load(fleet.base) as load:
        sampler.start()
        time.sleep(1.0)
        before = victim.rejected_not_serving() or 0.0
        drained_at = time.monotonic()
        victim.terminate()
        code = victim.wait(40)
        exited_at = time.monotonic()
        time.sleep(1.0)
    long_client.join(CLIENT_TIMEOUT + 5)
    sampler.join(5)
    outcomes = [*load.outcomes, *long_outcome]
    refused = [(at, value) for at, value in refusals if value > before]
    last_refusal = min((at for at, value in refused if value == refused[-1][1]), default=None)
    draining = victim.first(DRAINING)
    admitted_after = victim.admitted(draining[0]) if draining else []
    figures(
        row(fleet.router, "SIGTERM", outcomes, f"{route_around(outcomes, drained_at):.2f} s",
            f"drain {exited_at - drained_at:.2f} s, "
            f"{draining[1].group(1) if draining else '?'} in flight on it, all finished; it "
            f"refused {int(refused[-1][1] - before) if refused else 0} request(s) the router "
            "sent it while draining (retried elsewhere), the last "
            + (f"{last_refusal - drained_at:.2f} s" if last_refusal else "-")
            + f" after SIGTERM; {latency(load.outcomes, drained_at)}")
    )  # fmt: skip
    not_lost(outcomes)
    assert not failures(outcomes), failures(outcomes)[:3]
    assert long_outcome and long_outcome[0].result == SERVED, long_outcome
    assert code == 0, victim.text()
    assert draining is not None and not admitted_after, victim.text()
    if last_refusal is not None:  # the router took it out of rotation while it still drained
        assert last_refusal - drained_at < OUT_OF_ROTATION_WITHIN, refused
        assert exited_at - last_refusal > 0.5, (refused, exited_at - drained_at)


def test_a_hung_worker(fleet: Fleet, figures: Callable[[str], None]) -> None:
    """One worker's engine stops making steps under load (alive, stuck): the progress watchdog
    reports NOT_SERVING at its first limit (the router stops sending it requests), then fails
    its requests UNAVAILABLE at the second and exits 1; nothing hangs."""
    fleet.serve_both()
    victim = fleet.workers[1]
    victim.kill()
    victim.start("--mock-stall-after-tokens", "150")  # ~1.5 s into the load below
    fleet.serve_both()
    with Load(fleet.base) as load:
        code = victim.wait(30)
        exited_at = time.monotonic()
        time.sleep(2.0)
    outcomes = load.outcomes
    failed = failures(outcomes)
    stalled, stuck = victim.first(STALLED), victim.first(STUCK)
    assert stalled is not None and stuck is not None, victim.text()
    left_at, match = stalled
    stalled_at = left_at - float(match.group(1))
    stuck_at = stuck[0]
    held = victim.admitted(stalled_at)  # routed to it while stuck: they waited
    # Routed around once it reported NOT_SERVING (nothing was admitted after): the first
    # limit, plus the router's reaction.
    figures(
        row(fleet.router, "hung", outcomes, f"{left_at - stalled_at:.2f} s",
            f"NOT_SERVING {left_at - stalled_at:.2f} s after its last step, streams failed "
            f"{stuck_at - stalled_at:.2f} s after it, exit 1 {exited_at - stuck_at:.2f} s "
            f"later; {len(failed)} streams in flight on it failed "
            f"({failed[0].detail if failed else '-'}); {len(held)} routed to it while stuck "
            "waited for the second limit, then were retried on the other worker; "
            f"{latency(outcomes, stalled_at)}")
    )  # fmt: skip
    assert code == 1, victim.text()
    not_lost(outcomes)
    assert not victim.admitted(left_at), victim.text()  # nothing new once NOT_SERVING
    for outcome in failed:  # only streams it had begun answering; they end once it is stuck
        assert outcome.started < stalled_at + 0.25, outcome
        assert outcome.ended < stuck_at + ERROR_WITHIN, outcome
    # What was sent to it while stuck had no answer yet: the router retried it elsewhere.
    after = [o for o in outcomes if o.started >= stalled_at + 0.25]
    assert after and all(o.result == SERVED for o in after), failures(after)[:3]


# -- the API key ----------------------------------------------------------------------------------


def _chat_status(base: str, key: str | None = None) -> tuple[int, str]:
    """A non-streamed chat through the router, with the client's bearer token if `key`."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({**_body(max_tokens=4), "stream": False}).encode()
    request = urllib.request.Request(base + CHAT, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(errors="replace")[:300]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def test_no_router_sends_an_api_key_to_a_grpc_worker(figures: Callable[[str], None]) -> None:
    """Both routers take `--api-key`, but neither sends it (nor the client's own bearer token)
    to a gRPC worker: their gRPC clients add no `authorization` metadata. Behind either one, a
    worker started with --api-key refuses every call but grpc.health.v1 (UNAUTHENTICATED), so
    a key-protected worker cannot be used through them; such workers are protected by the
    network instead (a private network, or mTLS terminated beside each end)."""
    require(_installed("smg"), "smg is not installed (make test)")
    require(_installed("vllm-router"), "vllm-router is not installed (make test)")
    key = "router-test-key"  # made up here, given to the worker and the router
    worker = Worker("keyed")
    worker.start("--api-key", key)
    refused = "missing or invalid credentials"  # the worker's UNAUTHENTICATED message
    try:
        # SMG: its --api-key is also the key its own clients must send; registering the
        # worker fails (the contract's HealthCheck RPC goes without the key), so the router
        # never serves the model.
        log = tiny_model().parent / "router-faults-smg-key.log"
        binary = smg_path()
        assert binary is not None
        port = free_port()
        command = [binary, "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", f"grpc://{worker.address}", "--model-path", str(tiny_model()),
                   "--backend", "vllm", "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(free_port()), "--api-key", key]  # fmt: skip
        with _running(command, log, lambda: refused in log.read_text(errors="replace"), "smg"):
            base = f"http://127.0.0.1:{port}"
            anonymous, _ = _chat_status(base)
            status, answer = _chat_status(base, key)
        assert anonymous == 401, anonymous  # the router's own check of its clients
        assert status == 404 and "model_not_found" in answer, (status, answer)
        figures(
            f"smg --api-key: the worker is never registered (its probe is refused: {refused}); "
            f"a chat with the key answers {status} model_not_found, without it {anonymous}"
        )
        # vllm-router: registers it (grpc.health.v1 needs no key); every generation is then
        # refused by the worker, whether or not the client sent the key, and answered 502.
        log = tiny_model().parent / "router-faults-vllm-router-key.log"
        binary = vllm_router_path()
        assert binary is not None
        port = free_port()
        command = [binary, "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", f"grpc://{worker.address}", "--prometheus-port",
                   str(free_port()), "--disable-circuit-breaker", "--api-key", key]  # fmt: skip
        env = {"VLLM_ROUTER_TOKENIZER": str(tiny_model())}
        # Ready once it answers at all: its model list asks the worker, which refuses. (Its
        # circuit breaker, off here, would soon answer 503 instead of the worker's refusal.)
        with _running(command, log, lambda: _answers(port), "vllm-router", env):
            base = f"http://127.0.0.1:{port}"
            answers = [_chat_status(base), _chat_status(base, key)]
        for status, answer in answers:
            assert status == 502 and refused in answer, (status, answer)
        assert not worker.admitted(), worker.text()
        figures(
            f"vllm-router --api-key: chat answers {answers[0][0]} with or without the client's "
            f"key ({answers[0][1][:100]})"
        )
    finally:
        worker.kill()
