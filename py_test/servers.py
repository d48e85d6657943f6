"""Run the servicer as a real process (the CLI), for lifecycle tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field

from harness import TRANSPORT

READY = re.compile(r"ready on (\S+):(\d+)")
# How long a server's orphans (see ServerProcess.wait) may hold its output once it has exited.
ORPHAN_GRACE = 10.0
# Runs the CLI with vLLM made unimportable, as on a machine without it.
WITHOUT_VLLM = (
    "import sys; sys.modules['vllm'] = None; "
    "from vllm_router.cli import main; sys.argv[0] = 'vllm-servicer'; main()"
)


@dataclass
class ServerProcess:
    process: asyncio.subprocess.Process
    port: int
    log: list[str] = field(default_factory=list)
    _pump: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def wait(self, timeout: float) -> int:
        """The server's exit code once it has exited, with its log read to the end.

        Not asyncio's `Process.wait`: that returns only once every holder of the server's
        output has closed it too. When a test kills vLLM's engine core, the core's worker
        process (VLLM::Worker, orphaned, still in the server's process group) holds it until
        it notices its parent is gone: 3 s here (the server had exited 1 0.24 s after the
        kill), still at the 60 s limit once in CI. What is left of the group once the server
        has exited is killed after a grace, so the log still ends."""
        code = await self._exited(timeout)
        if self._pump is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._pump), ORPHAN_GRACE)
            except asyncio.TimeoutError:
                self.kill()
                await self._pump
        return code

    async def _exited(self, timeout: float) -> int:
        """The server's own exit code, as soon as it has one (asyncio.TimeoutError past
        `timeout`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (code := self.process.returncode) is None:
            if loop.time() > deadline:
                raise asyncio.TimeoutError(f"the server was still running after {timeout} s")
            await asyncio.sleep(0.05)
        return code

    def kill(self) -> None:
        """SIGKILL the server and everything it started (vLLM's engine-core processes would
        otherwise outlive it and keep their memory)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    async def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (the server drains and shuts its engine down), then kill what is left."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await self._exited(timeout)
        self.kill()


async def start_together(*starts: Awaitable[ServerProcess]) -> list[ServerProcess]:
    """Servers started at once (a module's workers: their start-ups overlap on the cores), in
    the order given. If one fails to start, the others are killed and its error raised."""
    outcomes = await asyncio.gather(*starts, return_exceptions=True)
    started = [outcome for outcome in outcomes if isinstance(outcome, ServerProcess)]
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            for server in started:
                server.kill()
            raise outcome
    return started


async def stop_together(started: Iterable[ServerProcess | None]) -> None:
    """`stop` each of `started` (None: never started) at once: their drains overlap."""
    await asyncio.gather(*(server.stop() for server in started if server is not None))


def command(*args: str, without_vllm: bool = False) -> list[str]:
    """The CLI with `args`, on the suite's transport (harness.TRANSPORT) unless they name one."""
    if TRANSPORT != "grpcio" and "--transport" not in args:
        args = (*args, "--transport", TRANSPORT)
    if without_vllm:
        return [sys.executable, "-c", WITHOUT_VLLM, *args]
    return [sys.executable, "-m", "vllm_router.vllm_servicer", *args]


async def start(
    *args: str,
    without_vllm: bool = False,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """The CLI with `args` (and `env` added to this environment), once it is ready."""
    process = await asyncio.create_subprocess_exec(
        *command(*args, without_vllm=without_vllm),
        env={**os.environ, **env} if env else None,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # its own process group: kill() reaches its children
    )
    log: list[str] = []
    assert process.stdout is not None
    stdout = process.stdout  # narrowed, for the closures below

    async def next_line() -> str:
        raw = await stdout.readline()
        if not raw:
            raise RuntimeError("server exited before it was ready:\n" + "".join(log))
        line = raw.decode(errors="replace")
        log.append(line)
        return line

    async def until_ready() -> int:
        while True:
            match = READY.search(await next_line())
            if match:
                return int(match.group(2))

    try:
        port = await asyncio.wait_for(until_ready(), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise

    async def pump() -> None:
        while raw := await stdout.readline():
            log.append(raw.decode(errors="replace"))

    server = ServerProcess(process, port, log)
    server._pump = asyncio.create_task(pump())
    return server
