"""Pure conversions of the engine's results into TGI's protobuf messages (requests are read by
`frontend.tgi`).

No I/O and no engine here. Conventions of the wire format:
- a prompt token without a logprob (the first one) is NaN, which REST JSON shows as null;
- `seed` is absent for greedy requests;
- `details` only when the request asked for them (`details` or `decoder_input_details`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from inference_service import __version__, outputs
from inference_service.config import SchedulerConfig
from inference_service.frontend.parameters import TokenSpan
from inference_service.models.lora_registry import AdapterInfo
from textgen.v1 import generate_pb2 as pb

ROUTER = "inference-service"
VALIDATION_WORKERS = 1  # validation runs on the default thread pool, one call per request
MAX_CLIENT_BATCH_SIZE = 4  # TGI's default for /v1/completions prompt arrays


# -- tokens -------------------------------------------------------------------------------------
def token_to_pb(token: outputs.Token) -> pb.Token:
    return pb.Token(id=token.id, text=token.text, logprob=token.logprob, special=token.special)


def prefill_token_to_pb(token: outputs.PrefillToken) -> pb.PrefillToken:
    logprob = math.nan if token.logprob is None else token.logprob
    return pb.PrefillToken(id=token.id, text=token.text, logprob=logprob)


def top_tokens_to_pb(top_tokens: Sequence[Sequence[outputs.Token]]) -> list[pb.TopTokens]:
    """One entry per generated token; none at all when alternatives were not asked for."""
    if not any(top_tokens):
        return []
    return [pb.TopTokens(tokens=[token_to_pb(t) for t in position]) for position in top_tokens]


# -- responses ----------------------------------------------------------------------------------
def stream_responses_to_pb(
    output: outputs.RequestOutput, *, first_index: int, details: bool
) -> list[pb.StreamResponse]:
    """One StreamResponse per token of `output` (an output may hold several held-back tokens); the
    last one of the final output carries `generated_text`, and `details` when asked."""
    responses = [
        pb.StreamResponse(
            index=first_index + i,
            token=token_to_pb(token),
            top_tokens=[token_to_pb(t) for t in _at(output.top_tokens, i)],
        )
        for i, token in enumerate(output.tokens)
    ]
    if output.finish_reason is None:
        return responses
    if not responses:  # a final output without a token of its own: its own message
        responses.append(pb.StreamResponse(index=first_index))
    last = responses[-1]
    last.generated_text = output.generated_text or ""
    if details:
        last.details.CopyFrom(
            pb.StreamDetails(
                finish_reason=output.finish_reason.value,
                generated_tokens=output.num_generated_tokens,
                seed=output.seed,
                input_length=output.num_prompt_tokens,
            )
        )
    return responses


def _at(items: Sequence[Sequence[outputs.Token]], index: int) -> Sequence[outputs.Token]:
    return items[index] if index < len(items) else ()


def generate_response_to_pb(result: outputs.GenerateResult, *, details: bool) -> pb.GenerateResponse:
    response = pb.GenerateResponse(generated_text=result.generated_text)
    if details:
        response.details.CopyFrom(
            pb.Details(
                finish_reason=result.finish_reason.value,
                generated_tokens=result.num_generated_tokens,
                seed=result.seed,
                prefill=[prefill_token_to_pb(t) for t in result.prefill_tokens],
                tokens=[token_to_pb(t) for t in result.tokens],
                top_tokens=top_tokens_to_pb(result.top_tokens),
                best_of_sequences=[best_of_to_pb(r) for r in result.best_of_sequences],
            )
        )
    return response


def best_of_to_pb(result: outputs.GenerateResult) -> pb.BestOfSequence:
    return pb.BestOfSequence(
        generated_text=result.generated_text,
        finish_reason=result.finish_reason.value,
        generated_tokens=result.num_generated_tokens,
        seed=result.seed,
        prefill=[prefill_token_to_pb(t) for t in result.prefill_tokens],
        tokens=[token_to_pb(t) for t in result.tokens],
        top_tokens=top_tokens_to_pb(result.top_tokens),
    )


def tokenize_response_to_pb(spans: Iterable[TokenSpan]) -> pb.TokenizeResponse:
    return pb.TokenizeResponse(tokens=[pb.SimpleToken(id=s.id, text=s.text, start=s.start, stop=s.stop) for s in spans])


def stats_to_pb(stats: outputs.EngineStats) -> pb.EngineStats:
    return pb.EngineStats(
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        num_preemptions=stats.num_preemptions,
        num_steps=stats.num_steps,
    )


def info_to_pb(
    info: outputs.EngineInfo,
    scheduler: SchedulerConfig,
    stats: outputs.EngineStats,
    adapters: Sequence[AdapterInfo] = (),
) -> pb.InfoResponse:
    """TGI's /info fields, the older ones (≤ 2.2) too, the engine's live stats and the loaded adapters."""
    return pb.InfoResponse(
        lora_adapters=[pb.LoraAdapter(id=a.name, source=a.source, rank=a.rank) for a in adapters],
        model_id=info.model_id,
        model_sha=info.model_sha,
        model_dtype=info.dtype,
        model_device_type=info.device.split(":")[0],
        max_concurrent_requests=info.max_concurrent_requests,
        max_best_of=info.max_best_of,
        max_stop_sequences=info.max_stop_sequences,
        max_input_tokens=info.max_input_tokens,
        max_total_tokens=info.max_total_tokens,
        validation_workers=VALIDATION_WORKERS,
        max_client_batch_size=MAX_CLIENT_BATCH_SIZE,
        router=ROUTER,
        version=__version__,
        waiting_served_ratio=scheduler.waiting_served_ratio,
        max_batch_total_tokens=info.max_batch_total_tokens,
        max_waiting_tokens=scheduler.max_waiting_tokens,
        max_batch_size=info.max_batch_size,
        max_batch_prefill_tokens=info.max_batch_prefill_tokens,
        block_size=info.block_size,
        stats=stats_to_pb(stats),
        quantize=info.quantize,
        weights_memory_bytes=info.weights_nbytes,
        speculate=info.speculate,
        use_prefix_caching=info.prefix_caching,
        attention_impl=info.attention_impl,
        model_pipeline_tag=info.pipeline_tag,
    )


def model_card(info: outputs.EngineInfo) -> pb.ModelCard:
    """The served model, owned by itself (TGI's answer), created when this server loaded it (TGI
    says 0; a real time is what OpenAI's clients expect)."""
    return pb.ModelCard(id=info.model_id, object="model", created=info.loaded_at, owned_by=info.model_id)


def adapter_card(info: outputs.EngineInfo, adapter: AdapterInfo) -> pb.ModelCard:
    """A LoRA adapter's card, as vLLM lists one: its parent is the base model."""
    return pb.ModelCard(
        id=adapter.name,
        object="model",
        created=info.loaded_at,
        owned_by=info.model_id,
        root=adapter.source,
        parent=info.model_id,
    )


def models_to_pb(info: outputs.EngineInfo, adapters: Sequence[AdapterInfo] = ()) -> pb.ListModelsResponse:
    """OpenAI's model list: the served model (TGI's answer), then each loaded LoRA adapter."""
    return pb.ListModelsResponse(object="list", data=[model_card(info)] + [adapter_card(info, a) for a in adapters])
