"""What the engine finds at load time, resolved once into `EngineInfo`: the auto limits against
the model's context and the KV cache's capacity, EOS ids, and what the generation config fixes."""

from __future__ import annotations

import time

from inference_service.config import EngineConfig
from inference_service.engine.model_load import LoadedModel
from inference_service.errors import ModelLoadError
from inference_service.models import context
from inference_service.outputs import EngineInfo
from inference_service.worker.transformers_runner.runner import ATTENTION_IMPL
from inference_service.worker.weights.at_load import weights_nbytes

# A step's token budget when --max-batch-prefill-tokens is not given. A step is what every running
# stream and every new arrival waits for. Measured on a 2-core CPU with the demo model
# (benchmarks/bystander_latency.py, a 2048-token prompt): 256 prefills as fast as 512 (415 vs 403
# tokens/s) while a short request beside it waits 0.8 s instead of 2.3 s; 128 cuts that to 0.5 s
# but prefills 23% slower.
DEFAULT_PREFILL_TOKENS = {"cpu": 256, "cuda": 4096}


def make_info(config: EngineConfig, loaded: LoadedModel, num_blocks: int) -> EngineInfo:
    """Resolve the auto limits against the model's context and the KV capacity."""
    text_config = loaded.model.config.get_text_config()
    capacity = num_blocks * config.cache.block_size
    limits = config.limits
    max_total = limits.max_total_tokens or min(default_max_total(loaded), capacity)
    if max_total > capacity:
        raise ModelLoadError(
            f"--max-total-tokens {max_total} is more than the KV cache holds ({capacity} "
            "tokens); raise --kv-cache-memory / --max-batch-total-tokens or lower it"
        )
    max_input = limits.max_input_tokens or max_total - 1
    if max_input >= max_total:
        raise ModelLoadError(f"--max-input-tokens ({max_input}) must be < --max-total-tokens ({max_total})")
    prefill_tokens = config.scheduler.max_batch_prefill_tokens or DEFAULT_PREFILL_TOKENS[loaded.device.type]
    return EngineInfo(
        model_id=loaded.model_id,
        model_sha=loaded.model_sha,
        architecture=getattr(text_config, "model_type", "unknown"),
        dtype=str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        device=loaded.device.type,
        vocab_size=loaded.model.get_output_embeddings().out_features,
        eos_token_ids=_eos_token_ids(loaded.model, loaded.tokenizer),
        block_size=config.cache.block_size,
        num_blocks=num_blocks,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_prefill_tokens=prefill_tokens,
        max_batch_size=config.scheduler.max_batch_size,
        max_concurrent_requests=limits.max_concurrent_requests,
        max_best_of=limits.max_best_of,
        max_stop_sequences=limits.max_stop_sequences,
        max_top_n_tokens=limits.max_top_n_tokens,
        vision_architecture=loaded.model.config.model_type if loaded.processor is not None else None,
        max_images_per_request=limits.max_images_per_request,
        encoder_crop_values=loaded.encoder.crop_values if loaded.encoder else 0,
        encoder_crop_bytes=loaded.encoder.crop_bytes if loaded.encoder else 0,
        encoder_memory_bytes=loaded.encoder.reserved_bytes if loaded.encoder else 0,
        max_image_fetch_size=limits.max_image_fetch_size,
        # The fallback's per-request caches share nothing: prefix caching is the paged path's.
        prefix_caching=config.cache.prefix_caching and loaded.fallback_reason is None,
        speculate=config.scheduler.speculate,
        attention_impl=ATTENTION_IMPL if loaded.fallback_reason else "paged",
        quantize=loaded.quantize,
        weights_nbytes=weights_nbytes(loaded.model),
        loaded_at=int(time.time()),
        **_generation_defaults(loaded.model),
    )


def _generation_defaults(model) -> dict:
    """What the model's generation config fixes about the tokens: where an encoder-decoder's decoder
    starts, and the forced first and last tokens (BART forces EOS last, mBART/M2M100 checkpoints a
    language first). The rest of it (beams, lengths) is the caller's business, as in TGI."""
    generation = getattr(model, "generation_config", None)

    def setting(name: str) -> int | None:  # as `generate` reads them: the generation config only
        value = getattr(generation, name, None)
        return value if isinstance(value, int) else None

    start = None
    if model.config.is_encoder_decoder:
        start = setting("decoder_start_token_id")
        start = setting("bos_token_id") if start is None else start
        if start is None:
            raise ModelLoadError("the encoder-decoder's generation config names no decoder_start_token_id")
    return {
        "decoder_start_token_id": start,
        "forced_bos_token_id": setting("forced_bos_token_id"),
        "forced_eos_token_id": setting("forced_eos_token_id"),
    }


def default_max_total(loaded: LoadedModel) -> int:
    """TGI's default (models/context.py), within the tokenizer's `model_max_length` where it states one."""
    default = context.default_max_total_tokens(context.stated_context_length(loaded.model.config))
    tokenizer_max = getattr(loaded.tokenizer, "model_max_length", None)
    if isinstance(tokenizer_max, int) and 0 < tokenizer_max < 10**8:  # unset is ~1e30
        return min(default, tokenizer_max)
    return default


def _eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (
        getattr(generation_config, "eos_token_id", None),
        model.config.get_text_config().eos_token_id,
        tokenizer.eos_token_id,
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(i for i in source if isinstance(i, int))
    return tuple(sorted(ids))
