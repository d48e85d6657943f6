"""MockAsyncEngine: the engine protocol with no vLLM, for fast CPU tests and CI.

Behaviour is deterministic so tests can state exact expectations:
- token i of the output is (last prompt token + 1 + i) mod vocab_size, so a
  prompt ending in eos_token_id - 3 stops on EOS after three tokens and a prompt
  ending in vocab_size - 1 produces token 0 first;
- a token's text is " <id>" (so the text of [5, 17] is " 5 17");
- text is "tokenized" as its UTF-8 bytes mod vocab_size, with no special tokens;
- each step emits up to `tokens_per_step` tokens, `step_delay` seconds apart;
- at most `max_num_seqs` requests run at once, the rest wait (visible in load());
- a logprob is -0.5 for the sampled token and the j-th alternative is (id + j, -0.5 - j).
Where it intentionally differs from vLLM: it checks only the sampling rules a
request can reach it with (the server has already refused empty stop strings and
prompts that do not fit), keeps no real KV cache (a prompt block is "cached" once
seen, cache usage is tokens held / kv_cache_tokens), and never preempts.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from .. import __version__
from ..engine import EngineStep, GenerationRequest, LoadSnapshot, ModelFacts
from ..engine.types import FinishReason
from ..errors import EngineUnavailable, InvalidRequest
from .mock_sampling import mock_logprobs, mock_token_text, validate_sampling
from .stop_strings import StopStringMatcher


@dataclass(frozen=True)
class MockConfig:
    """The mock's settings; `vllm-servicer --mock-<name>` flags are derived from these fields."""

    model_name: str = field(default="mock-model", metadata={"help": "served model name"})
    vocab_size: int = 32000
    max_model_len: int = 4096
    eos_token_id: int = 2
    tokens_per_step: int = field(default=1, metadata={"help": "tokens each engine step makes"})
    step_delay: float = field(default=0.0, metadata={"help": "seconds between engine steps"})
    max_num_seqs: int = field(default=256, metadata={"help": "requests running at once"})
    block_size: int = 16
    kv_cache_tokens: int = 262144
    dp_size: int = 1
    die_after_tokens: int = field(
        default=0,
        metadata={"help": "fault injection: the engine dies after this many tokens (0: never)"},
    )


@dataclass
class _Request:
    request: GenerationRequest
    prompt: list[int]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    running: bool = False
    generated: int = 0


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
        )
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self._requests: dict[str, _Request] = {}
        self._cached_blocks: set[tuple[int, ...]] = set()
        self._dead: str | None = None
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
            kv_cache_usage=min(1.0, used / self.config.kv_cache_tokens),
        )

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineUnavailable(f"engine is dead: {self._dead}")

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

    async def shutdown(self) -> None:
        for request_id in list(self._requests):
            await self.abort(request_id)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineStep, None]:
        await self.check_health()
        validate_sampling(request.sampling, request.detokenize)
        if request.prompt_token_ids is None:
            raise ValueError("MockAsyncEngine.generate needs prompt_token_ids")
        if request.request_id in self._requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already running")
        self.last_request = request
        state = _Request(request, request.prompt_token_ids)
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

    def _die_if_due(self) -> None:
        self._tokens_produced += 1
        limit = self.config.die_after_tokens
        if limit and self._tokens_produced >= limit:
            self.kill(f"fault injection after {self._tokens_produced} tokens")
        if self._dead is not None:
            raise EngineUnavailable(f"engine is dead: {self._dead}")

    async def _decode(self, state: _Request) -> AsyncGenerator[EngineStep, None]:
        facts = self._facts
        s = state.request.sampling
        prompt = state.prompt
        max_tokens = s.max_tokens if s.max_tokens is not None else facts.max_model_len - len(prompt)
        stop_ids = set(s.stop_token_ids)
        detokenize = state.request.detokenize
        cached = self._cached_prefix(prompt)
        matcher = StopStringMatcher(s.stop, bool(s.include_stop_str_in_output))
        eos = self.config.eos_token_id
        next_token = (prompt[-1] + 1) % facts.vocab_size
        while True:
            if self._dead is not None:
                raise EngineUnavailable(f"engine is dead: {self._dead}")
            if state.aborted:
                yield self._step(state, [], "", "abort", None, cached)
                return
            new_ids: list[int] = []
            pieces: list[str] = []
            finish: FinishReason | None = None
            stop_reason: int | str | None = None
            for _ in range(self.config.tokens_per_step):
                token = next_token
                next_token = (next_token + 1) % facts.vocab_size
                new_ids.append(token)
                state.generated += 1
                self._die_if_due()
                eligible = state.generated > (s.min_tokens or 0)
                if eligible and (token in stop_ids or (token == eos and not s.ignore_eos)):
                    finish, stop_reason = "stop", token
                elif detokenize and not (token == eos and s.skip_special_tokens is not False):
                    text, matched = matcher.feed(mock_token_text(token), may_stop=eligible)
                    pieces.append(text)
                    if matched is not None:
                        finish, stop_reason = "stop", matched
                if finish is None and state.generated >= max_tokens:
                    finish = "length"
                if finish is not None:
                    pieces.append(matcher.flush())
                    break
            yield self._step(state, new_ids, "".join(pieces), finish, stop_reason, cached)
            if finish is not None:
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
        token_ids: list[int],
        text: str,
        finish: FinishReason | None,
        stop_reason: int | str | None,
        cached: int,
    ) -> EngineStep:
        k = state.request.sampling.logprobs
        logprobs = None if k is None else mock_logprobs(token_ids, k, self._facts.vocab_size)
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
