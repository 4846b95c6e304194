"""The native LoRA kernel (SGMV/BGMV) against float64, and the LoRA linears' native path against
their torch path (the reference)."""

from __future__ import annotations

import pytest
import torch

from inference_service.worker.kernels.lora_bindings import load_lora_kernel
from inference_service.worker.lora import native
from inference_service.worker.lora.batch import LoraGroup, LoraStep, lora_context
from inference_service.worker.lora.linear import LoraLinear
from inference_service.worker.lora.weights import TARGETS, AdapterWeights, LoraPair

pytestmark = pytest.mark.skipif(load_lora_kernel() is None, reason="no C++ compiler for the native kernel")

IN = 64
WIDTHS = {"q_proj": 64, "k_proj": 24, "v_proj": 24}  # a fused q|k|v with a tail of 24 % 16 columns


def _adapter(name: str, rank: int, seed: int, sites: list[tuple[int, str]]) -> AdapterWeights:
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for site in sites:
        a = torch.randn(rank, IN, generator=generator)  # PEFT's lora_A layout, as lora_files keeps it
        b = torch.randn(rank, WIDTHS[site[1]], generator=generator) * 0.5
        pairs[site] = LoraPair(a=a.t(), b=b)
    return AdapterWeights(name, rank, pairs)


def _reference(x, y, groups, parts):
    """float64: y + Σ over groups and parts of (x[rows] · a) · b into the part's columns."""
    out = y.double().clone()
    for adapter, rows in groups:
        for site, columns in parts:
            pair = adapter.pairs.get(site)
            if pair is not None:
                out[rows, columns] += (x[rows].double() @ pair.a.double()) @ pair.b.double()
    return out


def _step(groups, num_rows):
    return LoraStep(
        [
            LoraGroup(adapter, None if len(rows) == num_rows else torch.tensor(rows), len(rows))
            for adapter, rows in groups
        ]
    )


def _native_parts(parts):
    return native.parts_of([(site, c.start, c.stop - c.start) for site, c in parts])


def _fused_parts(layer: int):
    parts, start = [], 0
    for target, width in WIDTHS.items():
        parts.append(((layer, target), slice(start, start + width)))
        start += width
    return parts


@pytest.mark.parametrize("num_rows", [3, 16, 200])  # 200 rows: past the threshold where threads split the work
def test_sgmv_mixed_adapters_equal_float64(num_rows):
    qkv = [(1, t) for t in WIDTHS]
    adapters = [
        _adapter("a", 16, 1, qkv),
        _adapter("b", 5, 2, qkv[:2]),  # an odd rank, and no v_proj
        _adapter("c", 8, 3, [(0, "q_proj")]),  # another layer only: nothing at layer 1
    ]
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(0)).tolist()
    # rows interleaved across adapters; the last rows use the base (no group)
    third = max(1, num_rows // 4)
    groups = [(adapters[i], sorted(order[i * third : (i + 1) * third])) for i in range(3)]
    x = torch.randn(num_rows, IN)
    y = torch.randn(num_rows, sum(WIDTHS.values()))
    parts = _fused_parts(1)
    expected = _reference(x, y, groups, parts)
    step = _step(groups, num_rows)
    got = y.clone()
    assert native.add_native(x, got, step, _native_parts(parts))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    base_rows = sorted(set(range(num_rows)) - {r for _, rows in groups for r in rows})
    assert torch.equal(got[base_rows], y[base_rows])  # rows of the base are untouched


def test_bgmv_one_row_equals_float64():
    adapter = _adapter("a", 16, 4, [(2, t) for t in WIDTHS])
    x, y = torch.randn(1, IN), torch.randn(1, sum(WIDTHS.values()))
    parts = _fused_parts(2)
    expected = _reference(x, y, [(adapter, [0])], parts)
    step = _step([(adapter, [0])], 1)
    got = y.clone()
    assert native.add_native(x, got, step, _native_parts(parts))
    assert step.native.single is not None  # the fused single-row path ran
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_linear_native_path_equals_torch_path(monkeypatch):
    """LoraLinear's output through the kernel equals its torch path, a whole-step adapter and a mix."""
    base = torch.nn.Linear(IN, 64, bias=False)
    linear = LoraLinear(base, (0, "q_proj"))
    one, two = _adapter("a", 8, 5, [(0, "q_proj")]), _adapter("b", 4, 6, [(0, "q_proj")])
    x = torch.randn(6, IN)
    for groups in ([(one, list(range(6)))], [(one, [0, 3]), (two, [1, 5])]):
        with torch.no_grad(), lora_context(_step(groups, 6)):
            fast = linear(x)
        monkeypatch.setattr(native, "MAX_NATIVE_ROWS", 0)  # the torch path
        with torch.no_grad(), lora_context(_step(groups, 6)):
            reference = linear(x)
        monkeypatch.undo()
        torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
        assert not torch.equal(fast, base(x))  # the adapter changed the output


def test_kernel_refuses_what_it_cannot_take():
    """`in` not a multiple of 8, or bf16 tensors: add_native says no and the torch path runs."""
    adapter = _adapter("a", 4, 7, [(0, "q_proj")])
    step = _step([(adapter, [0, 1])], 2)
    parts = native.parts_of([((0, "q_proj"), 0, 64)])
    assert not native.add_native(torch.randn(2, IN).bfloat16(), torch.randn(2, 64).bfloat16(), step, parts)
    assert not native.add_native(torch.randn(2, IN)[:, :60], torch.randn(2, 64), step, parts)


def test_sgmv_split_over_threads_equals_float64():
    """Enough work (~8M FMAs, past the kernel's threading threshold) that threads take its tasks."""
    adapter = _adapter("a", 64, 8, [(3, t) for t in WIDTHS])
    x, y = torch.randn(400, IN), torch.randn(400, sum(WIDTHS.values()))
    rows = list(range(0, 400, 2)) + list(range(1, 400, 4))
    parts = _fused_parts(3)
    expected = _reference(x, y, [(adapter, rows)], parts)
    got = y.clone()
    assert native.add_native(x, got, _step([(adapter, rows)], 400), _native_parts(parts))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 7])  # each expand tile height, and a single row (BGMV)
