"""MockAsyncEngine: the engine protocol with no vLLM, for fast CPU tests and CI.

Behaviour is deterministic so tests can state exact expectations:
- token i of the output is (last prompt token + 1 + i) mod vocab_size, so a
  prompt ending in eos_token_id - 3 stops on EOS after three tokens and a prompt
  ending in vocab_size - 1 produces token 0 first;
- a token's text is " <id>" (so the text of [5, 17] is " 5 17");
- each step emits up to `tokens_per_step` tokens, `step_delay` seconds apart;
- at most `max_num_seqs` requests run at once, the rest wait (visible in load());
- sampling values are validated with vLLM's rules, so bad input fails the same way.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from . import __version__
from .engine import (
    EngineStep,
    GenerationRequest,
    LoadSnapshot,
    ModelFacts,
    SamplingOptions,
    TokenLogprob,
)
from .errors import EngineUnavailable, InvalidRequest

MAX_LOGPROBS = 20


@dataclass
class _Request:
    request: GenerationRequest
    prompt: list[int]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    running: bool = False
    generated: int = 0


def mock_token_text(token_id: int) -> str:
    return f" {token_id}"


def validate_sampling(s: SamplingOptions, detokenize: bool) -> None:
    """vLLM's SamplingParams rules, restated for the mock."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise InvalidRequest(message)

    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):  # fmt: skip
        value = getattr(s, name)
        check(
            value is None or math.isfinite(value), f"{name} must be a finite number, got {value}."
        )
    if s.temperature is not None:
        check(s.temperature >= 0.0, f"temperature must be non-negative, got {s.temperature}.")
        check(s.temperature <= 2.0, f"temperature must be in [0, 2], got {s.temperature}.")
    if s.top_p is not None:
        check(0.0 < s.top_p <= 1.0, f"top_p must be in (0, 1], got {s.top_p}.")
    if s.top_k is not None:
        check(s.top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {s.top_k}.")
    if s.min_p is not None:
        check(0.0 <= s.min_p <= 1.0, f"min_p must be in [0, 1], got {s.min_p}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(s, name)
        check(value is None or -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}.")
    if s.repetition_penalty is not None:
        check(
            s.repetition_penalty > 0.0,
            f"repetition_penalty must be greater than zero, got {s.repetition_penalty}.",
        )
    if s.max_tokens is not None:
        check(s.max_tokens >= 1, f"max_tokens must be at least 1, got {s.max_tokens}.")
        check(
            s.min_tokens is None or s.min_tokens <= s.max_tokens,
            f"min_tokens must be less than or equal to max_tokens={s.max_tokens}, "
            f"got {s.min_tokens}.",
        )
    if s.logprobs is not None:
        check(s.logprobs >= -1, f"logprobs must be non-negative or -1, got {s.logprobs}.")
        check(
            0 <= s.logprobs <= MAX_LOGPROBS,  # -1 (whole vocabulary) is past the limit too
            f"Requested sample logprobs of {s.logprobs}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
        )
    check(not any(not x for x in s.stop), "stop cannot contain an empty string.")
    check(
        not s.stop or detokenize,
        "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
    )


class MockAsyncEngine:
    """A fake engine that keeps real request bookkeeping (running, waiting, aborts)."""

    def __init__(
        self,
        *,
        model_name: str = "mock-model",
        vocab_size: int = 32000,
        max_model_len: int = 4096,
        eos_token_id: int = 2,
        tokens_per_step: int = 1,
        step_delay: float = 0.0,
        max_num_seqs: int = 256,
        block_size: int = 16,
        kv_cache_tokens: int = 262144,
        dp_size: int = 1,
        die_after_tokens: int = 0,
    ) -> None:
        if tokens_per_step < 1:
            raise ValueError("tokens_per_step must be at least 1")
        self._facts = ModelFacts(
            model_name=model_name,
            served_model_name=model_name,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            dp_size=dp_size,
            block_size=block_size,
            eos_token_ids=(eos_token_id,),
            engine="mock",
            engine_version=__version__,
        )
        self.tokens_per_step = tokens_per_step
        self.step_delay = step_delay
        self._eos = eos_token_id
        self._kv_capacity = kv_cache_tokens
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._requests: dict[str, _Request] = {}
        self._cached_blocks: set[tuple[int, ...]] = set()
        self._dead: str | None = None
        self._die_after_tokens = die_after_tokens  # fault injection (0: never)
        self._tokens_produced = 0
        # Recent requests that ended without finishing (aborted or abandoned by the consumer).
        self.aborted_ids: deque[str] = deque(maxlen=10_000)
        self.last_request: GenerationRequest | None = None

    # -- protocol ---------------------------------------------------------------------------------

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def load(self) -> LoadSnapshot:
        running = [r for r in self._requests.values() if r.running]
        used = sum(len(r.prompt) + r.generated for r in running)
        return LoadSnapshot(
            running_requests=len(running),
            waiting_requests=len(self._requests) - len(running),
            kv_cache_usage=min(1.0, used / self._kv_capacity),
        )

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineUnavailable(f"engine is dead: {self._dead}")

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

    async def shutdown(self) -> None:
        for request_id in list(self._requests):
            await self.abort(request_id)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineStep, None]:
        await self.check_health()
        validate_sampling(request.sampling, request.detokenize)
        if request.request_id in self._requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already running")
        prompt = self._tokenize(request)
        self.last_request = request
        state = _Request(request, prompt)
        self._requests[request.request_id] = state
        finished = False
        held = False
        try:
            held = await self._wait_for_slot(state)
            state.running = held
            async for step in self._decode(state):
                finished = step.finished
                yield step
        finally:
            state.running = False
            if held:
                self._slots.release()
            del self._requests[request.request_id]
            if not finished and not state.aborted:
                # The consumer went away: same bookkeeping as an abort.
                self.aborted_ids.append(request.request_id)

    # -- fault injection --------------------------------------------------------------------------

    def kill(self, reason: str = "killed by fault injection") -> None:
        """Make the engine dead: in-flight and new requests fail with EngineUnavailable."""
        self._dead = reason
        for state in self._requests.values():
            state.wake.set()

    # -- internals --------------------------------------------------------------------------------

    def _tokenize(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        ids = [b % self._facts.vocab_size for b in (request.prompt_text or "").encode()]
        if len(ids) >= self._facts.max_model_len:
            raise InvalidRequest(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
                f"length of {self._facts.max_model_len}."
            )
        return ids

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

    def _cached_prefix(self, prompt: list[int]) -> int:
        block = self._facts.block_size
        cached = 0
        for end in range(block, len(prompt) + 1, block):
            key = tuple(prompt[:end])
            if key in self._cached_blocks:
                cached = end
            else:
                self._cached_blocks.add(key)
        return cached

    async def _decode(self, state: _Request) -> AsyncGenerator[EngineStep, None]:
        facts = self._facts
        s = state.request.sampling
        prompt = state.prompt
        max_tokens = s.max_tokens if s.max_tokens is not None else facts.max_model_len - len(prompt)
        min_tokens = s.min_tokens or 0
        stop_ids = set(s.stop_token_ids)
        detokenize = state.request.detokenize
        cached = self._cached_prefix(prompt)
        # Like vLLM, hold back the last characters while they could begin a stop string,
        # so a stop that straddles tokens or steps is cut before anything is sent.
        reach = max((len(x) for x in s.stop), default=1) - 1
        held = ""
        next_token = (prompt[-1] + 1) % facts.vocab_size
        while True:
            if self._dead is not None:
                raise EngineUnavailable(f"engine is dead: {self._dead}")
            if state.aborted:
                yield self._step(state, [], "", "abort", None, cached)
                return
            new_ids: list[int] = []
            pieces: list[str] = []
            finish: str | None = None
            stop_reason: int | str | None = None
            for _ in range(self.tokens_per_step):
                token = next_token
                next_token = (next_token + 1) % facts.vocab_size
                new_ids.append(token)
                state.generated += 1
                self._tokens_produced += 1
                if self._die_after_tokens and self._tokens_produced >= self._die_after_tokens:
                    self.kill(f"fault injection after {self._tokens_produced} tokens")
                    raise EngineUnavailable(f"engine is dead: {self._dead}")
                eligible = state.generated > min_tokens
                if eligible and token in stop_ids:
                    finish, stop_reason = "stop", token
                elif eligible and token == self._eos and not s.ignore_eos:
                    finish, stop_reason = "stop", token
                elif detokenize and not (token == self._eos and s.skip_special_tokens is not False):
                    window = held + mock_token_text(token)
                    matched = _find_stop(window, s.stop) if s.stop else None
                    if matched is not None and eligible:
                        stop, at = matched
                        keep = at + (len(stop) if s.include_stop_str_in_output else 0)
                        pieces.append(window[:keep])
                        held = ""
                        finish, stop_reason = "stop", stop
                    elif len(window) > reach:
                        pieces.append(window[: len(window) - reach])
                        held = window[len(window) - reach :]
                    else:
                        held = window
                if finish is None and state.generated >= max_tokens:
                    finish = "length"
                if finish is not None:
                    pieces.append(held)
                    break
            yield self._step(state, new_ids, "".join(pieces), finish, stop_reason, cached)
            if finish is not None:
                return
            if self.step_delay > 0:
                try:
                    await asyncio.wait_for(state.wake.wait(), self.step_delay)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)

    def _step(
        self,
        state: _Request,
        token_ids: list[int],
        text: str,
        finish: str | None,
        stop_reason: int | str | None,
        cached: int,
    ) -> EngineStep:
        k = state.request.sampling.logprobs
        logprobs = None
        if k is not None:
            vocab = self._facts.vocab_size
            logprobs = [
                TokenLogprob(
                    token_id=t,
                    logprob=-0.5,
                    top=tuple(((t + j) % vocab, -0.5 - j) for j in range(max(k, 0))),
                )
                for t in token_ids
            ]
        return EngineStep(
            token_ids=token_ids,
            text=text,
            finished=finish is not None,
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=len(state.prompt),
            completion_tokens=state.generated,
            cached_tokens=cached,
            logprobs=logprobs,
        )


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The stop string that occurs earliest in `text`, and where."""
    best: tuple[str, int] | None = None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and (best is None or at < best[1]):
            best = (stop, at)
    return best
