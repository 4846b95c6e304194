"""Metrics scraped from the Metrics RPC and the metrics port, parsed with prometheus_client's own
parser: counters move by exactly the calls made, failures by kind, steps by method; TGI's layout."""

from __future__ import annotations

import dataclasses
import math
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference_service.config import LimitsConfig, SchedulerConfig
from inference_service.observability.metrics import DURATION_BUCKETS, ServerMetrics, linear_buckets
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60
PREFILL_BUDGET = 8  # tokens per step: longer prompts are prefilled in chunks
PROMPT = "the quick brown fox jumps over a lazy dog"
# The tiny model greedily generates from "a" to the length limit without an EOS: a long request.
LONG = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=400))


@pytest.fixture(scope="module")
def server(tiny_engine_config):
    """One request at a time (best_of=2 is overloaded) and a small step budget (chunked prefill)."""
    from tests.conftest import GrpcServerThread

    config = dataclasses.replace(
        tiny_engine_config,
        scheduler=SchedulerConfig(max_batch_prefill_tokens=PREFILL_BUDGET),
        limits=LimitsConfig(max_total_tokens=tiny_engine_config.limits.max_total_tokens, max_concurrent_requests=1),
    )
    server = GrpcServerThread(config)
    yield server
    server.stop(timeout_s=1.0)


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} (the parser names counter samples `<name>_total`)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape_rpc(server) -> str:
    response = server.stub.Metrics(pb.MetricsRequest(), timeout=TIMEOUT)
    assert response.content_type.startswith("text/plain; version=0.0.4")
    return response.data.decode()


def scrape_port(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def request(max_new_tokens: int = 3, **parameters) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        inputs=PROMPT, parameters=pb.GenerateParameters(max_new_tokens=max_new_tokens, details=True, **parameters)
    )