def test_expand_tiles_and_column_tails_equal_float64(num_rows):
    """Every tile height the expand is instantiated for, over a width of 32 + 16 + 8 + 5 columns (each
    block size and the scalar tail), one adapter for the whole step."""
    generator = torch.Generator().manual_seed(num_rows)
    width = 61
    a, b = torch.randn(12, IN, generator=generator), torch.randn(12, width, generator=generator)
    adapter = AdapterWeights("a", 12, {(0, "o_proj"): LoraPair(a=a.t(), b=b)})
    x, y = torch.randn(num_rows, IN, generator=generator), torch.randn(num_rows, width, generator=generator)
    parts = [((0, "o_proj"), slice(0, width))]
    expected = _reference(x, y, [(adapter, list(range(num_rows)))], parts)
    got = y.clone()
    assert native.add_native(
        x, got, _step([(adapter, list(range(num_rows)))], num_rows), native.parts_of([((0, "o_proj"), 0, width)])
    )
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_rows", [1, 5])  # one row (BGMV), several rows over two adapters (SGMV)
def test_decode_plan_adder_equals_torch_path(monkeypatch, num_rows):
    """The decode plan's adder (ctypes arguments bound once per step) adds what add_lora's torch path
    adds, at a fused q|k|v projection; rows of the base are untouched."""
    from inference_service.worker.lora.decode import QKV, DecodeLora

    shapes = {(layer, t): (IN, WIDTHS.get(t, IN)) for layer in (0, 1) for t in TARGETS}
    plan = DecodeLora([0, 1], shapes)
    sites = [(1, t) for t in WIDTHS]
    one, two = _adapter("a", 16, 9, sites), _adapter("b", 5, 10, sites[:2])
    groups = [(one, [0])] if num_rows == 1 else [(one, [0, 3]), (two, [1, 4])]
    x, y = torch.randn(num_rows, IN), torch.randn(num_rows, sum(WIDTHS.values()))
    got = y.clone()
    fast = plan.adder(_step(groups, num_rows), x)
    assert fast.native
    fast.add(x, got, 1, QKV)
    monkeypatch.setattr(native, "MAX_NATIVE_ROWS", 0)  # the torch path
    expected = y.clone()
    step = _step(groups, num_rows)
    with lora_context(step):
        reference = plan.adder(step, x)
        assert not reference.native
        reference.add(x, expected, 1, QKV)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, y)
    if num_rows > 1:
        assert torch.equal(got[2], y[2])  # row 2 runs on the base


@pytest.fixture
def forced_threads():
    """Set the kernel's thread mode for a test (lora_bindings.LoraKernel.force_threads), then back to the default."""
    kernel = load_lora_kernel()
    assert kernel is not None
    yield kernel.force_threads
    kernel.force_threads(0)


@pytest.mark.parametrize("mode", [1, 2])  # one thread, the team: each decode-sized call may take either way
@pytest.mark.parametrize("num_rows", [1, 16])  # BGMV's parts split over the team; SGMV's tiles and parts
def test_decode_sized_calls_equal_float64_either_way(forced_threads, mode, num_rows):
    qkv = [(4, t) for t in WIDTHS]
    adapters = [_adapter(name, rank, seed, qkv) for name, rank, seed in (("a", 16, 11), ("b", 5, 12))]
    if num_rows == 1:
        groups = [(adapters[0], [0])]
    else:
        groups = [(adapters[i % 2], list(range(i, num_rows, 3))) for i in range(2)]  # every third row: base
    x, y = torch.randn(num_rows, IN), torch.randn(num_rows, sum(WIDTHS.values()))
    parts = _fused_parts(4)
    expected = _reference(x, y, groups, parts)
    results = {}
    for setting in (mode, 3 - mode):
        forced_threads(setting)
        got = y.clone()
        assert native.add_native(x, got, _step(groups, num_rows), _native_parts(parts))
        results[setting] = got
    torch.testing.assert_close(results[mode].double(), expected, rtol=1e-5, atol=1e-4)
    # The same tasks whichever thread runs them: the way a call runs never changes a token.
    assert torch.equal(results[1], results[2])


