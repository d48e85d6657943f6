"""MockAsyncEngine: the engine protocol with no vLLM, for fast CPU tests and CI.

Behaviour is deterministic so tests can state exact expectations:
- token i of the output is (last prompt token + 1 + i) mod vocab_size, so a prompt ending
  in eos_token_id - 3 stops on EOS after three tokens and one ending in vocab_size - 1
  produces token 0 first; a token's text is " <id>" (the text of [5, 17] is " 5 17");
- text is "tokenized" as its UTF-8 bytes mod vocab_size, with no special tokens;
- each step emits up to `tokens_per_step` tokens, `step_delay` seconds apart;
- n samples, logit_bias of +100 / -100 and the `choice` constraint work as mock_decode.py
  says; other new sampling fields, LoRA, embeddings and tokenizer files are UNIMPLEMENTED
  (the message names the mock);
- at most `max_num_seqs` requests run at once, the rest wait (visible in load());
- a logprob is -0.5 for the sampled token and the j-th alternative is (id + j, -0.5 - j);
- fault injection: `die_after_tokens` kills the engine, `stall_after_tokens` stops every
  request's steps for `stall_seconds` (0: for good) with the engine alive, as a wedged GPU
  step looks, `fault_finish_reason` finishes every sample with vLLM's `error` or
  `repetition` after two tokens;
- it steps a request only while its consumer asks for the next step, so a request whose
  consumer is busy (its step is out, not yet taken) is not work the engine owes
  (`progress`).
Where it intentionally differs from vLLM: it checks only the sampling rules a request can
reach it with (the server has already refused empty stop strings and prompts that do not
fit), keeps no real KV cache (a prompt block is "cached" once seen, cache usage is tokens
held / kv_cache_tokens), and never preempts.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.registry import Collector

from .. import __version__
from ..engine import (
    DirectReceiver,
    DirectSteps,
    Embedding,
    EngineProgress,
    EngineStep,
    GenerationRequest,
    KvEventBatch,
    KvEventSource,
    LoadSnapshot,
    LoraAdapter,
    ModelFacts,
    PauseMode,
    RankLoad,
    takes_direct_steps,
)
from ..engine.types import FinishReason
from ..errors import (
    EngineDead,
    InvalidRequest,
    NotConfigured,
    Unsupported,
)
from .mock_config import MockConfig
from .mock_decode import SampleDecoder, cached_prefix, check_supported, every_interval
from .mock_load import load_of, rank_loads
from .mock_media import media_limits, prompt_with_media
from .mock_sampling import mock_logprobs, validate_sampling
from .mock_weights import MockWeights

NO_LORA = "the mock engine has no LoRA adapters"
NO_SLEEP = "sleep mode is not enabled on this engine (the mock has none)"
FAULT_ERROR = "mock engine fault injection (--mock-fault-finish-reason error)"


@dataclass
class _Request:
    request: GenerationRequest
    prompt: list[int]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    running: bool = False
    generated: int = 0
    # Admitted before a pause in "wait" mode: runs to its end while others are held.
    through_pause: bool = False
    # Its latest step is out and its consumer has not asked for the next one yet.
    handed_out: bool = False


class MockAsyncEngine:
    """A fake engine that keeps real request bookkeeping (running, waiting, aborts)."""

    def __init__(self, config: MockConfig | None = None) -> None:
        config = config or MockConfig()
        if config.tokens_per_step < 1:
            raise ValueError("tokens_per_step must be at least 1")
        self.config = config
        self._facts = ModelFacts(
            model_name=config.model_name,
            served_model_name=config.model_name,
            max_model_len=config.max_model_len,
            vocab_size=config.vocab_size,
            dp_size=config.dp_size,
            block_size=config.block_size,
            eos_token_ids=(config.eos_token_id,),
            engine="mock",
            engine_version=__version__,
            max_num_seqs=config.max_num_seqs,
            grammar_after_reasoning=False,  # no reasoning parser: constraints bind at once
            weight_transfer_backend=config.weight_transfer_backend,
            media_limits=media_limits(config),
            allowed_media_domains=tuple(d for d in config.allowed_media_domains.split(",") if d),
            allowed_local_media_path=config.allowed_local_media_path,
        )
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self._requests: dict[str, _Request] = {}
        self._cached_blocks: set[tuple[int, ...]] = set()
        self._dead: str | None = None
        self._tokens_produced = 0
        # Recent requests that ended without finishing (aborted or abandoned by the consumer).
        self.aborted_ids: deque[str] = deque(maxlen=10_000)
        self.last_request: GenerationRequest | None = None
        # Set while generation runs; cleared by `pause` (new and kept requests wait).
        self._running = asyncio.Event()
        self._running.set()
        self._pause_drained = asyncio.Event()  # set when no request runs through a pause
        self.weights = MockWeights(self._facts.weight_transfer_backend)
        self._last_step = time.monotonic()
        # Monotonic time until which every request's steps are held (stall injection).
        self._stalled_until: float | None = None
        self._stall_over = asyncio.Event()

    # -- protocol ---------------------------------------------------------------------------------

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def load(self) -> LoadSnapshot:
        return load_of(self._requests.values(), self.config.kv_cache_tokens)

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"engine is dead: {self._dead}")

    async def tokenize(self, text: str) -> list[int]:
        return [b % self._facts.vocab_size for b in text.encode()]

    async def reset_prefix_cache(self) -> bool:
        await self.check_health()
        if any(r.running for r in self._requests.values()):
            return False
        self._cached_blocks.clear()
        return True

    async def abort(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and not state.aborted:
            state.aborted = True
            self.aborted_ids.append(request_id)
            state.wake.set()

    def prometheus_registry(self) -> Collector | None:
        return None  # the mock has no engine series; the front end's own are still served

    async def shutdown(self) -> None:
        for request_id in list(self._requests):
            await self.abort(request_id)

    def progress(self) -> EngineProgress:
        running = self._running.is_set()
        busy = running and any(not r.handed_out for r in self._requests.values())
        return EngineProgress(busy=busy, last_step=self._last_step, held=not running)

    def loads(self) -> list[RankLoad]:
        held = self._requests.values()
        return rank_loads(held, self.config.kv_cache_tokens, self._facts.dp_size)

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> Embedding:
        raise Unsupported("the mock engine serves no pooling model (no embeddings)")

    async def tokenizer_files(self) -> list[tuple[str, bytes]]:
        raise Unsupported("the mock engine has no tokenizer files (it tokenizes UTF-8 bytes)")

    async def list_lora_adapters(self) -> list[LoraAdapter]:
        raise Unsupported(NO_LORA)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        raise Unsupported(NO_LORA)

    async def unload_lora_adapter(self, name: str) -> None:
        raise Unsupported(NO_LORA)

    async def kv_events(self) -> AsyncGenerator[KvEventBatch, None]:
        raise Unsupported("the mock engine publishes no KV cache events")
        yield  # pragma: no cover - makes this an async generator

    async def start_profile(self) -> None:
        raise Unsupported("the mock engine has no profiler")

    def kv_event_sources(self) -> list[KvEventSource]:
        return []  # it publishes none

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._running.clear()
        if mode == "abort":
            for request_id in list(self._requests):
                await self.abort(request_id)
        elif mode == "wait":
            for state in self._requests.values():
                state.through_pause = True
            self._pause_drained.clear()
            if self._requests:
                await self._pause_drained.wait()
        if clear_cache:
            self._cached_blocks.clear()

    async def resume(self) -> None:
        self._running.set()
        self._last_step = time.monotonic()  # held requests move from now on

    async def is_paused(self) -> bool:
        if self._stalled_until is not None:
            await self._stall()  # a stalled engine's loop answers no question either
        return not self._running.is_set()

    async def sleep(self, level: int, mode: PauseMode, *, reset_connector: bool = True) -> None:
        raise NotConfigured(NO_SLEEP)

    async def wake_up(self, tags: list[str] | None) -> None:
        raise NotConfigured(NO_SLEEP)

    async def is_sleeping(self) -> bool:
        return False

    async def weight_version(self) -> str:
        return self.weights.version

    async def set_weight_version(self, version: str) -> None:
        self.weights.version = version

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        self.weights.init(init_info)

    async def start_weight_update(self, *, draft: bool) -> None:
        self.weights.start(draft=draft)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        self.weights.update(update_info)

    async def finish_weight_update(self, version: str | None) -> None:
        self.weights.finish(version)

    @property
    def weight_updates(self) -> list[dict[str, Any]]:
        """Every update_info the mock took, in order."""
        return self.weights.updates

    stop_profile = start_profile

    def check_sampling(self, request: GenerationRequest) -> None:
        validate_sampling(request.sampling, request.detokenize)
        check_supported(request.sampling)

    async def generate(
        self, request: GenerationRequest, *, receiver: DirectReceiver | None = None
    ) -> AsyncGenerator[EngineStep, None]:
        await self.check_health()
        self.check_sampling(request)
        if request.lora_name is not None:
            raise Unsupported(NO_LORA)
        if request.prompt_token_ids is None:
            raise ValueError("MockAsyncEngine.generate needs prompt_token_ids")
        if request.request_id in self._requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already running")
        self.last_request = request
        if not self.progress().busy:
            self._last_step = time.monotonic()  # work arrives at an idle engine
        state = _Request(request, prompt_with_media(request, self.config))
        self._requests[request.request_id] = state
        finished = False
        held = False
        try:
            held = await self._wait_for_slot(state)
            state.running = held
            # vLLM streams a request at the larger of its own interval and the engine's.
            engine_interval = max(1, self.config.stream_interval)
            interval = max(request.sampling.stream_interval or 1, engine_interval)
            direct = (
                DirectSteps(receiver)
                if receiver is not None
                and takes_direct_steps(
                    request.sampling,
                    request.sampling.n or 1,
                    detokenize=request.detokenize,
                    engine_interval=engine_interval,
                )
                else None
            )
            async for step in every_interval(self._decode(state, direct), interval):
                finished = step.finished
                state.handed_out = True
                yield step
                state.handed_out = False
        finally:
            state.running = False
            if held:
                self._slots.release()
            del self._requests[request.request_id]
            if not any(r.through_pause for r in self._requests.values()):
                self._pause_drained.set()
            if not finished and not state.aborted:
                # The consumer went away: same bookkeeping as an abort.
                self.aborted_ids.append(request.request_id)

    # -- fault injection --------------------------------------------------------------------------

    def kill(self, reason: str = "killed by fault injection") -> None:
        """Make the engine dead: in-flight and new requests fail with EngineDead."""
        self._dead = reason
        for state in self._requests.values():
            state.wake.set()

    # -- internals --------------------------------------------------------------------------------

    async def _wait_for_slot(self, state: _Request) -> bool:
        """Wait for a running slot; False when aborted or dead before one was free."""
        if not self._slots.locked():
            await self._slots.acquire()
            return True
        acquire = asyncio.ensure_future(self._slots.acquire())
        woken = asyncio.ensure_future(state.wake.wait())
        try:
            await asyncio.wait({acquire, woken}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            woken.cancel()
            if not acquire.cancel() and not acquire.cancelled():
                self._slots.release()  # it got the slot just before we were cancelled
            raise
        woken.cancel()
        got_slot = not acquire.cancel() and not acquire.cancelled()
        if got_slot and (state.aborted or self._dead is not None):
            self._slots.release()
            return False
        return got_slot

    async def _stall(self) -> None:
        """Hold every request's steps until the injected stall is over (never, when it is
        for good: as a wedged engine, it answers nothing, aborts included)."""
        until = self._stalled_until
        assert until is not None
        if until != float("inf"):
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            self._stalled_until = None
        else:
            await self._stall_over.wait()

    async def _paused_wait(self, state: _Request) -> None:
        """Hold a request while generation is paused (until resumed, aborted or dead)."""
        resumed = asyncio.ensure_future(self._running.wait())
        woken = asyncio.ensure_future(state.wake.wait())
        try:
            await asyncio.wait({resumed, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            resumed.cancel()
            woken.cancel()

    def _die_if_due(self) -> None:
        self._tokens_produced += 1
        limit = self.config.die_after_tokens
        if limit and self._tokens_produced >= limit:
            self.kill(f"fault injection after {self._tokens_produced} tokens")
        if self._tokens_produced == self.config.stall_after_tokens:
            seconds = self.config.stall_seconds
            self._stalled_until = time.monotonic() + seconds if seconds > 0 else float("inf")
        if self._dead is not None:
            raise EngineDead(f"engine is dead: {self._dead}")

    async def _decode(
        self, state: _Request, direct: DirectSteps | None = None
    ) -> AsyncGenerator[EngineStep, None]:
        """The request's steps; with `direct`, each plain one is given to the consumer's
        receiver by the rule of direct.py (this generator runs only while its consumer
        waits on it, and buffers nothing: a refused step is yielded at once)."""
        request = state.request
        s = request.sampling
        cached = cached_prefix(self._cached_blocks, state.prompt, self._facts.block_size)
        active = [
            SampleDecoder(i, state.prompt, s, self._facts, self.config, request.detokenize)
            for i in range(s.n or 1)
        ]
        if self.config.prefill_delay > 0:
            await asyncio.sleep(self.config.prefill_delay)
        while active:
            if self._stalled_until is not None:
                await self._stall()
            if not self._running.is_set() and not state.aborted and not state.through_pause:
                await self._paused_wait(state)
            if self._dead is not None:
                raise EngineDead(f"engine is dead: {self._dead}")
            if state.aborted:
                for sample in active:
                    yield self._step(state, sample, [], "", "abort", None, cached)
                return
            for sample in list(active):
                new_ids, text, finish, stop_reason = sample.step(
                    self.config.tokens_per_step, self._die_if_due
                )
                state.generated += len(new_ids)
                plain = finish is None  # a step that finishes carries more than tokens
                first = sample.generated == len(new_ids)
                if direct is None:
                    yield self._step(state, sample, new_ids, text, finish, stop_reason, cached)
                elif not (
                    plain and direct.give(new_ids, first=first, waiting=True, buffered=False)
                ):
                    direct.count(new_ids)  # its one sample's count: what the receiver is told
                    yield self._step(state, sample, new_ids, text, finish, stop_reason, cached)
                if finish is not None:
                    active.remove(sample)
            self._last_step = time.monotonic()
            if not active:
                return
            if self.config.step_delay > 0:
                try:
                    await asyncio.wait_for(state.wake.wait(), self.config.step_delay)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)

    def _step(
        self,
        state: _Request,
        sample: SampleDecoder,
        token_ids: list[int],
        text: str,
        finish: FinishReason | None,
        stop_reason: int | str | None,
        cached: int,
    ) -> EngineStep:
        k = state.request.sampling.logprobs
        return EngineStep(
            token_ids=token_ids,
            text=text,
            finished=finish is not None,
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=len(state.prompt),
            completion_tokens=sample.generated,
            cached_tokens=cached,
            logprobs=None if k is None else mock_logprobs(token_ids, k, self._facts.vocab_size),
            index=sample.index,
            error=FAULT_ERROR if finish == "error" else None,
        )
