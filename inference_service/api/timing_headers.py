"""TGI's timing headers on a whole generation's answer (`x-total-time`, `x-queue-time`, …): what a
caller of `/generate` reads to tell the time its request waited for the engine from the time it
ran, without a trace collector.

They go out as the call's initial metadata, which Envoy's transcoder hands on as HTTP headers. TGI
sends the times as integer milliseconds (`x-compute-time` in seconds, as a float) and
`x-compute-type` from the `COMPUTE_TYPE` environment variable.
"""

from __future__ import annotations

import os
import time

from inference_service.observability.tracing import RequestTrace
from inference_service.outputs import GenerateResult

DEFAULT_COMPUTE_TYPE = "cpu+optimized"  # TGI's default is gpu+optimized; its launcher sets one per machine


def timing_headers(
    trace: RequestTrace, result: GenerateResult, num_input_characters: int
) -> tuple[tuple[str, str], ...]:
    """The headers of one finished call: `trace` is its call's (started, validated), `result` the
    engine's (its timings: queued, first scheduled, finished)."""
    now = time.perf_counter()
    timings = result.timings
    validated = trace.validated if trace.validated is not None else trace.started
    queued = timings.queued if timings is not None and timings.queued is not None else validated
    scheduled = timings.first_scheduled if timings is not None and timings.first_scheduled is not None else queued
    finished = timings.finished if timings is not None and timings.finished is not None else now
    inference = max(0.0, finished - scheduled)
    return (
        ("x-compute-type", os.environ.get("COMPUTE_TYPE", DEFAULT_COMPUTE_TYPE)),
        ("x-compute-time", f"{now - trace.started:.6f}"),
        ("x-compute-characters", str(num_input_characters)),
        ("x-total-time", _ms(now - trace.started)),
        ("x-validation-time", _ms(validated - trace.started)),
        ("x-queue-time", _ms(scheduled - queued)),
        ("x-inference-time", _ms(inference)),
        ("x-time-per-token", _ms(inference / max(1, result.num_generated_tokens))),
        ("x-prompt-tokens", str(result.num_prompt_tokens)),
        ("x-generated-tokens", str(result.num_generated_tokens)),
    )


def _ms(seconds: float) -> str:
    return str(max(0, round(seconds * 1000)))
