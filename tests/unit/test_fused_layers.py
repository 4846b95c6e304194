"""An fp32 decode step's layers in one native call (runner/fused_layers.py) compute bitwise what the
op-by-op plan computes: the same logits and the same K/V rows in the cache, over 1 to 16 rows on
shuffled block tables with ragged context lengths, GQA, Qwen2's biases, Qwen3's Q/K norms and sliding
windows; over fp32 panels and packed 4- and 8-bit codes (int8 activations too); into fp32, fp16,
bf16 and int8 caches; and with LoRA adapter rows (one row of one adapter, many rows of several).
Steps the fused call can't run (a replaced projection, a cache without its native writer) run op by op."""

from __future__ import annotations

import pytest
import torch
from decode_steps import assert_same_caches, cache_for, counted, forward
from tiny_models import tiny_model

from inference_service.worker.kernels import bindings
from inference_service.worker.kernels.packed import quantize_rtn
from inference_service.worker.linears import panelled
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.linears.replace import replace_module
from inference_service.worker.lora.batch import LoraGroup, LoraStep, lora_context
from inference_service.worker.lora.decode import DecodeLora
from inference_service.worker.lora.weights import TARGETS, AdapterWeights, LoraPair
from inference_service.worker.runner.decode_step import DecodeStep, decode_step_for

WINDOW = 5
CONFIGS = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},  # q/k/v biases
    "qwen3": {},  # per-head Q/K norms
}
ROWS = [1, 2, 5, 9, 16]  # the 4-bit few-rows kernel takes up to 8, the panel GEMM more


def _context_lens(rows: int) -> list[int]:
    return [(5 * i + 3) % 10 + 1 for i in range(rows)]  # 1 to 10 tokens: across blocks and windows


def _step(model_type: str, bits: int | None = None) -> DecodeStep:
    """The model's decode plan over fp32 panels (bits None) or packed codes of `bits`."""
    model = tiny_model(model_type, **CONFIGS[model_type])
    if bits is None:
        kernel = bindings.load_panel_linear()
        assert kernel is not None, "the native kernels did not build (is a C++ compiler installed?)"
        assert panelled.install(model.model.layers, kernel) > 0
    else:
        for name, module in list(model.model.layers.named_modules()):
            if type(module) is torch.nn.Linear:
                packed = quantize_rtn(module.weight.detach(), bits=bits, group_size=32)
                replace_module(model.model.layers, name, QuantLinear.from_packed(packed, module.bias))
    step = decode_step_for(model, bindings.load_decode_glue())
    assert step is not None and step.fused is not None, "no fused fp32 layers for a plain fp32 model"
    return step


def _equal_fused_and_op_by_op(step: DecodeStep, context_lens: list[int], kv_dtype=torch.float32) -> torch.Tensor:
    """Runs the step fused, then op by op on a fresh cache: the logits and caches equal bitwise."""
    counting = counted(step)
    fused_cache, plain_cache = cache_for(step, torch.float32, kv_dtype), cache_for(step, torch.float32, kv_dtype)
    together = forward(step, fused_cache, context_lens)
    assert counting.calls == 1, "the fused call did not run"
    fused, step.fused = step.fused, None
    one_by_one = forward(step, plain_cache, context_lens)
    step.fused = fused
    assert together.shape == (len(context_lens), step.lm_head.out_features)
    assert torch.equal(together, one_by_one), f"max |diff| {(together - one_by_one).abs().max():.3g}"
    assert_same_caches(fused_cache, plain_cache)
    assert not torch.equal(fused_cache.keys[0], cache_for(step, torch.float32, kv_dtype).keys[0]), "no K/V written"
    return together


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_fused_layers_equal_the_op_by_op_plan_bitwise(model_type, rows):
    _equal_fused_and_op_by_op(_step(model_type), _context_lens(rows))


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.int8], ids=str)
def test_caches_of_other_dtypes_are_written_natively_in_the_call(kv_dtype, rows):
    _equal_fused_and_op_by_op(_step("qwen3"), _context_lens(rows), kv_dtype)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits", [4, 8])
def test_packed_codes_equal_the_op_by_op_plan_bitwise(bits, rows):
    _equal_fused_and_op_by_op(_step("qwen2", bits), _context_lens(rows), torch.float16)


