"""First-token marks, for `bench.py --timeline`: every process of a target (the front end and
its engine core, ours or a Rust front end's) records when a request passes each stage.

bench.py puts this directory first on the target's PYTHONPATH (Python imports
`sitecustomize` at start; the engine core a front end starts inherits the environment) and
sets BENCH_TIMELINE_DIR; without it this does nothing. Each process appends its marks to
`marks-<pid>.jsonl` there, one `{"kind", "at"}` line per mark, `at` from time.monotonic():
CLOCK_MONOTONIC, the clock of the bench's client (time.perf_counter) and of vLLM's own
request timestamps, one clock across the processes of this machine. The bench assigns the
marks to a request by time (requests run one at a time), so no request id needs to match
across front ends.

Each wrapper records the first occurrence per request only (a request's first step, its
first output), so a token's path past the first costs a set lookup. What is wrapped is
vLLM's, per module as it is imported (a wrapper whose target is missing says so on stderr
and records nothing), and our servicers' stream handlers:

| mark | process | where |
|---|---|---|
| fe_handler, fe_yield1, fe_yield2 | ours | a stream handler starts; yields its first two messages |
| fe_add_sent | front end | `AsyncMPClient._send_input_message` of an ADD (the ZMQ send) |
| core_decoded | engine core | the input thread has decoded the request |
| core_queued | engine core | it is put on the core's input queue |
| core_add | engine core | `EngineCore.add_request` (the busy loop took it) |
| step_start, step_end | engine core | the step (or batch-queue step) of its first output |
| core_out_put | engine core | that output is put on the output queue |
| core_out_taken | engine core | the output thread took it (it needs the GIL) |
| core_out_sent | engine core | handed to ZMQ |
| fe_out_decoded | front end | the front end decoded it (`MsgpackDecoder.decode`) |
| fe_out_taken | front end | `AsyncMPClient.get_output_async` returned it (the output loop) |
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_DIR = os.environ.get("BENCH_TIMELINE_DIR")


def _install() -> None:
    assert _DIR is not None
    marks: list[tuple[str, float]] = []
    lock = threading.Lock()
    path = os.path.join(_DIR, f"marks-{os.getpid()}.jsonl")

    def flush() -> None:
        with lock:  # the flusher thread and atexit
            taken = marks[:]
            del marks[: len(taken)]  # not what was appended since the copy
        if taken:
            with open(path, "a") as out:
                out.writelines(json.dumps({"kind": k, "at": t}) + "\n" for k, t in taken)

    def flusher() -> None:
        while True:
            time.sleep(0.5)
            flush()

    threading.Thread(target=flusher, daemon=True, name="timeline-flush").start()
    atexit.register(flush)

    def mark(kind: str) -> None:
        marks.append((kind, time.monotonic()))  # list.append is atomic under the GIL

    def first_time(seen: set[str], request_ids: list[str]) -> bool:
        new = [r for r in request_ids if r not in seen]
        seen.update(new)
        if len(seen) > 100_000:
            seen.clear()
        return bool(new)

    def output_ids(outputs: Any) -> list[str]:
        return [o.request_id for o in getattr(outputs, "outputs", None) or () if o.new_token_ids]

    # -- the stdlib queues of the engine core: input (ADD), output (put, taken) ---------------
    put_seen: set[str] = set()
    taken_seen: set[str] = set()
    queue_put, queue_get = queue.Queue.put_nowait, queue.Queue.get

    def put_nowait(self: queue.Queue, item: Any) -> None:
        if isinstance(item, tuple) and len(item) == 2:
            kind, payload = item
            if getattr(kind, "name", None) == "ADD":
                mark("core_queued")
            elif isinstance(kind, int) and first_time(put_seen, output_ids(payload)):
                mark("core_out_put")
        queue_put(self, item)

    # core_out_sent: the output thread's next send after it took a first output.
    sent_pending: list[bool] = []

    def get(self: queue.Queue, *args: Any, **kwargs: Any) -> Any:
        item = queue_get(self, *args, **kwargs)
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int):
            if first_time(taken_seen, output_ids(item[1])):
                mark("core_out_taken")
                sent_pending.append(True)
        return item

    queue.Queue.put_nowait = put_nowait  # type: ignore[method-assign]
    queue.Queue.get = get  # type: ignore[method-assign]

    # -- vLLM's modules, as they are imported ------------------------------------------------
    def wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]):
        original = getattr(owner, name, None)
        if original is None:
            print(f"timeline probe: {owner.__name__}.{name} not found", file=sys.stderr)
            return
        wrapper: Any = functools.wraps(original)(make(original))
        if isinstance(inspect.getattr_static(owner, name), staticmethod):
            wrapper = staticmethod(wrapper)
        setattr(owner, name, wrapper)

    def patch_serial_utils(module: Any) -> None:
        decoded: set[str] = set()

        def make(decode: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(self: Any, bufs: Any) -> Any:
                result = decode(self, bufs)
                if hasattr(result, "prompt_token_ids") and hasattr(result, "request_id"):
                    mark("core_decoded")
                elif first_time(decoded, output_ids(result)):
                    mark("fe_out_decoded")
                return result

            return wrapper

        wrap(module.MsgpackDecoder, "decode", make)

    def patch_core(module: Any) -> None:
        stepped: set[str] = set()

        def add(add_request: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                mark("core_add")
                return add_request(self, *args, **kwargs)

            return wrapper

        def step(step_fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(self: Any) -> Any:
                started = time.monotonic()
                result = step_fn(self)
                outputs = result[0] or {}  # step_with_batch_queue may have none yet
                ids = [i for out in outputs.values() for i in output_ids(out)]
                if first_time(stepped, ids):
                    marks.append(("step_start", started))
                    mark("step_end")
                return result

            return wrapper

        def send(send_fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any) -> Any:  # a static method: (socket, buffers)
                result = send_fn(*args)
                if sent_pending:
                    sent_pending.clear()
                    mark("core_out_sent")
                return result

            return wrapper

        wrap(module.EngineCore, "add_request", add)
        wrap(module.EngineCore, "step", step)
        wrap(module.EngineCore, "step_with_batch_queue", step)  # async scheduling's
        wrap(module.EngineCoreProc, "_send_msg_tracking_payload", send)

    def patch_core_client(module: Any) -> None:
        taken: set[str] = set()

        def send(send_input: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(self: Any, message: Any, *args: Any, **kwargs: Any) -> Any:
                if message and message[0] == b"\x00":  # EngineCoreRequestType.ADD
                    mark("fe_add_sent")
                return send_input(self, message, *args, **kwargs)

            return wrapper

        def get(get_output: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapper(self: Any) -> Any:
                outputs = await get_output(self)
                if first_time(taken, output_ids(outputs)):
                    mark("fe_out_taken")
                return outputs

            return wrapper

        wrap(module.AsyncMPClient, "_send_input_message", send)
        wrap(module.AsyncMPClient, "get_output_async", get)

    def stream_handler(handler: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapper(self: Any, request: Any, context: Any) -> Any:
            mark("fe_handler")
            n = 0
            async for message in handler(self, request, context):
                if n < 2:
                    n += 1
                    mark(f"fe_yield{n}")
                yield message

        return wrapper

    def patch_servicer(class_name: str, method: str) -> Callable[[Any], None]:
        def patch(module: Any) -> None:
            owner = getattr(module, class_name)
            if inspect.isasyncgenfunction(getattr(owner, method, None)):
                wrap(owner, method, stream_handler)

        return patch

    patches: dict[str, Callable[[Any], None]] = {
        "vllm.v1.serial_utils": patch_serial_utils,
        "vllm.v1.engine.core": patch_core,
        "vllm.v1.engine.core_client": patch_core_client,
        "vllm_router.contracts.vllm_native.servicer": patch_servicer(
            "NativeInferenceServicer", "GenerateStream"
        ),
        "vllm_router.contracts.vllm_engine_v1.servicer": patch_servicer(
            "VllmEngineServicer", "GenerateStream"
        ),
        "vllm_router.contracts.vllm_grpc_engine.servicer": patch_servicer(
            "VllmGrpcServicer", "Generate"
        ),
    }

    class PatchingLoader(importlib.abc.Loader):
        """A module's own loader, then its patch."""

        def __init__(self, name: str, loader: importlib.abc.Loader) -> None:
            self.name, self.loader = name, loader

        def create_module(self, spec: Any) -> Any:
            return self.loader.create_module(spec)

        def exec_module(self, module: Any) -> None:
            self.loader.exec_module(module)
            try:
                patches[self.name](module)
            except Exception as exc:  # a probe never breaks what it measures
                print(f"timeline probe: {self.name}: {exc!r}", file=sys.stderr)

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name not in patches:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return None
            spec.loader = PatchingLoader(name, spec.loader)
            return spec

    sys.meta_path.insert(0, AfterImport())


if _DIR:
    _install()
