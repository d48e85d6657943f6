"""Prometheus metrics: /metrics moves by exactly what a known workload did.

The same workload runs on the mock and on the real engine; on the real engine the
endpoint also carries vLLM's own series, named and labelled as vLLM's OpenAI server
names and labels them.
"""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass

import grpc
import pytest

from vllm_router.core.metrics import PREFIX
from vllm_router.server import ServerConfig

from harness import (
    Harness,
    Samples,
    StartServer,
    collect_stream,
    delta,
    request,
    scrape,
    wait_until,
)

GENERATE = "vllm.engine.v1.VllmEngine"


@dataclass
class Workload:
    """What the client saw: the amounts the counters must have moved by."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished_length: int = 0
    # Gaps between consecutive messages of the streams that ran to the end.
    gaps: int = 0
    admitted: int = 0


def count(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((PREFIX + name, tuple(sorted(labels.items()))), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return delta(before, after, PREFIX + name, **labels)


async def completed_requests(harness: Harness) -> Workload:
    """Two streams and one unary that run to max_tokens, one prompt refused at admission."""
    seen = Workload()
    for prompt, max_tokens in (([5, 6, 7], 6), ([8, 9], 5)):
        messages = await collect_stream(
            harness.stub, request(prompt, max_tokens=max_tokens, ignore_eos=True, seed=1)
        )
        assert sum(len(m.token_ids) for m in messages) == max_tokens
        seen.prompt_tokens += len(prompt)
        seen.generated_tokens += max_tokens
        seen.gaps += len(messages) - 1
    unary = await harness.stub.Generate(request([3, 4, 5, 6], max_tokens=4, ignore_eos=True))
    assert len(unary.output_token_ids) == 4
    seen.prompt_tokens += 4
    seen.generated_tokens += 4
    seen.finished_length = 3
    seen.admitted = 3
    with pytest.raises(grpc.aio.AioRpcError) as err:
        too_long = harness.engine.facts.max_model_len + 1
        await harness.stub.Generate(request([7] * too_long, max_tokens=1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return seen


async def check_counters(harness: Harness) -> None:
    before = await scrape(harness.metrics_url)
    seen = await completed_requests(harness)
    after = await scrape(harness.metrics_url)

    def by(name: str, **labels: str) -> float:
        return moved(before, after, name, **labels)

    assert by("requests_total", service=GENERATE, method="GenerateStream", code="OK") == 2
    assert by("requests_total", service=GENERATE, method="Generate", code="OK") == 1
    assert by("requests_total", service=GENERATE, method="Generate", code="INVALID_ARGUMENT") == 1
    assert by("rejected_total", cause="invalid_prompt") == 1
    assert by("prompt_tokens_total") == seen.prompt_tokens
    assert by("generated_tokens_total") == seen.generated_tokens
    assert by("finish_reason_total", reason="length") == seen.finished_length
    assert by("request_duration_seconds_count") == seen.admitted
    assert by("time_to_first_message_seconds_count") == seen.admitted
    assert by("time_between_messages_seconds_count") == seen.gaps
    assert by("request_duration_seconds_sum") > 0
    assert count(after, "requests_in_flight") == 0
    assert count(after, "draining") == 0
    assert count(after, "engine_alive") == 1

    # A client that leaves mid-stream: CANCELLED, and only part of the tokens were made.
    before = after
    call = harness.stub.GenerateStream(request([9, 9], max_tokens=200, ignore_eos=True))
    await call.read()
    call.cancel()
    await wait_until(lambda: not harness.server.requests.in_flight, what="stream cancelled")
    after = await _settled(harness, before, method="GenerateStream", code="CANCELLED")
    assert by("requests_total", service=GENERATE, method="GenerateStream", code="CANCELLED") == 1
    assert 1 <= by("generated_tokens_total") < 200
    assert by("prompt_tokens_total") == 2
    assert by("request_duration_seconds_count") == 1
    assert by("time_to_first_message_seconds_count") == 1
    assert by("finish_reason_total", reason="length") == 0


async def _settled(harness: Harness, before: Samples, **labels: str) -> Samples:
    """Scrape until the RPC was counted (the handler counts in its `finally`)."""
    for _ in range(100):
        samples = await scrape(harness.metrics_url)
        if moved(before, samples, "requests_total", service=GENERATE, **labels):
            return samples
        await asyncio.sleep(0.02)
    raise AssertionError(f"requests_total {labels} never moved")


def metrics_config(**extra: object) -> ServerConfig:
    return ServerConfig(port=0, metrics_port=0, **extra)  # type: ignore[arg-type]


async def test_counters_move_by_the_workload_mock(start_mock: StartServer) -> None:
    harness = await start_mock(metrics_config(), step_delay=0.002)
    await check_counters(harness)


async def test_metrics_are_off_unless_asked_for(start_mock: StartServer) -> None:
    harness = await start_mock()
    assert harness.server.metrics is None and harness.server.metrics_endpoint is None


async def test_every_series_is_exported_from_the_start(start_mock: StartServer) -> None:
    harness = await start_mock(metrics_config())
    samples = await scrape(harness.metrics_url)
    names = {name for name, _ in samples}
    for series in (
        "requests_in_flight", "prompt_tokens_total", "generated_tokens_total",
        "request_duration_seconds_count", "time_to_first_message_seconds_count",
        "time_between_messages_seconds_count", "draining", "engine_alive",
    ):  # fmt: skip
        assert PREFIX + series in names, series
    causes = {"not_serving", "overloaded", "duplicate_request_id", "invalid_prompt"}
    assert causes <= {dict(labels).get("cause") for name, labels in samples}


async def test_rejections_by_cause_and_gauges(start_mock: StartServer) -> None:
    config = metrics_config(max_concurrent_streams=1, api_key="k")
    harness = await start_mock(config, step_delay=0.01)
    auth = (("authorization", "Bearer k"),)
    before = await scrape(harness.metrics_url)
    busy = harness.stub.GenerateStream(
        request([1], request_id="a", max_tokens=3000, ignore_eos=True), metadata=auth
    )
    await busy.read()
    for rid, code in (("a", "ALREADY_EXISTS"), ("b", "RESOURCE_EXHAUSTED")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await harness.stub.Generate(request([1], request_id=rid, max_tokens=1), metadata=auth)
        assert err.value.code().name == code
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([1], max_tokens=1))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    during = await scrape(harness.metrics_url)
    for cause in ("duplicate_request_id", "overloaded", "unauthenticated"):
        assert moved(before, during, "rejected_total", cause=cause) == 1, cause
    assert count(during, "requests_in_flight") == 1
    harness.server.requests.start_draining()
    draining = await scrape(harness.metrics_url)
    assert count(draining, "draining") == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Generate(request([1], request_id="c", max_tokens=1), metadata=auth)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    harness.engine.kill()
    dead = await scrape(harness.metrics_url)
    assert count(dead, "engine_alive") == 0
    assert moved(draining, dead, "rejected_total", cause="not_serving") == 1
    busy.cancel()


@pytest.mark.vllm
async def test_counters_move_by_the_workload_real(real: Harness) -> None:
    await check_counters(real)
    samples = await scrape(real.metrics_url)
    # vLLM's engine series ride on the same endpoint, with real values.
    assert (
        samples[("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", _served(real))))] == 0
    )
    generation = [v for (name, _), v in samples.items() if name == "vllm:generation_tokens_total"]
    assert generation and generation[0] > 0
    for name in ("vllm:num_requests_running", "vllm:prefix_cache_queries_total",
                 "vllm:iteration_tokens_total_count", "process_cpu_seconds_total"):  # fmt: skip
        assert any(sample == name for sample, _ in samples), name


def _served(harness: Harness) -> str:
    return harness.engine.facts.served_model_name


def _families_with_labels(text: str) -> dict[str, set[str]]:
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            labels = families.setdefault(family.name, set())
            for sample in family.samples:
                labels |= set(sample.labels) - {"le"}
    return families


@pytest.mark.vllm
async def test_vllm_series_match_vllm_openai_server(real: Harness, vllm_http: str) -> None:
    """Every vllm:* family of vLLM's own /metrics is on ours, with the same label names."""

    def fetch(url: str) -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    theirs = _families_with_labels(await asyncio.to_thread(fetch, vllm_http + "/metrics"))
    ours = _families_with_labels(await asyncio.to_thread(fetch, real.metrics_url))
    assert len(theirs) > 20
    assert set(theirs) == set(ours), set(theirs) ^ set(ours)
    for name, labels in theirs.items():
        if labels and ours[name]:  # an info gauge has no sample until vLLM sets one
            assert ours[name] == labels, name


