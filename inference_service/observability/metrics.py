"""TGI's Prometheus metrics, with TGI's names, types, labels and buckets, in the server's own registry.

Dashboards written for TGI work unchanged: counters are exposed as TGI exposes them (`tgi_request_count`,
not `tgi_request_count_total`), histograms keep TGI's bucket layouts. A few metrics TGI lacks are
added under the same prefix (time to first token, KV blocks, preemptions, prefix cache, speculation); README lists them.

Who feeds what:
- per request (the servicer's `RequestObserver`): `tgi_request_*`;
- per engine step (`on_step`, on the engine thread): `tgi_batch_*`, preemptions;
- at scrape time (`_EngineState`, from the engine's last stats): queue, batch and KV gauges, and the
  prefix cache's and speculation's counters (cumulative in the engine, so they are read, not incremented, here).

`method` of the `tgi_batch_*` metrics: a step is "prefill" when it ran any prompt chunk (or a
recomputation after preemption), even if it also carried decodes, as TGI v3's prefill call does with
chunking; it is "decode" when every request in it computed one generated token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from inference_service.outputs import EngineInfo, EngineStats, StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# TGI: every metric whose name ends in "duration" has 35 geometric buckets from 150 µs.
DURATION_BUCKETS = tuple(0.00015 * 1.5**k for k in range(35))
# TGI: tgi_batch_next_size has one bucket per size 1..1024.
BATCH_SIZE_BUCKETS = tuple(float(size) for size in range(1, 1025))
METHODS = ("prefill", "decode")
# `err` of tgi_request_failure: TGI's kinds that can happen here, plus cancelled (aborted by the
# server, e.g. on shutdown), unavailable (loading or draining) and internal (a bug).
FAILURE_KINDS = (
    "validation",
    "overloaded",
    "generation",
    "incomplete",
    "dropped",
    "cancelled",
    "unavailable",
    "internal",
)


def linear_buckets(maximum: int) -> tuple[float, ...]:
    """TGI's length buckets: 100 equal steps up to `maximum`."""
    return tuple(maximum / 100 * (k + 1) for k in range(100))


class ServerMetrics:
    """The registry and every metric of one server."""

    def __init__(self, process_metrics: bool = True):
        self.registry = CollectorRegistry(auto_describe=False)
        if process_metrics:
            ProcessCollector(registry=self.registry)
        registry = self.registry
        self.request_count = Counter("tgi_request_count", "Generation requests received.", registry=registry)
        self.request_success = Counter("tgi_request_success", "Requests that finished generating.", registry=registry)
        # Ours, in TGI's style: requests served by each LoRA adapter (counted once validated; not the base's).
        self.lora_request_count = Counter(
            "tgi_lora_request_count", "Requests served by a LoRA adapter, by adapter.", ["adapter"], registry=registry
        )
        self.request_failure = Counter(
            "tgi_request_failure", "Requests that failed, by kind.", ["err"], registry=registry
        )
        for kind in FAILURE_KINDS:
            self.request_failure.labels(kind)

        def duration(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, documentation, labels, buckets=DURATION_BUCKETS, registry=registry)

        self.request_duration = duration("tgi_request_duration", "End-to-end request time (s).")
        self.validation_duration = duration("tgi_request_validation_duration", "Validation and tokenization time (s).")
        self.queue_duration = duration("tgi_request_queue_duration", "Time from validated to first step (s).")
        self.inference_duration = duration("tgi_request_inference_duration", "Time from first step to end (s).")
        self.time_per_token = duration(
            "tgi_request_mean_time_per_token_duration", "Inference time divided by generated tokens (s)."
        )
        self.time_to_first_token = duration(
            "tgi_request_time_to_first_token_duration", "Time from arrival to the first generated token (s)."
        )
        self.batch_inference_duration = duration("tgi_batch_inference_duration", "Whole engine step (s).", ("method",))
        self.batch_forward_duration = duration(
            "tgi_batch_forward_duration", "Model forward pass of a step (s).", ("method",)
        )
        self.batch_decode_duration = duration(
            "tgi_batch_decode_duration", "Sampling, detokenization and stop checks of a step (s).", ("method",)
        )
        self.batch_inference_count = Counter(
            "tgi_batch_inference_count", "Engine steps.", ["method"], registry=registry
        )
        self.batch_inference_success = Counter(
            "tgi_batch_inference_success", "Engine steps that succeeded.", ["method"], registry=registry
        )
        self.batch_inference_failure = Counter(
            "tgi_batch_inference_failure", "Engine steps that failed.", ["method"], registry=registry
        )
        for counter in (self.batch_inference_count, self.batch_inference_success, self.batch_inference_failure):
            for method in METHODS:
                counter.labels(method)
        self.batch_next_size = Histogram(
            "tgi_batch_next_size",
            "Requests joining the batch in a step.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.preemptions = Counter(
            "tgi_request_preemptions", "Requests evicted from the KV cache, to be recomputed later.", registry=registry
        )
        # TGI renders this bucketless histogram as a summary: accepted guesses per request and step.
        self.skipped_tokens = Summary(
            "tgi_request_skipped_tokens",
            "Speculated tokens accepted per request and step (--speculate).",
            registry=registry,
        )
        self.input_length: Histogram | None = None  # buckets depend on the model's limits
        self.generated_tokens: Histogram | None = None
        self.max_new_tokens: Histogram | None = None
        self._state = _EngineState()
        registry.register(self._state)

    def attach(self, info: EngineInfo, stats: Callable[[], EngineStats]) -> None:
        """The engine is loaded: its limits give the length buckets, its stats the gauges."""
        if self.input_length is None:
            registry = self.registry
            self.input_length = Histogram(
                "tgi_request_input_length",
                "Prompt tokens per request.",
                buckets=linear_buckets(info.max_input_tokens),
                registry=registry,
            )
            self.generated_tokens = Histogram(
                "tgi_request_generated_tokens",
                "Generated tokens per request.",
                buckets=linear_buckets(info.max_total_tokens),
                registry=registry,
            )
            self.max_new_tokens = Histogram(
                "tgi_request_max_new_tokens",
                "max_new_tokens per request.",
                buckets=linear_buckets(info.max_total_tokens),
                registry=registry,
            )
        self._state.info, self._state.stats = info, stats

    def on_step(self, step: StepStats) -> None:
        """One engine step (called on the engine thread)."""
        method = step.method
        self.batch_inference_count.labels(method).inc()
        if step.failed:
            self.batch_inference_failure.labels(method).inc()
        else:
            self.batch_inference_success.labels(method).inc()
            self.batch_forward_duration.labels(method).observe(step.forward_s)
            self.batch_decode_duration.labels(method).observe(step.sample_s)
        self.batch_inference_duration.labels(method).observe(step.total_s)
        if step.num_new_requests:
            self.batch_next_size.observe(step.num_new_requests)
        if step.num_preempted:
            self.preemptions.inc(step.num_preempted)
        for count in step.accepted_draft_tokens:
            self.skipped_tokens.observe(count)
        self._state.batch_max_tokens = step.batch_max_tokens

    def render(self) -> tuple[str, bytes]:
        """(content type, body) of the Prometheus text exposition."""
        return CONTENT_TYPE, render(self.registry)


