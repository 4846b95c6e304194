"""The synchronous engine: one `step()` = schedule → run the model → sample → text → outputs.

It runs on one thread (the async front owns that thread). Errors are contained: a failed
forward pass ends the requests of that step with a generation error; a failure in one request's
own part of the step (its prompt logprobs, its sampling row, its text, stop sequences or grammar)
ends only that request (`isolation`), and the engine goes on either way. Callers' messages never
carry internals: the cause goes to the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from inference_service.engine.block_hash_index import cache_salt
from inference_service.engine.cross_attention_images import CrossAttentionImages
from inference_service.engine.detokenizer import TextState
from inference_service.engine.forward_clock import ForwardClock
from inference_service.engine.isolation import request_error, sample_rows
from inference_service.engine.kv_cache_manager import KVCacheManager
from inference_service.engine.mrope import MROPE_ARCHITECTURES
from inference_service.engine.prefix_cache import PrefixCache
from inference_service.engine.request import FINISHED_STATUS, Request, RequestStatus
from inference_service.engine.request_outputs import LiveRequest, RequestOutputs
from inference_service.engine.scheduler import Scheduler
from inference_service.engine.speculation import Speculator
from inference_service.engine.step_cost import StepCost
from inference_service.engine.step_yield import StepYield
from inference_service.engine.vision_stage import ImageEncoder, VisionStage
from inference_service.errors import GenerationError, InferenceError, NotFoundError, RequestCancelled, RunnerLost
from inference_service.models.lora_registry import AdapterRegistry
from inference_service.outputs import (
    EngineInfo,
    EngineStats,
    FinishReason,
    RequestOutput,
    Runner,
    SchedulerOutput,
    StepLogits,
    StepStats,
)
from inference_service.sample.grammar import GrammarCompiler
from inference_service.sample.sampler import Sampler, SamplerOutput, SamplingState
from inference_service.sampling_params import EngineRequest
from inference_service.worker.step_yield import StepYielded

logger = logging.getLogger(__name__)


def prefix_cache_salt(info: EngineInfo) -> bytes:
    """The seed of the KV blocks' hash chains: what the K/V of a token depends on besides the
    tokens before it (the weights, the arithmetic, the block layout)."""
    return cache_salt(
        info.model_id, info.model_sha, info.architecture, info.dtype, info.device, info.quantize, info.block_size
    )


class LLMEngine:
    """Owns the scheduler, the KV block manager, the model runner and the sampler."""

    def __init__(
        self,
        info: EngineInfo,
        tokenizer,
        runner: Runner,
        sampler: Sampler,
        max_batch_prefill_tokens: int,
        max_batch_size: int | None,
        grammar_compiler: GrammarCompiler | None = None,
        speculator: Speculator | None = None,
        step_cost: StepCost | None = None,
        adapters: AdapterRegistry | None = None,
    ):
        self.info = info
        self.tokenizer = tokenizer
        # The front end compiles requests' grammars with it (off this thread); None: grammars are refused.
        self.grammar_compiler = grammar_compiler
        self.runner = runner
        self.sampler = sampler
        self.kv = KVCacheManager(info.num_blocks, info.block_size, enable_prefix_caching=info.prefix_caching)
        self.adapters = adapters  # resident LoRA adapters; None: the server serves none
        salt = prefix_cache_salt(info)
        self.prefix_cache = PrefixCache(self.kv, salt, self._adapter_salt_from(salt) if adapters else None)
        self.scheduler = Scheduler(self.kv, max_batch_prefill_tokens, max_batch_size, self.prefix_cache, step_cost)
        self.speculator = speculator  # None: one token per request and step
        # Vision-language models: the encoder's stage at admission (None: text only).
        encoder = runner if info.vision_architecture and isinstance(runner, ImageEncoder) else None
        mrope = info.vision_architecture in MROPE_ARCHITECTURES
        self.vision: VisionStage | CrossAttentionImages | None = None
        if encoder is not None:
            self.vision = VisionStage(encoder, mrope)
        elif info.vision_architecture:  # the runner's model encodes images itself (Mllama, fallback path)
            self.vision = CrossAttentionImages()
        self.processor: object | None = None  # the model's processor, for the front end (vision models)
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.live: dict[str, LiveRequest] = {}
        self.num_steps = 0
        # Called on the engine thread after every step with its `StepStats` (metrics hook it here).
        self.step_observer: Callable[[StepStats], None] | None = None
        self._forward_clock = ForwardClock(runner.device)
        # A step nobody's token comes from gives way to a request that arrives during it.
        self.step_yield = StepYield()
        self.arrivals = self.step_yield.arrivals  # counted by the front that queues requests
        self.request_outputs = RequestOutputs(tokenizer, info)

    def _adapter_salt_from(self, salt: bytes) -> Callable[[str], bytes]:
        def adapter_salt(name: str) -> bytes:
            info = self.adapters.info(name) if self.adapters is not None else None
            if info is None:
                raise ValueError(f"LoRA adapter {name!r} is not loaded")
            return cache_salt(salt.hex(), "lora", name, info.fingerprint)

        return adapter_salt

    # -- requests in and out --------------------------------------------------------------
    def add_request(self, request_id: str, spec: EngineRequest) -> None:
        if request_id in self.live:
            raise ValueError(f"request id {request_id!r} is already in use")
        if spec.adapter_id is not None and (self.adapters is None or not self.adapters.is_resident(spec.adapter_id)):
            # validated while it was loaded, unloaded since: refused before it runs
            raise NotFoundError(f"the LoRA adapter {spec.adapter_id!r} is no longer loaded")
        request = Request(
            request_id, list(spec.prompt_token_ids), spec.sampling, spec.stopping, adapter_id=spec.adapter_id
        )
        if spec.images:
            if self.vision is None:
                raise ValueError("this engine's model takes no images")
            request.with_images(spec.images)
        start = self.info.decoder_start_token_id
        if start is not None:  # an encoder-decoder: the prompt feeds the encoder, the decoder starts from one token
            request.encoder_token_ids = request.prompt_token_ids
            request.prompt_token_ids = [start]
        # Each sequence walks its own copy of the grammar (best_of variants share the compiled one).
        grammar = spec.grammar.new_state() if spec.grammar is not None else None
        self.live[request_id] = LiveRequest(
            request=request,
            spec=spec,
            sampling=SamplingState(spec.sampling, request.prompt_token_ids, self.info.vocab_size, grammar=grammar),
            text=TextState(self.tokenizer, request.prompt_token_ids, spec.stopping.stop_sequences),
        )
        self.scheduler.add(request)

    def abort_request(self, request_id: str, reason: str = "request cancelled") -> RequestOutput | None:
        """End a request now and free its blocks; returns its final (cancelled) output."""
        if request_id not in self.live:
            return None
        return self._fail(request_id, RequestCancelled(reason), RequestStatus.FINISHED_ABORTED)

    def try_unload_adapter(self, name: str) -> bool:
        """Drop the adapter if no request runs or waits on it (on the engine thread, between steps,
        so no step ever finds its weights gone); False: some still do."""
        if self.adapters is None or any(live.request.adapter_id == name for live in self.live.values()):
            return False
        self.adapters.unload(name)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_cached_blocks=self.kv.num_cached_blocks,
            num_prefix_queried_tokens=self.prefix_cache.num_queried_tokens,
            num_prefix_hit_tokens=self.prefix_cache.num_hit_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        stats = self._step_stats(plan)
        try:
            outputs = self._run_step(plan, stats)
        except StepYielded:  # nothing of it counts: the next plan has the arrival in it, first
            self.scheduler.arrival_first = True
            return []
        self.num_steps += 1
        if self.step_observer is not None:
            try:
                self.step_observer(stats)
            except Exception:  # noqa: BLE001 — a metrics bug must not fail the step's requests
                logger.exception("step observer failed")
        return outputs

    def _step_stats(self, plan: SchedulerOutput) -> StepStats:
        stats = StepStats(
            num_requests=len(plan.scheduled),
            num_new_requests=len(plan.admitted_ids),
            num_prefill_requests=0,
            num_prefill_tokens=0,
            num_decode_tokens=0,
            num_preempted=len(plan.preempted_ids),
            batch_max_tokens=sum(
                min(r.num_prompt_tokens + r.stopping.max_new_tokens, self.info.max_total_tokens)
                for r in self.scheduler.running
            ),
        )
        for item in plan.scheduled:
            num_prompt_tokens = self.live[item.request_id].request.num_prompt_tokens
            stats.num_draft_tokens += item.num_draft_tokens
            if item.num_known_tokens == 1 and item.num_computed_tokens >= num_prompt_tokens:
                stats.num_decode_tokens += 1
            else:
                stats.num_prefill_requests += 1
                stats.num_prefill_tokens += item.num_new_tokens
        return stats

    def _run_step(self, plan: SchedulerOutput, stats: StepStats) -> list[RequestOutput]:
        started = time.perf_counter()
        self._forward_clock.start()
        try:
            if self.vision is not None:
                self.vision.prepare(
                    plan.scheduled, {item.request_id: self.live[item.request_id].request for item in plan.scheduled}
                )
            clock = self.scheduler.cost.clock
            with self.step_yield.running(plan.scheduled, clock.fixed_s if clock is not None else None):
                step_logits = self.runner.execute(plan.scheduled)
        except StepYielded:
            raise
        except RunnerLost:  # no later step can run either: the caller stops serving
            stats.failed, stats.total_s = True, time.perf_counter() - started
            raise
        except Exception:  # noqa: BLE001 — contain it to this step's requests
            logger.exception("model step failed for %d requests", len(plan.scheduled))
            stats.failed, stats.total_s = True, time.perf_counter() - started
            return self._fail_all([s.request_id for s in plan.scheduled], "the model step failed")
        self._forward_clock.stop()
        outputs = self._sample_step(plan, step_logits, stats)
        stats.total_s = time.perf_counter() - started
        stats.forward_s = min(self._forward_clock.seconds(), stats.total_s)
        stats.sample_s = stats.total_s - stats.forward_s
        return outputs

    def _sample_step(self, plan: SchedulerOutput, step_logits: StepLogits, stats: StepStats) -> list[RequestOutput]:
        self.scheduler.update(plan, {item.request_id: self.live[item.request_id].request for item in plan.scheduled})

        outputs: list[RequestOutput] = []
        for item in plan.scheduled:
            if item.request_id in step_logits.prompt_logits:
                try:
                    self.request_outputs.record_prompt_logprobs(
                        self.live[item.request_id], item, step_logits.prompt_logits[item.request_id]
                    )
                except Exception as error:  # noqa: BLE001 — only this request fails
                    logger.exception("prompt logprobs failed for request %s", item.request_id)
                    outputs.append(self._fail(item.request_id, request_error(error, "prompt logprobs")))
        if step_logits.sample_ids:
            outputs += self._sample_rounds(plan, step_logits, stats)
        return outputs

    def _sample_rounds(self, plan: SchedulerOutput, step_logits: StepLogits, stats: StepStats) -> list[RequestOutput]:
        """Sample each request's first row; with speculation, go on to its next row (the logits after
        its next guess) while the token just sampled equals that guess (engine/speculation.py)."""
        ids = step_logits.sample_ids
        drafts = {
            s.request_id: s.token_ids[s.num_new_tokens - s.num_draft_tokens :]
            for s in plan.scheduled
            if s.num_draft_tokens
        }
        first_rows, row = [], 0
        for count in step_logits.num_sample_rows or [1] * len(ids):
            first_rows.append(row)
            row += count
        outputs: list[RequestOutput] = []
        accepted = dict.fromkeys(drafts, 0)
        active, depth = [i for i, request_id in enumerate(ids) if request_id in self.live], 0
        while active:
            rows = [first_rows[i] + depth for i in active]
            logits = step_logits.sample_logits
            if rows != list(range(len(logits))):
                logits = logits[torch.tensor(rows, device=logits.device)]
            verifying = [ids[i] for i in active]
            isolated = sample_rows(self.sampler, logits, [self.live[r].sampling for r in verifying])
            sampled = isolated.sampled
            next_active = []
            for row, i in enumerate(active):
                request_id = ids[i]
                if row in isolated.errors:
                    outputs.append(self._fail(request_id, isolated.errors[row]))
                    continue
                guesses = drafts.get(request_id, ())
                output, going_on = self._on_token(request_id, sampled, row, guesses[depth : depth + 1])
                if going_on:
                    next_active.append(i)
                    accepted[request_id] += 1
                elif output is not None:
                    outputs.append(output)
            active, depth = next_active, depth + 1
        for request_id, count in accepted.items():
            if request_id in self.live:
                self.scheduler.accept_drafts(self.live[request_id].request, count)
        stats.accepted_draft_tokens = list(accepted.values())
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += sum(accepted.values())
        try:
            self.sampler.prefetch_grammars([self.live[r].sampling for r in ids if r in self.live])
        except Exception:  # noqa: BLE001 — only a head start: the next step fills the masks itself
            logger.exception("prefetching grammar masks failed")
        return outputs

    def _on_token(
        self, request_id: str, sampled: SamplerOutput, row: int, guess: Sequence[int] = ()
    ) -> tuple[RequestOutput | None, bool]:
        """Take the token sampled at `row`. Returns the output to send now, and whether to go on to
        the request's next row: the token equals the `guess` that row was computed with, and the
        request did not finish. A request that fails here ends with its error as the output."""
        try:
            live = self.live[request_id]
            reason = self.request_outputs.take_token(live, sampled, row)
            if reason is not None:
                return self._finish(request_id, reason), False
            if guess and guess[0] == sampled.token_ids[row]:
                return None, True
            num_held = live.text.num_tokens - live.text.num_releasable_tokens()
            return self.request_outputs.release(live, len(live.pending) - num_held), False
        except GenerationError as error:  # already says what went wrong (a token off the grammar)
            logger.error("request %s failed: %s", request_id, error.detail)
            return self._fail(request_id, error), False
        except Exception as error:  # noqa: BLE001 — only this request fails
            logger.exception("processing the sampled token failed for request %s", request_id)
            return self._fail(request_id, request_error(error, "processing the sampled token")), False

    def _finish(self, request_id: str, reason: FinishReason) -> RequestOutput:
        live = self.live[request_id]
        request = live.request
        output = self.request_outputs.release(live, len(live.pending)) or RequestOutput(request_id=request_id)
        text = live.spec.text_prefix + live.text.final_text(strip_stop=live.spec.stopping.strip_stop)
        output.finish_reason = reason
        output.generated_text = text
        output.num_generated_tokens = request.num_output_tokens
        output.num_prompt_tokens = request.num_input_tokens
        output.seed = None if request.sampling.is_greedy else request.sampling.seed
        self.scheduler.finish(request, FINISHED_STATUS[reason])
        output.timings = request.timings
        self._forget(request_id)
        return output

    def _fail(
        self, request_id: str, error: InferenceError, status: RequestStatus = RequestStatus.FINISHED_ERROR
    ) -> RequestOutput:
        request = self.live[request_id].request
        self.scheduler.finish(request, status)
        self._forget(request_id)
        error.timings = request.timings
        return RequestOutput(
            request_id=request_id,
            error=error,
            timings=request.timings,
            num_generated_tokens=request.num_output_tokens,
            num_prompt_tokens=request.num_input_tokens,
        )

    def fail_all(self, error: InferenceError | None = None) -> list[RequestOutput]:
        """End every live request with a generation error (an unexpected engine failure, logged by the
        caller), or with copies of `error`."""
        if error is None:
            return self._fail_all(list(self.live), "the engine failed")
        return [self._fail(request_id, type(error)(*error.args)) for request_id in list(self.live)]

    def close(self) -> None:
        """The engine stops: the runner lets go of what it holds (tensor-parallel shards stop)."""
        self.runner.close()

    def _fail_all(self, request_ids: list[str], detail: str) -> list[RequestOutput]:
        """End these requests, each with its own `GenerationError` (it carries its request's timings)."""
        return [
            self._fail(request_id, GenerationError(detail)) for request_id in request_ids if request_id in self.live
        ]

    def _forget(self, request_id: str) -> None:
        self.live.pop(request_id, None)
        self.runner.release(request_id)