def test_the_loop_series_expose_what_prometheus_clients_own_would() -> None:
    """The per-token series are plain additions, not prometheus_client's locked series:
    the same observations must read the same on /metrics (values on a bucket's bound
    included), only the creation times differ."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from vllm_router.core.metrics import (
        BETWEEN_MESSAGES_BUCKETS,
        LoopCounter,
        LoopHistogram,
    )

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = LoopCounter("t:tokens", "doc", registry=ours)
    histogram = LoopHistogram("t:gap_seconds", "doc", BETWEEN_MESSAGES_BUCKETS, registry=ours)
    their_counter = Counter("t:tokens", "doc", registry=theirs)
    their_histogram = Histogram(
        "t:gap_seconds", "doc", buckets=BETWEEN_MESSAGES_BUCKETS, registry=theirs
    )
    values = [0.0, 0.0004, 0.0005, 0.00051, 0.001, 0.003, 1.0, 2.5, 2.6, 600.0]
    for i, value in enumerate(values):
        counter.inc(i)
        their_counter.inc(i)
        histogram.observe(value)
        their_histogram.observe(value)

    def exposed(registry: CollectorRegistry) -> list[str]:
        lines = generate_latest(registry).decode().splitlines()
        return [line for line in lines if not line.split(" ")[0].endswith("_created")]

    assert exposed(ours) == exposed(theirs)
    assert 't:gap_seconds_bucket{le="0.0005"} 3.0' in exposed(ours)
