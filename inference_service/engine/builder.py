"""Build a ready `LLMEngine` from an `EngineConfig`: load (model_load), size the KV cache, pick the
runner and its kernels, set up LoRA (lora_setup), warm up.

Everything found here at run time (block count, limits, EOS ids) goes into `EngineInfo`
(engine_info); the config stays as the user gave it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from inference_service import progress
from inference_service.config import EngineConfig, LimitsConfig, parse_cuda_graphs
from inference_service.engine.engine_info import DEFAULT_PREFILL_TOKENS, default_max_total, make_info
from inference_service.engine.host_heap import keep_freed_memory
from inference_service.engine.kv_sizing import plan_num_blocks, profile_kv_blocks, sized_by_memory
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.lora_setup import enable_lora
from inference_service.engine.model_load import LoadedModel, load
from inference_service.engine.speculation import Speculator
from inference_service.engine.step_cost import StepCost
from inference_service.errors import ModelLoadError
from inference_service.models import context
from inference_service.outputs import EngineInfo, Runner, ScheduledRequest
from inference_service.sample.grammar import GrammarBudget, GrammarCompiler
from inference_service.sample.ngram_proposer import NgramProposer
from inference_service.sample.sampler import Sampler
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache, resolve_kv_dtype
from inference_service.worker.kernels.bindings import (
    bf16_linear_kernel_for,
    decode_kernel_for,
    kv_writer_for,
    linear_kernel_for,
    panel_kernel_for,
)
from inference_service.worker.kernels.decode_glue import decode_glue_for
from inference_service.worker.kernels.logits_bindings import logits_row_stats_for
from inference_service.worker.linears import bf16 as bf16_linear
from inference_service.worker.linears import native as native_linear
from inference_service.worker.linears import panelled as panelled_linear
from inference_service.worker.linears import tied_head
from inference_service.worker.runner.cuda_graphs import (
    PADDING_BLOCKS,
    StaticDecode,
    blocks_per_sequence,
    static_decode_sizes,
)
from inference_service.worker.runner.decode_step import decode_step_for
from inference_service.worker.runner.graph_memory import graph_reserve_bytes
from inference_service.worker.runner.image_encoder import ImageEncoder
from inference_service.worker.runner.model_runner import ModelRunner, probe_layer_shapes
from inference_service.worker.shard_group import ShardGroup
from inference_service.worker.transformers_runner.runner import TransformersRunner

logger = logging.getLogger(__name__)


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
    shard_runner: Callable[[Runner], Runner] | None = None,
    group: ShardGroup | None = None,
) -> LLMEngine:
    """The engine over a loaded model; with `group` (tensor parallel: the model is this shard's
    slice) the runner is wrapped by `shard_runner`."""
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
        fallback = TransformersRunner(loaded.model, loaded.device)
        runner = fallback if shard_runner is None else shard_runner(fallback)
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
    sampler = Sampler(
        info.vocab_size,
        config.limits.watermark_gamma,
        config.limits.watermark_delta,
        row_stats=logits_row_stats_for(loaded.device),
    )
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


def install_native_linears(loaded: LoadedModel) -> int:
    """Route the model's projections through the native kernels where they take them; returns how many."""
    dtype = next(loaded.model.parameters()).dtype
    linear_kernel, panel_kernel = linear_kernel_for(loaded.device, dtype), panel_kernel_for(loaded.device, dtype)
    native_linears = 0
    if panel_kernel:  # the projections, then a head tied to the embeddings (one table, in panels)
        native_linears += panelled_linear.install(loaded.model, panel_kernel)
        native_linears += tied_head.install(loaded.model, panel_kernel)
    if linear_kernel:  # what stays an nn.Linear: sizes that do not fill panels, a tied head tied_head leaves
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
    if loaded.device.type == "cpu":  # each step's activations reuse the last one's pages (host_heap.py)
        keep_freed_memory()
    shapes = probe_layer_shapes(loaded.model, loaded.device)
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype)
    decode_kernel = decode_kernel_for(loaded.device, dtype)
    decode_step = decode_step_for(loaded.model, decode_glue_for(loaded.device, dtype))
    image_encoder = ImageEncoder(loaded.model, loaded.device, loaded.encoder) if loaded.processor is not None else None

    def runner_over(kv_cache: PagedKVCache) -> ModelRunner:
        return ModelRunner(loaded.model, kv_cache, loaded.device, decode_kernel, decode_step, image_encoder)

    num_blocks = 0
    reserved = loaded.encoder.reserved_bytes if loaded.encoder is not None else 0  # the image encoder's
    sizes = parse_cuda_graphs(config.model.cuda_graphs)
    graph_sizes = static_decode_sizes(sizes, loaded.device.type, sharded=group is not None)
    if group is None and loaded.device.type == "cuda" and sized_by_memory(config.cache):
        profile_tokens = _profile_tokens(config, loaded)
        max_total = config.limits.max_total_tokens or default_max_total(loaded)
        graphs = graph_reserve_bytes(  # the decode graphs, captured later, are kept out of the KV budget
            loaded.model.config,
            graph_sizes,
            dtype.itemsize,
            max_total,
            config.scheduler.speculate,
            config.cache.block_size,
        )
        num_blocks = profile_kv_blocks(
            runner_over, shapes, dtype, loaded.device, config.cache, profile_tokens, kv_dtype=kv_dtype,
            reserved_bytes=reserved + graphs,
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
    padding = PADDING_BLOCKS if graph_sizes else 0
    runner = runner_over(
        PagedKVCache(shapes, num_blocks + padding, block_size, dtype, loaded.device, kv_dtype, kv_writer)
    )
    if graph_sizes and runner.kv_cache is not None:
        max_total = min(config.limits.max_total_tokens or default_max_total(loaded), num_blocks * block_size)
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


def config_layer_shapes(model_config) -> list[LayerShape]:
    """Per-layer K/V shapes from the config (sizing the fallback's memory budget): every head has
    its own K/V unless the config says how many it shares."""
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads
    return [LayerShape(num_kv_heads=kv_heads, head_dim=head_dim)] * text.num_hidden_layers


def _profile_tokens(config: EngineConfig, loaded: LoadedModel) -> int:
    """The largest prefill step the scheduler will run, within the model's stated context."""
    tokens = config.scheduler.max_batch_prefill_tokens or DEFAULT_PREFILL_TOKENS[loaded.device.type]
    stated = context.stated_context_length(loaded.model.config)
    return min(tokens, stated) if stated else tokens


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