def test_thread_mode_setting(forced_threads):
    assert forced_threads(2) == 0  # the default rule unless told
    assert forced_threads(1) == 2
    with pytest.raises(ValueError):
        forced_threads(3)


# A fused q|k|v over panels of 32 columns: 192 columns x 352 inputs is enough work for the panel
# GEMM's threads, whose split (column 96) falls inside k_proj; 77 and 59 leave scalar column tails.
PANEL_IN = 352
PANEL_WIDTHS = {"q_proj": 77, "k_proj": 59, "v_proj": 56}


def _panel_parts(layer: int):
    parts, start = [], 0
    for target, width in PANEL_WIDTHS.items():
        parts.append(((layer, target), slice(start, start + width)))
        start += width
    return parts


def _panel_adapter(rank: int, seed: int, sites: list[tuple[int, str]]) -> AdapterWeights:
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for site in sites:
        a = torch.randn(rank, PANEL_IN, generator=generator)
        pairs[site] = LoraPair(a=a.t(), b=torch.randn(rank, PANEL_WIDTHS[site[1]], generator=generator) * 0.5)
    return AdapterWeights("a", rank, pairs)


def _panelled(bias: bool):
    from inference_service.worker.kernels.bindings import load_panel_linear
    from inference_service.worker.linears.panelled import PanelledLinear

    generator = torch.Generator().manual_seed(20)
    weight = torch.randn(sum(PANEL_WIDTHS.values()), PANEL_IN, generator=generator) * 0.1
    b = torch.randn(weight.shape[0], generator=generator) if bias else None
    return PanelledLinear.from_weight(weight, b, load_panel_linear()), weight, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_row_equals_float64(bias, threads):
    """One row's projection and update in one call equal float64, with the team or on one thread; an
    adapter leaving v_proj alone leaves those columns the base's."""
    module, weight, b = _panelled(bias)
    adapter = _panel_adapter(16, 21, [(2, "q_proj"), (2, "k_proj")])
    x = torch.randn(1, PANEL_IN)
    base = x.double() @ weight.double().t() + (b.double() if b is not None else 0)
    expected = _reference(x, base, [(adapter, [0])], _panel_parts(2))
    kernel = load_lora_kernel()
    assert kernel is not None
    parts = _native_parts(_panel_parts(2))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.panel_row(x, module.weight_panels, module.bias, native.adapter_table(adapter), parts.address, 3)
        plain = module(x)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    v = _panel_parts(2)[2][1]
    assert torch.equal(got[:, v], plain[:, v])  # the base's columns bitwise the panel GEMM's


def test_panel_row_refuses_what_it_cannot_take():
    module, _, _ = _panelled(False)
    kernel = load_lora_kernel()
    assert kernel is not None
    table = native.adapter_table(_panel_adapter(4, 22, [(0, "q_proj")]))
    too_wide = native.parts_of([((0, "q_proj"), 150, 77)])  # columns past the output's
    with pytest.raises(RuntimeError):
        kernel.panel_row(torch.randn(1, PANEL_IN), module.weight_panels, None, table, too_wide.address, 1)


@pytest.mark.parametrize("num_rows", [1, 3])  # one row: the fused call; several: the module, then sgmv
def test_decode_plan_project_equals_module_then_torch_path(monkeypatch, num_rows):
    """The decode plan's `project` over a panelled q|k|v equals the module's output plus add_lora's
    torch path."""
    from inference_service.worker.lora.decode import QKV, DecodeLora

    shapes = {(layer, t): (PANEL_IN, PANEL_WIDTHS.get(t, PANEL_IN)) for layer in (0, 1) for t in TARGETS}
    plan = DecodeLora([0, 1], shapes)
    module, _, _ = _panelled(True)
    one = _panel_adapter(16, 23, [(1, t) for t in PANEL_WIDTHS])
    two = _panel_adapter(5, 24, [(1, "v_proj")])
    groups = [(one, [0])] if num_rows == 1 else [(one, [0, 2]), (two, [1])]
    x = torch.randn(num_rows, PANEL_IN)
    fast = plan.adder(_step(groups, num_rows), x)
    assert fast.native and (fast._row is not None) == (num_rows == 1)  # the fused call takes one row
    got = fast.project(module, x, 1, QKV)
    monkeypatch.setattr(native, "MAX_NATIVE_ROWS", 0)  # the torch path
    step = _step(groups, num_rows)
    with lora_context(step):
        reference = plan.adder(step, x)
        assert not reference.native
        expected = reference.project(module, x, 1, QKV)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    assert not torch.equal(got, module(x))