def wait_for(server, condition, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        metrics = parse(scrape_rpc(server))
        if condition(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_requests_successes_and_failures_by_kind(server):
    before = parse(scrape_rpc(server))
    generated = [
        server.stub.Generate(request(3), timeout=TIMEOUT).details.generated_tokens,
        server.stub.Generate(request(4), timeout=TIMEOUT).details.generated_tokens,
        server.stub.CompatGenerate(request(2), timeout=TIMEOUT).responses[0].details.generated_tokens,
        list(server.stub.GenerateStream(request(5), timeout=TIMEOUT))[-1].details.generated_tokens,
    ]
    bad = pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(temperature=0.0))
    for call in (server.stub.Generate, lambda r, timeout: list(server.stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError):
            call(bad, timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as overloaded:  # best_of=2 needs two of the one seat
        server.stub.Generate(request(2, best_of=2, do_sample=True), timeout=TIMEOUT)
    assert overloaded.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    server.wait_idle()
    after = parse(scrape_rpc(server))

    assert delta(after, before, "tgi_request_count_total") == 7
    assert delta(after, before, "tgi_request_success_total") == 4
    assert delta(after, before, "tgi_request_failure_total", err="validation") == 2
    assert delta(after, before, "tgi_request_failure_total", err="overloaded") == 1
    assert (
        sum(
            delta(after, before, "tgi_request_failure_total", err=kind)
            for kind in ("generation", "dropped", "cancelled", "unavailable", "internal", "incomplete")
        )
        == 0
    )
    for name in (
        "tgi_request_duration",
        "tgi_request_validation_duration",
        "tgi_request_queue_duration",
        "tgi_request_inference_duration",
        "tgi_request_mean_time_per_token_duration",
        "tgi_request_time_to_first_token_duration",
        "tgi_request_generated_tokens",
    ):
        assert delta(after, before, f"{name}_count") == 4, name
    assert delta(after, before, "tgi_request_generated_tokens_sum") == sum(generated) == 14
    num_prompt_tokens = len(server.stub.Tokenize(pb.GenerateRequest(inputs=PROMPT), timeout=TIMEOUT).tokens)
    # Recorded at validation: the four successes and the overloaded one.
    assert delta(after, before, "tgi_request_input_length_count") == 5
    assert delta(after, before, "tgi_request_input_length_sum") == 5 * num_prompt_tokens
    assert delta(after, before, "tgi_request_max_new_tokens_sum") == 3 + 4 + 2 + 5 + 2


def test_a_caller_that_leaves_is_dropped(server):
    before = parse(scrape_rpc(server))
    call = server.stub.GenerateStream(LONG, timeout=TIMEOUT)
    next(call), next(call)
    call.cancel()
    after = wait_for(server, lambda m: delta(m, before, "tgi_request_failure_total", err="dropped") >= 1)
    assert delta(after, before, "tgi_request_failure_total", err="dropped") == 1
    assert delta(after, before, "tgi_request_count_total") == 1
    assert delta(after, before, "tgi_request_success_total") == 0
    server.wait_idle()


def test_a_deadline_that_passes_is_dropped(server):
    before = parse(scrape_rpc(server))
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Generate(LONG, timeout=0.1)  # LONG takes ~0.6 s here
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = wait_for(server, lambda m: delta(m, before, "tgi_request_failure_total", err="dropped") >= 1)
    assert delta(after, before, "tgi_request_failure_total", err="dropped") == 1
    assert delta(after, before, "tgi_request_count_total") == 1
    server.wait_idle()


def test_generation_failure_is_counted(server, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(server.engine._engine, "step", broken_step)
    before = parse(scrape_rpc(server))
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Generate(request(2), timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    after = parse(scrape_rpc(server))
    assert delta(after, before, "tgi_request_failure_total", err="generation") == 1
    assert delta(after, before, "tgi_request_count_total") == 1


def test_steps_by_method_with_chunked_prefill(server):
    num_prompt_tokens = len(server.stub.Tokenize(pb.GenerateRequest(inputs=PROMPT), timeout=TIMEOUT).tokens)
    assert num_prompt_tokens > PREFILL_BUDGET  # the prompt takes several prefill steps
    before, steps_before = parse(scrape_rpc(server)), server.stats().num_steps
    server.stub.Generate(request(6), timeout=TIMEOUT)
    after, steps_after = parse(scrape_rpc(server)), server.stats().num_steps
    # Earlier tests ran this prompt: the prefill computes only what the prefix cache lacks.
    num_cached = delta(after, before, "tgi_prefix_cache_hit_tokens_total")
    num_prefill_steps = math.ceil((num_prompt_tokens - num_cached) / PREFILL_BUDGET)
    assert delta(after, before, "tgi_batch_inference_count_total", method="prefill") == num_prefill_steps
    assert delta(after, before, "tgi_batch_inference_count_total", method="decode") == 6 - 1
    assert steps_after - steps_before == num_prefill_steps + 5
    for method, count in (("prefill", num_prefill_steps), ("decode", 5)):
        assert delta(after, before, "tgi_batch_inference_success_total", method=method) == count
        assert delta(after, before, "tgi_batch_inference_failure_total", method=method) == 0
        for name in ("tgi_batch_inference_duration", "tgi_batch_forward_duration", "tgi_batch_decode_duration"):
            assert delta(after, before, f"{name}_count", method=method) == count
    forward = delta(after, before, "tgi_batch_forward_duration_sum", method="decode")
    whole = delta(after, before, "tgi_batch_inference_duration_sum", method="decode")
    assert 0 < forward <= whole
    # The request joined the batch once: one new batch of size 1.
    assert delta(after, before, "tgi_batch_next_size_count") == 1
    assert delta(after, before, "tgi_batch_next_size_sum") == 1


def test_gauges_when_idle_and_busy(server):
    info = server.engine.info
    server.wait_idle()
    idle = parse(scrape_rpc(server))
    assert idle[("tgi_queue_size", ())] == idle[("tgi_batch_current_size", ())] == 0
    assert idle[("tgi_batch_current_max_tokens", ())] == 0
    assert idle[("tgi_kv_cache_blocks_used", ())] == 0
    assert idle[("tgi_kv_cache_blocks_free", ())] == info.num_blocks
    assert idle[("tgi_batch_max_total_tokens", ())] == info.max_batch_total_tokens

    call = server.stub.GenerateStream(LONG, timeout=TIMEOUT)
    next(call), next(call)
    busy = parse(scrape_rpc(server))
    call.cancel()
    assert busy[("tgi_batch_current_size", ())] == 1 and busy[("tgi_kv_cache_blocks_used", ())] > 0
    assert (
        busy[("tgi_batch_current_max_tokens", ())]
        == len(server.stub.Tokenize(pb.GenerateRequest(inputs="a"), timeout=TIMEOUT).tokens) + 400
    )
    server.wait_idle()


def test_prefix_cache_hits_and_blocks(server):
    prompt = "over a lazy dog and then runs home again while birds sing " * 3
    num_prompt_tokens = len(server.stub.Tokenize(pb.GenerateRequest(inputs=prompt), timeout=TIMEOUT).tokens)
    block_size = server.engine.info.block_size
    assert num_prompt_tokens > 2 * block_size
    parameters = pb.GenerateParameters(max_new_tokens=2)
    before = parse(scrape_rpc(server))
    server.stub.Generate(pb.GenerateRequest(inputs=prompt, parameters=parameters), timeout=TIMEOUT)
    middle = parse(scrape_rpc(server))
    server.stub.Generate(pb.GenerateRequest(inputs=prompt, parameters=parameters), timeout=TIMEOUT)
    after = parse(scrape_rpc(server))
    assert delta(middle, before, "tgi_prefix_cache_queried_tokens_total") == num_prompt_tokens
    assert delta(middle, before, "tgi_prefix_cache_hit_tokens_total") == 0  # a prompt never seen
    num_reusable = num_prompt_tokens - 1  # every token before the last: full blocks, then part of the next
    assert delta(after, middle, "tgi_prefix_cache_hit_tokens_total") == num_reusable
    assert middle[("tgi_prefix_cache_blocks", ())] >= num_prompt_tokens // block_size
    hits = after[("tgi_prefix_cache_hit_tokens_total", ())]
    queried = after[("tgi_prefix_cache_queried_tokens_total", ())]
    assert after[("tgi_prefix_cache_hit_rate", ())] == pytest.approx(hits / queried)
    server.wait_idle()  # kept blocks count as free
    idle = parse(scrape_rpc(server))
    assert idle[("tgi_kv_cache_blocks_free", ())] == server.engine.info.num_blocks
    assert idle[("tgi_prefix_cache_blocks", ())] > 0


def test_speculation_acceptance(tiny_engine_config, start_grpc_server):
    """With --speculate, the guesses verified and accepted, and the accepted per request and step."""
    config = dataclasses.replace(tiny_engine_config, scheduler=SchedulerConfig(speculate=4))
    server = start_grpc_server(config)
    info = server.stub.Info(pb.InfoRequest(), timeout=TIMEOUT)
    assert info.speculate == 4 and info.use_prefix_caching
    # The tiny model answers this with one token over and over: most guesses hold.
    request = pb.GenerateRequest(
        inputs="1234 3.14 , . ! ? " * 3, parameters=pb.GenerateParameters(max_new_tokens=40, details=True)
    )
    response = server.stub.Generate(request, timeout=TIMEOUT)
    server.wait_idle()
    metrics = parse(scrape_rpc(server))
    drafts = metrics[("tgi_speculation_draft_tokens_total", ())]
    accepted = metrics[("tgi_speculation_accepted_tokens_total", ())]
    stats = server.engine.stats()
    assert (drafts, accepted) == (stats.num_draft_tokens, stats.num_accepted_tokens) and 0 < accepted <= drafts
    assert metrics[("tgi_speculation_acceptance_rate", ())] == pytest.approx(accepted / drafts)
    assert metrics[("tgi_request_skipped_tokens_sum", ())] == accepted
    # Every step (the prefill's too) gives one token plus the guesses it accepted; the summary
    # counts the decode steps that carried guesses (not the last, with no room left for one).
    assert response.details.generated_tokens == stats.num_steps + accepted
    assert 0 < metrics[("tgi_request_skipped_tokens_count", ())] < stats.num_steps - 1


def test_metrics_port_serves_what_the_rpc_serves(server):
    server.wait_idle()
    from_port, from_rpc = parse(scrape_port(server)), parse(scrape_rpc(server))
    tgi = {key for key in from_rpc if key[0].startswith("tgi_")}
    assert tgi and tgi == {key for key in from_port if key[0].startswith("tgi_")}
    assert all(from_port[key] == from_rpc[key] for key in tgi)


def test_exposition_is_tgis():
    """Counters without `_total` and no `_created` series, as TGI's exporter renders them."""
    metrics = ServerMetrics(process_metrics=False)
    metrics.request_count.inc(3)
    metrics.request_failure.labels("validation").inc()
    content_type, body = metrics.render()
    text = body.decode()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE tgi_request_count counter\ntgi_request_count 3.0\n" in text
    assert 'tgi_request_failure{err="validation"} 1.0\n' in text
    assert "_total" not in text and "_created" not in text
    assert parse(text)[("tgi_request_count_total", ())] == 3


def test_bucket_layouts_are_tgis(server):
    text = scrape_rpc(server)
    families = {family.name: family for family in text_string_to_metric_families(text)}

    def bounds(name: str) -> list[float]:
        return [
            float(s.labels["le"])
            for s in families[name].samples
            if s.name.endswith("_bucket") and s.labels.get("method") != "prefill"
        ][:-1]

    info = server.engine.info
    assert len(DURATION_BUCKETS) == 35 and DURATION_BUCKETS[0] == 0.00015
    assert all(math.isclose(b / a, 1.5) for a, b in zip(DURATION_BUCKETS, DURATION_BUCKETS[1:], strict=False))
    for name in ("tgi_request_duration", "tgi_request_queue_duration", "tgi_request_mean_time_per_token_duration"):
        assert bounds(name) == pytest.approx(DURATION_BUCKETS, rel=1e-9), name
    assert bounds("tgi_request_input_length") == pytest.approx(linear_buckets(info.max_input_tokens))
    assert bounds("tgi_request_generated_tokens") == pytest.approx(linear_buckets(info.max_total_tokens))
    assert bounds("tgi_request_max_new_tokens")[-1] == info.max_total_tokens
    assert bounds("tgi_batch_next_size") == [float(size) for size in range(1, 1025)]