@pytest.mark.parametrize("rows", [1, 9])
def test_int8_activations_equal_the_op_by_op_plan_bitwise(monkeypatch, rows):
    monkeypatch.setenv("INFERENCE_SERVICE_QUANT_ACTIVATIONS", "int8")
    step = _step("llama", 4)
    few_rows = step.layers[0].qkv.native_calls()[1]
    assert few_rows is not None and "q8" in few_rows.fn.__name__, "the int8-activation kernel was not chosen"
    _equal_fused_and_op_by_op(step, _context_lens(rows))


def _lora(step: DecodeStep, names: list[str], rank: int = 4) -> list[AdapterWeights]:
    """Adapters on every projection of every layer, and the plan given their sites."""
    first = step.layers[0]
    hidden, attention = first.o_proj.out_features, first.num_heads * first.head_dim
    kv, inner = first.num_kv_heads * first.head_dim, first.gate_up.out_features // 2
    widths = {"q_proj": attention, "k_proj": kv, "v_proj": kv, "o_proj": hidden, "gate_proj": inner, "up_proj": inner}
    shapes = {
        (layer.index, t): (attention if t == "o_proj" else hidden, widths[t]) for layer in step.layers for t in widths
    }
    shapes |= {(layer.index, "down_proj"): (inner, hidden) for layer in step.layers}
    assert set(t for _, t in shapes) == set(TARGETS)
    step.lora = DecodeLora([layer.index for layer in step.layers], shapes)
    generator = torch.Generator().manual_seed(11)
    adapters = []
    for name in names:
        pairs = {
            site: LoraPair(torch.randn(n_in, rank, generator=generator), torch.randn(rank, n_out, generator=generator))
            for site, (n_in, n_out) in shapes.items()
        }
        adapters.append(AdapterWeights(name, rank, pairs))
    return adapters


@pytest.mark.parametrize(
    ("rows", "groups"),
    [(1, [[0]]), (5, [[0, 1, 2, 3, 4]]), (16, [[0, 5, 9], [1, 2, 3, 15], [4, 6, 7, 8, 10], [12, 13]])],
    ids=["one-row", "one-adapter", "four-adapters"],
)
@pytest.mark.parametrize("bits", [None, 4])
def test_adapter_rows_run_inside_the_call_bitwise(bits, rows, groups):
    """The step's LoRA updates added inside the call equal the op-by-op plan's (StepAdder's); rows of
    no adapter (row 11 of 16) get none."""
    step = _step("qwen2", bits)
    adapters = _lora(step, [f"a{i}" for i in range(len(groups))])
    without = forward(step, cache_for(step, torch.float32, torch.float32), _context_lens(rows))

    def lora_step() -> LoraStep:
        whole = len(groups) == 1 and len(groups[0]) == rows
        return LoraStep(
            [
                LoraGroup(adapter, None if whole else torch.tensor(group), len(group))
                for adapter, group in zip(adapters, groups, strict=True)
            ]
        )

    counting = counted(step)
    fused_cache, plain_cache = (
        cache_for(step, torch.float32, torch.float32),
        cache_for(step, torch.float32, torch.float32),
    )
    with lora_context(lora_step()):
        together = forward(step, fused_cache, _context_lens(rows))
    assert counting.calls == 1, "the fused call did not run the step with adapter rows"
    fused, step.fused = step.fused, None
    with lora_context(lora_step()):
        one_by_one = forward(step, plain_cache, _context_lens(rows))
    step.fused = fused
    assert torch.equal(together, one_by_one), f"max |diff| {(together - one_by_one).abs().max():.3g}"
    assert_same_caches(fused_cache, plain_cache)
    adapted = sorted(row for group in groups for row in group)
    for row in range(rows):
        assert torch.equal(together[row], without[row]) != (row in adapted), f"row {row}'s adapter"


def test_a_replaced_projection_runs_op_by_op():
    step = _step("llama")
    counting = counted(step)
    before = forward(step, cache_for(step, torch.float32, torch.float32), [5, 9])
    step.layers[1].down = torch.nn.Sequential(step.layers[1].down, torch.nn.Identity())  # computes the same
    after = forward(step, cache_for(step, torch.float32, torch.float32), [5, 9])
    assert counting.calls == 1, "the fused call ran over a replaced projection"
    assert torch.equal(before, after)


def test_a_cache_without_its_native_writer_runs_op_by_op():
    step = _step("llama")
    counting = counted(step)
    cache = cache_for(step, torch.float32, torch.float16)
    cache.writer = None
    logits = forward(step, cache, [5, 9])
    assert counting.calls == 0 and bool(torch.isfinite(logits).all())
    assert str(step) == "fused projections, all layers in one native fp32 call"
