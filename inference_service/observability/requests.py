"""One generation call, seen once: it counts in the metrics, becomes engine spans, and one log line.

The servicer wraps each generation RPC in `observer.track(method, context)` and reports the
validated request and the final result; how the call ended (result, domain error, cancellation)
decides success or the failure kind. Every counted request ends as exactly one success or one
failure, so `tgi_request_count == tgi_request_success + sum(tgi_request_failure)` once idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from inference_service.errors import InferenceError, ValidationError
from inference_service.observability.logging import UNAVAILABLE_CHANNEL, level_for_state
from inference_service.observability.metrics import FAILURE_KINDS, ServerMetrics
from inference_service.observability.tracing import RequestTrace, Tracing
from inference_service.outputs import GenerateResult, RequestOutput
from inference_service.sampling_params import EngineRequest

logger = logging.getLogger("inference_service.requests")

REQUEST_ID_KEY = "x-request-id"  # set by Envoy on every REST request, or by the caller
TRACEPARENT_KEY = "traceparent"


def failure_kind(error: BaseException) -> str:
    """tgi_request_failure's `err` for how a call ended."""
    if isinstance(error, ValidationError):  # template and tool errors are the caller's input too
        return "validation"
    if isinstance(error, InferenceError):
        return error.error_type if error.error_type in FAILURE_KINDS else "internal"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "dropped"  # the caller went away (disconnect, deadline), as TGI's "dropped"
    return "internal"


class RequestObserver:
    """Makes a `TrackedCall` per generation RPC; metrics and tracing are optional (tests, tools)."""

    def __init__(self, metrics: ServerMetrics | None = None, tracing: Tracing | None = None):
        self.metrics = metrics
        self.tracing = tracing

    def track(self, method: str, context: Any = None) -> TrackedCall:
        return TrackedCall(self, method, context)


