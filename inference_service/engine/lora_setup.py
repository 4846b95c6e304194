"""LoRA on the paged runner: the model's projections wrapped in LoRA linears, and the adapters of
--lora-adapters loaded into a registry that keeps up to --max-loras resident."""

from __future__ import annotations

from inference_service.config import EngineConfig
from inference_service.engine.model_load import LoadedModel
from inference_service.errors import ModelLoadError
from inference_service.models.lora_files import AdapterError, parse_adapter_specs
from inference_service.models.lora_registry import AdapterRegistry
from inference_service.outputs import Runner
from inference_service.worker.lora.install import install_lora, projection_shapes
from inference_service.worker.lora.weights import LoraTable
from inference_service.worker.runner.model_runner import ModelRunner

# LoRA adapters resident at once when --max-loras is not given (at least those --lora-adapters names).
DEFAULT_MAX_LORAS = 8


def enable_lora(config: EngineConfig, loaded: LoadedModel, runner: Runner) -> AdapterRegistry:
    """Wrap the model's projections in LoRA linears and load --lora-adapters; a model or an adapter
    that can't be served is one ModelLoadError line."""
    if not isinstance(runner, ModelRunner) or loaded.model.config.is_encoder_decoder:
        raise ModelLoadError(
            f"LoRA adapters are served by the paged runner on decoder-only models; {config.model.model_id} "
            f"is served by transformers' attention ({loaded.fallback_reason or 'an encoder-decoder'})"
        )
    try:
        shapes = projection_shapes(loaded.model)
        specs = parse_adapter_specs(config.model.lora_adapters)
    except ValueError as error:
        raise ModelLoadError(str(error)) from error
    max_loras = config.model.max_loras or max(DEFAULT_MAX_LORAS, len(specs))
    if len(specs) > max_loras:
        raise ModelLoadError(f"--lora-adapters names {len(specs)} adapters, more than --max-loras {max_loras}")
    table = LoraTable()
    install_lora(loaded.model, runner.decode_step)
    runner.lora = table
    registry = AdapterRegistry(
        table,
        shapes,
        max_loras,
        config.model.max_lora_rank,
        loaded.device,
        loaded.model_id,
        config.model.huggingface_hub_cache,
    )
    for name, source in specs:
        try:
            registry.load(name, source)
        except AdapterError as error:
            raise ModelLoadError(str(error)) from error
    return registry
