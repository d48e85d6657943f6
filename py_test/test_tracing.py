"""OpenTelemetry: a W3C traceparent in the call metadata links the engine's span to the
caller's trace, exported over OTLP/gRPC (--otlp-traces-endpoint) to a real receiver."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from harness import Harness, request
from otlp_receiver import TraceReceiver, attributes


async def _spans(otlp: TraceReceiver, trace_id: str, timeout: float = 15.0) -> list:
    for _ in range(int(timeout / 0.1)):
        spans = otlp.spans_of_trace(trace_id)
        if spans:
            return spans
        await asyncio.sleep(0.1)
    raise AssertionError(f"no span of trace {trace_id} reached the collector in {timeout}s")


@pytest.mark.vllm
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
async def test_engine_span_joins_the_callers_trace(
    real: Harness, otlp: TraceReceiver, rpc: str
) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"), ("tracestate", "team=infer"))
    req = request([5, 6, 7, 8], request_id=f"traced-{rpc}", max_tokens=6, ignore_eos=True)
    if rpc == "Generate":
        await real.stub.Generate(req, metadata=metadata)
    else:
        assert len([m async for m in real.stub.GenerateStream(req, metadata=metadata)]) >= 1

    [(resource, span)] = await _spans(otlp, trace_id)
    assert span.parent_span_id == bytes.fromhex(parent_id)
    assert span.trace_state == "team=infer"
    assert resource["vllm.instrumenting_module_name"] == "vllm.llm_engine"
    values = attributes(span)
    assert values["gen_ai.request.id"] == f"traced-{rpc}"
    assert values["gen_ai.usage.prompt_tokens"] == 4
    assert values["gen_ai.usage.completion_tokens"] == 6
    assert values["gen_ai.request.max_tokens"] == 6
