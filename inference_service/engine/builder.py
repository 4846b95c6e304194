"""Build a ready `LLMEngine` from an `EngineConfig`: load, probe, size the KV cache, warm up.

Everything found here at run time (block count, limits, EOS ids) goes into `EngineInfo`;
the config stays as the user gave it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AutoConfig

from inference_service import progress
from inference_service.config import EngineConfig, LimitsConfig, parse_cuda_graphs
from inference_service.engine.kv_sizing import plan_num_blocks, profile_kv_blocks, sized_by_memory
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.speculation import Speculator
from inference_service.engine.step_cost import StepCost
from inference_service.errors import ModelLoadError
from inference_service.models import context, demo, loader, rope
from inference_service.models.lora_files import AdapterError, parse_adapter_specs
from inference_service.models.lora_registry import AdapterRegistry
from inference_service.models.prequantized import load_prequantized
from inference_service.models.registry import (
    CROSS_ATTENTION_VISION,
    check_architecture,
    is_vision_language,
    probe_model,
)
from inference_service.outputs import EngineInfo, Runner, ScheduledRequest
from inference_service.sample.grammar import GrammarBudget, GrammarCompiler
from inference_service.sample.ngram_proposer import NgramProposer
from inference_service.sample.sampler import Sampler
from inference_service.worker.attention import paged as attention
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache, resolve_kv_dtype
from inference_service.worker.kernels.bindings import (
    bf16_linear_kernel_for,
    decode_kernel_for,
    kv_writer_for,
    linear_kernel_for,
    panel_kernel_for,
)
from inference_service.worker.kernels.decode_glue import decode_glue_for
from inference_service.worker.linears import bf16 as bf16_linear
from inference_service.worker.linears import native as native_linear
from inference_service.worker.linears import panelled as panelled_linear
from inference_service.worker.lora.install import install_lora, projection_shapes
from inference_service.worker.lora.weights import LoraTable
from inference_service.worker.runner.cuda_graphs import (
    PADDING_BLOCKS,
    StaticDecode,
    blocks_per_sequence,
    static_decode_sizes,
)
from inference_service.worker.runner.decode_step import decode_step_for
from inference_service.worker.runner.encoder_memory import EncoderBudget, encoder_budget
from inference_service.worker.runner.image_encoder import ImageEncoder
from inference_service.worker.runner.model_runner import ModelRunner, probe_layer_shapes
from inference_service.worker.runner.vision_paligemma import adapt_vision_model
from inference_service.worker.shard_group import ShardGroup
from inference_service.worker.transformers_runner.runner import ATTENTION_IMPL, TransformersRunner
from inference_service.worker.weights import schemes
from inference_service.worker.weights.at_load import quantize_at_load, weights_nbytes
from inference_service.worker.weights.gguf.install import install_gguf

logger = logging.getLogger(__name__)

# transformers' attention for the fallback runner: exact, with no mask of ours to build.
FALLBACK_ATTENTION = "eager"
# A step's token budget when --max-batch-prefill-tokens is not given. A step is what every running
# stream and every new arrival waits for. Measured on a 2-core CPU with the demo model
# (benchmarks/bystander_latency.py, a 2048-token prompt): 256 prefills as fast as 512 (415 vs 403
# tokens/s) while a short request beside it waits 0.8 s instead of 2.3 s; 128 cuts that to 0.5 s
# but prefills 23% slower.
DEFAULT_PREFILL_TOKENS = {"cpu": 256, "cuda": 4096}
# LoRA adapters resident at once when --max-loras is not given (at least those --lora-adapters names).
DEFAULT_MAX_LORAS = 8


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


def build_engine(config: EngineConfig) -> LLMEngine:
    """Load the model named by the config and return an engine ready to serve it (one shard:
    engine.shards.build_engine serves --num-shard)."""
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    loaded = load(config)
    with progress.phase("preparing the engine", "prepared the engine", total=3) as phase:
        return build_from(config, loaded, phase)


def build_from(
    config: EngineConfig,
    loaded: LoadedModel,
    phase: progress.Phase,
    shard_runner: Callable[[ModelRunner], Runner] | None = None,
    group: ShardGroup | None = None,
) -> LLMEngine:
    """The engine over a loaded model; with `group` (tensor parallel: the model is this shard's
    slice) the paged runner is wrapped by `shard_runner`."""
    if shard_runner is not None and config.model.lora_enabled:
        raise ModelLoadError("LoRA adapters are not served with --num-shard > 1 yet: serve them on one shard")
    native_linears = install_native_linears(loaded)
    phase.update()
    runner: Runner
    dtype = next(loaded.model.parameters()).dtype
    if loaded.fallback_reason is None:
        model_runner, num_blocks = paged_runner(config, loaded, group)
        kv_dtype = model_runner.kv_cache.kv_dtype if model_runner.kv_cache is not None else dtype
        runner = model_runner if shard_runner is None else shard_runner(model_runner)
    else:  # blocks stay the memory budget of the per-request caches (in the model's dtype)
        kv_dtype = dtype
        reserved = loaded.encoder.reserved_bytes if loaded.encoder is not None else 0  # Mllama's vision tower
        num_blocks = plan_num_blocks(
            config.cache, config_layer_shapes(loaded.model.config), dtype, loaded.device, reserved
        )
        runner = TransformersRunner(loaded.model, loaded.device)
        if config.cache.kv_cache_dtype != "auto":
            logger.warning(
                "--kv-cache-dtype %s does not apply here: the fallback keeps transformers' caches",
                config.cache.kv_cache_dtype,
            )
        logger.warning(
            "serving %s through transformers' attention, one cache per request (no prefix caching): %s",
            config.model.model_id,
            loaded.fallback_reason,
        )
    adapters = enable_lora(config, loaded, runner) if config.model.lora_enabled else None
    phase.update()
    info = make_info(config, loaded, num_blocks)
    sampler = Sampler(info.vocab_size, config.limits.watermark_gamma, config.limits.watermark_delta)
    grammar_compiler = (
        None if config.limits.disable_grammar_support else make_grammar_compiler(loaded.tokenizer, info, config.limits)
    )
    phase.update()
    speculator = None
    if info.speculate:
        speculator = Speculator(NgramProposer(), info.speculate, info.max_total_tokens)
    engine = LLMEngine(
        info,
        loaded.tokenizer,
        runner,
        sampler,
        info.max_batch_prefill_tokens,
        config.scheduler.max_batch_size,
        grammar_compiler,
        speculator,
        # Prefill chunks are counted in work: attention over a long context costs as much as the weights.
        StepCost.for_hidden_size(getattr(loaded.model.config.get_text_config(), "hidden_size", None)),
        adapters,
    )
    engine.processor = loaded.processor
    logger.info(
        "engine ready: %s (%s, %s), weights %s (%.1f MiB, %d quantized linears), %d KV blocks of %d "
        "tokens (%s), max_total_tokens=%d, attention: %s, %s, native linears: %d, prefix caching: %s, "
        "speculate: %d",
        info.model_id,
        info.architecture,
        info.dtype,
        info.quantize or "unquantized",
        info.weights_nbytes / 2**20,
        loaded.num_quantized,
        num_blocks,
        info.block_size,
        str(kv_dtype).removeprefix("torch."),
        info.max_total_tokens,
        info.attention_impl,
        runner.describe(),
        native_linears,
        "on" if info.prefix_caching else "off",
        info.speculate,
    )
    return engine


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
    install_lora(loaded.model, runner.decode_step.layers if runner.decode_step is not None else None)
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


def install_native_linears(loaded: LoadedModel) -> int:
    """Route the model's projections through the native kernels where they take them; returns how many."""
    dtype = next(loaded.model.parameters()).dtype
    linear_kernel, panel_kernel = linear_kernel_for(loaded.device, dtype), panel_kernel_for(loaded.device, dtype)
    native_linears = panelled_linear.install(loaded.model, panel_kernel) if panel_kernel else 0
    if linear_kernel:  # what stays an nn.Linear: a head tied to the embeddings, sizes that do not fill panels
        native_linears += native_linear.install(loaded.model, linear_kernel, panel_kernel)
    bf16_kernel = bf16_linear_kernel_for(loaded.device, dtype)
    if bf16_kernel:  # decode steps of a bf16 model: bf16 weights, fp32 accumulation
        native_linears += bf16_linear.install(loaded.model, bf16_kernel)
    return native_linears


