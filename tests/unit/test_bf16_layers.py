"""A bf16 decode step's layers in one native call (runner/bf16_layers.py) compute bitwise what the
op-by-op plan computes: the same logits and the same K/V rows in the cache, on shuffled block tables
with ragged context lengths, Qwen2's biases, Qwen3's Q/K norms and sliding windows per layer. Steps
the fused call can't run (a replaced projection, an adapter row, another KV dtype) still run op by op;
with LoRA enabled, steps without adapter rows keep the fused call."""

from __future__ import annotations

import pytest
import torch
from decode_steps import assert_same_caches, cache_for, counted
from decode_steps import forward as _forward
from tiny_models import tiny_model

from inference_service.worker.attention.kv_cache import PagedKVCache
from inference_service.worker.kernels import bindings
from inference_service.worker.kernels.bf16_glue import load_bf16_decode_glue
from inference_service.worker.linears import bf16 as bf16_linear
from inference_service.worker.runner.decode_step import DecodeStep, decode_step_for

WINDOW = 5
CONFIGS = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},  # q/k/v biases
    "qwen3": {},  # per-head Q/K norms
}


def _step(model_type: str) -> DecodeStep:
    model = tiny_model(model_type, **CONFIGS[model_type]).to(torch.bfloat16)
    kernel = bindings.load_bf16_linear()
    assert kernel is not None, "the native kernels did not build (is a C++ compiler installed?)"
    assert bf16_linear.install(model, kernel) > 0
    step = decode_step_for(model, load_bf16_decode_glue())
    assert step is not None and step.fused is not None, "no fused bf16 layers for a plain bf16 model"
    return step


def _cache(step: DecodeStep, kv_dtype: torch.dtype = torch.bfloat16) -> PagedKVCache:
    return cache_for(step, torch.bfloat16, kv_dtype)


@pytest.mark.parametrize("context_lens", [[9], [1, 14, 6], [23, 2, 11, 8, 17]], ids=lambda n: f"{len(n)}rows")
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_fused_layers_equal_the_op_by_op_plan_bitwise(model_type, context_lens):
    step = _step(model_type)
    counting = counted(step)
    fused_cache, plain_cache = _cache(step), _cache(step)
    together = _forward(step, fused_cache, context_lens)
    assert counting.calls == 1, "the fused call did not run"
    step.fused = None
    one_by_one = _forward(step, plain_cache, context_lens)
    assert together.dtype == torch.float32 and together.shape == (len(context_lens), step.lm_head.out_features)
    assert torch.equal(together, one_by_one), f"max |diff| {(together - one_by_one).abs().max():.3g}"
    assert_same_caches(fused_cache, plain_cache)
    assert not torch.equal(fused_cache.keys[0], _cache(step).keys[0]), "the step wrote no K/V row"


def test_a_wrapped_projection_runs_op_by_op():
    """LoRA replaces a layer's fused projection by its own module: the fused call must not skip it."""
    step = _step("llama")
    counting = counted(step)
    before = _forward(step, _cache(step), [5, 9])
    original = step.layers[1].down
    step.layers[1].down = torch.nn.Sequential(original, torch.nn.Identity())  # computes the same
    after = _forward(step, _cache(step), [5, 9])
    assert counting.calls == 1, "the fused call ran over a replaced projection"
    assert torch.equal(before, after)


def test_another_kv_dtype_runs_op_by_op():
    step = _step("llama")
    counting = counted(step)
    logits = _forward(step, _cache(step, torch.float16), [5, 9])
    assert counting.calls == 0 and bool(torch.isfinite(logits).all())


def test_lora_steps_without_an_adapter_keep_the_fused_call():
    """With LoRA enabled (the decode plan given its sites), a step with no adapter row still runs the
    one-call layers; a step with an adapter row runs op by op and adds the adapter's update."""
    from inference_service.worker.lora.batch import LoraGroup, LoraStep, lora_context
    from inference_service.worker.lora.decode import DecodeLora
    from inference_service.worker.lora.weights import TARGETS, AdapterWeights, LoraPair

    step = _step("llama")
    counting = counted(step)
    before = _forward(step, _cache(step), [5, 9])
    first = step.layers[0]
    hidden, attention = first.o_proj.out_features, first.num_heads * first.head_dim
    kv, inner = first.num_kv_heads * first.head_dim, first.gate_up.out_features // 2
    widths = {"q_proj": attention, "k_proj": kv, "v_proj": kv, "o_proj": hidden, "gate_proj": inner, "up_proj": inner}
    shapes = {(layer.index, t): (hidden, widths[t]) for layer in step.layers for t in TARGETS if t != "down_proj"}
    shapes |= {(layer.index, "down_proj"): (inner, hidden) for layer in step.layers}
    step.lora = DecodeLora([layer.index for layer in step.layers], shapes)
    without = _forward(step, _cache(step), [5, 9])
    assert counting.calls == 2, "a step without adapter rows left the fused call"
    assert torch.equal(before, without)
    generator = torch.Generator().manual_seed(11)
    pair = LoraPair(torch.randn(hidden, 4, generator=generator), torch.randn(4, attention, generator=generator))
    adapter = AdapterWeights("a", 4, {(0, "q_proj"): pair})
    with lora_context(LoraStep([LoraGroup(adapter, torch.tensor([1]), 1)])):
        with_adapter = _forward(step, _cache(step), [5, 9])
    assert counting.calls == 2, "the fused call ran a step with an adapter row"
    assert torch.equal(with_adapter[0], without[0]) and not torch.equal(with_adapter[1], without[1])
