"""Load the model to serve: resolve it, check its architecture, load its weights in the scheme
asked (pre-quantized, quantized at load, GGUF), and probe the paged attention on it; a model the
paged attention can't serve exactly is loaded again for transformers' attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig

from inference_service import progress
from inference_service.config import EngineConfig
from inference_service.errors import ModelLoadError
from inference_service.models import demo, loader, rope
from inference_service.models.prequantized import load_prequantized
from inference_service.models.registry import (
    CROSS_ATTENTION_VISION,
    check_architecture,
    is_vision_language,
    probe_model,
)
from inference_service.worker.attention import paged as attention
from inference_service.worker.runner.encoder_memory import EncoderBudget, encoder_budget
from inference_service.worker.runner.vision_paligemma import adapt_vision_model
from inference_service.worker.weights import schemes
from inference_service.worker.weights.at_load import quantize_at_load
from inference_service.worker.weights.gguf.install import install_gguf

# transformers' attention for the fallback runner: exact, with no mask of ours to build.
FALLBACK_ATTENTION = "eager"


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (torch.nn.Module types its attributes as tensors)
    tokenizer: object
    device: torch.device
    model_id: str  # the name the API serves it under (loader.served_name)
    model_sha: str | None
    quantize: str | None = None  # the scheme serving; None: full precision
    num_quantized: int = 0  # linears replaced by quantized ones
    fallback_reason: str | None = None  # why transformers' attention serves it; None: the paged path
    processor: Any = None  # a vision-language model's processor (the front end's); None: text only
    encoder: EncoderBudget | None = None  # its image encoder's memory, kept out of the KV cache's budget


def load(config: EngineConfig) -> LoadedModel:
    """Resolve, check, load and probe the model; every failure is one `ModelLoadError` line."""
    device = loader.resolve_device(config.model.device)
    dtype = loader.resolve_dtype(config.model.dtype, device)
    resolved = loader.resolve_model(config.model)
    try:
        hf_config = AutoConfig.from_pretrained(resolved.path, trust_remote_code=config.model.trust_remote_code)
    except Exception as error:  # noqa: BLE001
        raise ModelLoadError(f"can't read the model config in {resolved.path}: {error}") from error
    rope_scaling = rope.rope_choice(config.model.rope_scaling, config.model.rope_factor)
    rope.apply_rope_scaling(hf_config, rope_scaling)
    fallback_reason = check_architecture(hf_config)
    scheme = schemes.resolve_scheme(
        config.model.quantize,
        schemes.checkpoint_scheme(getattr(hf_config, "quantization_config", None)),
        is_gguf=resolved.source in ("gguf", "demo"),
    )
    attention.register()
    options: dict[str, Any] = {"dtype": dtype, "device": device, "trust_remote_code": config.model.trust_remote_code}

    def load_weights(attn_implementation: str) -> tuple[torch.nn.Module, int]:
        options["attn_implementation"] = attn_implementation
        if scheme in schemes.CHECKPOINT_FORMATS:
            prequantized, num_quantized = load_prequantized(resolved.path, hf_config, scheme, **options)
            adapt_vision_model(prequantized)
            return prequantized, num_quantized
        model = loader.load_model(resolved.path, rope_scaling=rope_scaling, **options)
        adapt_vision_model(model)
        num_quantized = quantize_at_load(model, scheme) if scheme in schemes.AT_LOAD else 0
        if scheme == schemes.GGUF:
            num_quantized = install_gguf(model, _gguf_file(config, resolved))
        return model, num_quantized

    with progress.phase("loading weights", "loaded weights", total=2) as phase, progress.library_bars_off():
        model, num_quantized = load_weights(FALLBACK_ATTENTION if fallback_reason else attention.ATTENTION_NAME)
        phase.update()
        tokenizer = loader.load_tokenizer(resolved.path, trust_remote_code=config.model.trust_remote_code)
        processor = (
            loader.load_processor(resolved.path, config.model.trust_remote_code, hf_config.model_type)
            if is_vision_language(hf_config)
            else None
        )
        phase.update()
    if fallback_reason is None:
        try:
            with progress.phase("checking the model", "checked the paged attention", total=3) as phase:
                probe_model(model, device, phase.update)
        except ModelLoadError as error:  # served exactly another way, never wrong
            fallback_reason = str(error)
            # Loaded again: set_attn_implementation does not switch every model (BLOOM keeps the name
            # it was loaded with, and builds no causal mask for it).
            with progress.phase("loading weights", "loaded weights again", total=1), progress.library_bars_off():
                model, num_quantized = load_weights(FALLBACK_ATTENTION)
    if processor is not None and fallback_reason is not None and hf_config.model_type not in CROSS_ATTENTION_VISION:
        raise ModelLoadError(
            f"vision-language architecture '{hf_config.model_type}' needs the paged attention: {fallback_reason}"
        )
    encoder = encoder_budget(model, processor, config.limits.max_images_per_request) if processor else None
    return LoadedModel(
        model,
        tokenizer,
        device,
        loader.served_name(config.model, resolved),
        resolved.model_sha,
        scheme,
        num_quantized,
        fallback_reason,
        processor,
        encoder,
    )


def _gguf_file(config: EngineConfig, resolved: loader.ResolvedModel):
    """The GGUF file a converted folder came from (the demo's is kept in its cache)."""
    return demo.ensure_demo_gguf() if resolved.source == "demo" else config.model.model_id