def paged_runner(config: EngineConfig, loaded: LoadedModel, group: ShardGroup | None = None) -> tuple[ModelRunner, int]:
    """The paged runner and its KV cache's block count. With `group` every shard holds shard 0's
    count of blocks (of its own heads), and all of them must call this together (the shape probe
    runs the model)."""
    dtype = next(loaded.model.parameters()).dtype
    shapes = probe_layer_shapes(loaded.model, loaded.device)
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype)
    decode_kernel = decode_kernel_for(loaded.device, dtype)
    decode_step = decode_step_for(loaded.model, decode_glue_for(loaded.device, dtype))
    image_encoder = ImageEncoder(loaded.model, loaded.device, loaded.encoder) if loaded.processor is not None else None

    def runner_over(kv_cache: PagedKVCache) -> ModelRunner:
        return ModelRunner(loaded.model, kv_cache, loaded.device, decode_kernel, decode_step, image_encoder)

    num_blocks = 0
    reserved = loaded.encoder.reserved_bytes if loaded.encoder is not None else 0  # the image encoder's
    if group is None and loaded.device.type == "cuda" and sized_by_memory(config.cache):
        profile_tokens = _profile_tokens(config, loaded)
        num_blocks = profile_kv_blocks(
            runner_over, shapes, dtype, loaded.device, config.cache, profile_tokens, kv_dtype=kv_dtype,
            reserved_bytes=reserved,
        )  # fmt: skip
    elif group is None or group.is_first:
        # On CPU every shard's cache comes out of the same memory: the budget holds all of them.
        sharing = group.world_size if group is not None and loaded.device.type == "cpu" else 1
        num_blocks = plan_num_blocks(config.cache, shapes * sharing, kv_dtype, loaded.device, reserved)
    if group is not None:
        num_blocks = cast(int, group.broadcast_object(num_blocks, loaded.device))
    kv_writer = kv_writer_for(loaded.device, dtype)
    block_size = config.cache.block_size
    # CUDA graphs of decode steps: their padding rows write into one block beyond the pool.
    sizes = parse_cuda_graphs(config.model.cuda_graphs)
    graph_sizes = static_decode_sizes(sizes, loaded.device.type, sharded=group is not None)
    padding = PADDING_BLOCKS if graph_sizes else 0
    runner = runner_over(
        PagedKVCache(shapes, num_blocks + padding, block_size, dtype, loaded.device, kv_dtype, kv_writer)
    )
    if graph_sizes and runner.kv_cache is not None:
        max_total = min(config.limits.max_total_tokens or _default_max_total(loaded), num_blocks * block_size)
        width = blocks_per_sequence(max_total, config.scheduler.speculate, block_size)
        runner.static_decode = StaticDecode(
            runner.forward_eager, runner.kv_cache, decode_kernel, graph_sizes, width, capture=True
        )
    return runner, num_blocks