class TrackedCall:
    """A context manager around one call; `validated()` and `finished()`/`streamed()` pass values through."""

    def __init__(self, observer: RequestObserver, method: str, context: Any):
        self._observer = observer
        self.method = method
        self.trace = RequestTrace(started=time.perf_counter())
        self._context = context
        self._parent = observer.tracing.current_context() if observer.tracing is not None else None
        self._final: GenerateResult | RequestOutput | None = None

    def __enter__(self) -> TrackedCall:
        if self._observer.metrics is not None:
            self._observer.metrics.request_count.inc()
        return self

    def validated(self, request: EngineRequest) -> EngineRequest:
        self.trace.validated = time.perf_counter()
        self.trace.num_prompt_tokens = request.num_prompt_tokens
        self.trace.max_new_tokens = request.stopping.max_new_tokens
        self.trace.adapter_id = request.adapter_id
        metrics = self._observer.metrics
        if metrics is not None and request.adapter_id is not None:
            metrics.lora_request_count.labels(request.adapter_id).inc()
        if metrics is not None and metrics.input_length is not None:
            metrics.input_length.observe(self.trace.num_prompt_tokens)
            metrics.max_new_tokens.observe(self.trace.max_new_tokens)
        return request

    def finished(self, result: GenerateResult) -> GenerateResult:
        self._final = result
        return result

    def streamed(self, output: RequestOutput) -> RequestOutput:
        if output.finished and output.error is None:
            self._final = output
        return output

    def __exit__(self, error_type: Any, error: BaseException | None, traceback: Any) -> bool:
        try:
            self._record(error)
        except Exception:  # noqa: BLE001 — bookkeeping must never change how a call ends
            logger.exception("could not record a %s call", self.method)
        return False

    def _record(self, error: BaseException | None) -> None:
        self.trace.ended = time.perf_counter()
        final = self._final
        if final is not None:  # finished, even if the caller left right after the last token
            self._succeeded(final)
        else:
            self.trace.error = "incomplete" if error is None else failure_kind(error)
            timings = getattr(error, "timings", None)  # the engine's, when the request got that far
            if timings is not None:
                self.trace.sequences = [(timings, None, None)]
            if self._observer.metrics is not None:
                self._observer.metrics.request_failure.labels(self.trace.error).inc()
        trace_id = None
        if self._observer.tracing is not None:
            self._observer.tracing.record(self._parent, self.trace)
            trace_id = self._observer.tracing.trace_id(self._parent)
        self._log(final, trace_id, error)

    def _succeeded(self, final: GenerateResult | RequestOutput) -> None:
        sequences = [final, *getattr(final, "best_of_sequences", ())]
        self.trace.sequences = [
            (s.timings, s.num_generated_tokens, _reason(s.finish_reason)) for s in sequences if s.timings is not None
        ]
        metrics = self._observer.metrics
        if metrics is None:
            return
        metrics.request_success.inc()
        metrics.request_duration.observe(self.trace.ended - self.trace.started)
        timings = final.timings
        if self.trace.validated is not None:
            metrics.validation_duration.observe(self.trace.validated - self.trace.started)
        if timings is not None and timings.first_scheduled is not None and timings.finished is not None:
            queued_from = self.trace.validated if self.trace.validated is not None else timings.queued
            if queued_from is not None:
                metrics.queue_duration.observe(max(0.0, timings.first_scheduled - queued_from))
            inference_s = timings.finished - timings.first_scheduled
            metrics.inference_duration.observe(inference_s)
            if final.num_generated_tokens:
                metrics.time_per_token.observe(inference_s / final.num_generated_tokens)
        if timings is not None and timings.first_token is not None:
            metrics.time_to_first_token.observe(timings.first_token - self.trace.started)
        if metrics.generated_tokens is not None:
            metrics.generated_tokens.observe(final.num_generated_tokens)

    # -- the log line ---------------------------------------------------------------------------
    def _log(
        self, final: GenerateResult | RequestOutput | None, trace_id: str | None, error: BaseException | None = None
    ) -> None:
        trace = self.trace
        request_id, caller_trace_id = self._call_ids()
        fields: dict[str, Any] = {"request_id": request_id, "method": self.method}
        if trace.adapter_id is not None:
            fields["adapter"] = trace.adapter_id
        if final is not None:
            fields.update(
                status="ok",
                input_tokens=final.num_prompt_tokens,
                generated_tokens=final.num_generated_tokens,
                finish_reason=_reason(final.finish_reason),
            )
        else:
            fields.update(status="failed", error=trace.error)
            if trace.num_prompt_tokens is not None:
                fields["input_tokens"] = trace.num_prompt_tokens
        fields["total_time"] = round(trace.ended - trace.started, 6)
        if trace.validated is not None:
            fields["validation_time"] = round(trace.validated - trace.started, 6)
        timings = final.timings if final is not None else None
        if timings is not None and timings.first_scheduled is not None and timings.finished is not None:
            fields["queue_time"] = round(max(0.0, timings.first_scheduled - (trace.validated or timings.arrival)), 6)
            fields["inference_time"] = round(timings.finished - timings.first_scheduled, 6)
            if final.num_generated_tokens:
                fields["time_per_token"] = round(fields["inference_time"] / final.num_generated_tokens, 6)
            if timings.first_token is not None:
                fields["time_to_first_token"] = round(timings.first_token - trace.started, 6)
            if timings.num_preemptions:
                fields["preemptions"] = timings.num_preemptions
        trace_id = trace_id or caller_trace_id
        if trace_id:
            fields["trace_id"] = trace_id
        serious = trace.error in ("generation", "internal")
        level = logging.WARNING if serious else logging.INFO
        if trace.error == "unavailable" and isinstance(error, InferenceError):
            # Loading or draining: each call is still counted, but logged at INFO once per state.
            level = level_for_state(UNAVAILABLE_CHANNEL, error.message, level)
        logger.log(
            level,
            "%s %s",
            self.method,
            "ok" if final is not None else f"failed ({trace.error})",
            extra={"fields": fields},
        )

    def _call_ids(self) -> tuple[str, str | None]:
        """(request id, the caller's trace id) from the call metadata; a fresh id when none is given."""
        request_id, trace_id = None, None
        metadata = self._context.invocation_metadata() if self._context is not None else None
        for key, value in metadata or ():
            if key == REQUEST_ID_KEY and isinstance(value, str):
                request_id = value
            elif key == TRACEPARENT_KEY and isinstance(value, str):
                parts = value.split("-")
                if len(parts) >= 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
                    trace_id = parts[1].lower()
        return request_id or uuid.uuid4().hex, trace_id


def _reason(reason: Any) -> str | None:
    return None if reason is None else str(reason)