class _EngineState(Collector):
    """Gauges read from the engine's latest stats at scrape time, so they are never stale."""

    def __init__(self):
        self.info: EngineInfo | None = None
        self.stats: Callable[[], EngineStats] | None = None
        self.batch_max_tokens = 0

    def collect(self) -> Iterator[Metric]:
        if self.info is None or self.stats is None:
            return
        stats = self.stats()
        num_used_blocks = stats.num_total_blocks - stats.num_free_blocks
        yield _gauge("tgi_queue_size", "Requests waiting to be scheduled.", stats.num_waiting)
        yield _gauge("tgi_batch_current_size", "Requests in the running batch.", stats.num_running)
        yield _gauge(
            "tgi_batch_current_max_tokens",
            "Prompt + max_new_tokens over the running requests (as of the last step).",
            self.batch_max_tokens if stats.num_running else 0,
        )
        yield _gauge("tgi_batch_max_total_tokens", "KV cache capacity in tokens.", self.info.max_batch_total_tokens)
        yield _gauge("tgi_kv_cache_blocks_used", "KV cache blocks held by requests.", num_used_blocks)
        yield _gauge("tgi_kv_cache_blocks_free", "KV cache blocks free.", stats.num_free_blocks)
        yield _gauge(
            "tgi_prefix_cache_blocks",
            "KV cache blocks a prefix-cache hit can reuse (held by requests or kept after them).",
            stats.num_cached_blocks,
        )
        yield _gauge(
            "tgi_prefix_cache_hit_rate",
            "Tokens reused from the prefix cache over tokens to compute, at admission, since start.",
            stats.prefix_cache_hit_rate,
        )
        yield CounterMetricFamily(
            "tgi_prefix_cache_hit_tokens",
            "Tokens reused from the prefix cache at admission.",
            value=stats.num_prefix_hit_tokens,
        )
        yield CounterMetricFamily(
            "tgi_prefix_cache_queried_tokens",
            "Tokens to compute at admission (the prompt; prompt and generated tokens "
            "for a request resumed after preemption), looked up in the prefix cache.",
            value=stats.num_prefix_queried_tokens,
        )
        yield _gauge(
            "tgi_speculation_acceptance_rate",
            "Speculated tokens accepted over speculated tokens verified, since start.",
            stats.speculation_acceptance_rate,
        )
        yield CounterMetricFamily(
            "tgi_speculation_draft_tokens", "Speculated tokens verified (--speculate).", value=stats.num_draft_tokens
        )
        yield CounterMetricFamily(
            "tgi_speculation_accepted_tokens", "Speculated tokens accepted.", value=stats.num_accepted_tokens
        )


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


# -- exposition ----------------------------------------------------------------------------------
_TYPE_NAMES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram"}


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text format 0.0.4, TGI's way for `tgi_*`: counters without `_total`, no `_created`
    series (prometheus_client's `generate_latest` adds both). Other metrics keep the usual names."""
    lines: list[str] = []
    for family in registry.collect():
        tgi_style = family.name.startswith("tgi_")
        name = family.name + ("_total" if family.type == "counter" and not tgi_style else "")
        lines.append(f"# HELP {name} {_escape_help(family.documentation)}")
        lines.append(f"# TYPE {name} {_TYPE_NAMES.get(family.type, family.type)}")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            sample_name = family.name if tgi_style and sample.name == family.name + "_total" else sample.name
            labels = ",".join(f'{key}="{_escape_label(value)}"' for key, value in sorted(sample.labels.items()))
            lines.append(
                f"{sample_name}{{{labels}}} {floatToGoString(sample.value)}"
                if labels
                else f"{sample_name} {floatToGoString(sample.value)}"
            )
    return ("\n".join(lines) + "\n").encode("utf-8")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