def make_grammar_compiler(tokenizer: Any, info: EngineInfo, limits: LimitsConfig) -> GrammarCompiler | None:
    """The grammar compiler over the model's tokenizer; None (grammars refused) where the grammar engine
    can't read the tokenizer (it needs a fast one): the server still serves everything else."""
    budget = GrammarBudget(
        compile_timeout_s=limits.grammar_compile_timeout_ms / 1000, max_lexer_states=limits.grammar_max_states
    )
    try:
        return GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids, budget=budget)
    except Exception as error:  # noqa: BLE001 — a missing feature, not a failed load
        logger.warning("grammar support is off: the grammar engine can't use this tokenizer (%s)", error)
        return None


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


def config_layer_shapes(model_config) -> list[LayerShape]:
    """Per-layer K/V shapes from the config (sizing the fallback's memory budget): every head has
    its own K/V unless the config says how many it shares."""
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads
    return [LayerShape(num_kv_heads=kv_heads, head_dim=head_dim)] * text.num_hidden_layers


def _gguf_file(config: EngineConfig, resolved: loader.ResolvedModel):
    """The GGUF file a converted folder came from (the demo's is kept in its cache)."""
    return demo.ensure_demo_gguf() if resolved.source == "demo" else config.model.model_id


def _profile_tokens(config: EngineConfig, loaded: LoadedModel) -> int:
    """The largest prefill step the scheduler will run, within the model's stated context."""
    tokens = config.scheduler.max_batch_prefill_tokens or DEFAULT_PREFILL_TOKENS[loaded.device.type]
    stated = context.stated_context_length(loaded.model.config)
    return min(tokens, stated) if stated else tokens


def make_info(config: EngineConfig, loaded: LoadedModel, num_blocks: int) -> EngineInfo:
    """Resolve the auto limits against the model's context and the KV capacity."""
    text_config = loaded.model.config.get_text_config()
    capacity = num_blocks * config.cache.block_size
    limits = config.limits
    max_total = limits.max_total_tokens or min(_default_max_total(loaded), capacity)
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


def _default_max_total(loaded: LoadedModel) -> int:
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


def warm_up(engine: LLMEngine, num_tokens: int = 16) -> None:
    """Run one small prefill and one decode so the first real request pays no first-call costs."""
    runner, kv = engine.runner, engine.kv
    num_tokens = min(num_tokens, engine.info.max_input_tokens)
    table = kv.allocate_slots(_WARMUP_ID, num_tokens + 1)
    if table is None:
        raise ModelLoadError(f"the KV cache holds fewer than the {num_tokens + 1} tokens of the warm-up")
    try:
        with progress.phase("warming up", "warmed up", total=2) as phase:
            runner.execute(
                [
                    ScheduledRequest(
                        _WARMUP_ID, 0, num_tokens, [0] * num_tokens, table, True, encoder_token_ids=[0] * num_tokens
                    )
                ]
            )
            phase.update()
            runner.execute([ScheduledRequest(_WARMUP_ID, num_tokens, 1, [0], table, True)])
            phase.update()
    finally:
        kv.free(_WARMUP_ID)
        runner.release(_WARMUP_ID)


_WARMUP_ID = "__warmup__"
