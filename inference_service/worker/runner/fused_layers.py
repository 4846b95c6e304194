"""An fp32 decode step's decoder layers as one native call (kernels/decode_layers.py), for the plan in
runner/decode_step.py, with the step's LoRA updates inside it.

Op by op, each layer costs four projections, three glue calls, the attention (and for a cache of
another dtype the K/V conversion), each through Python, ctypes and fresh tensors: ~2.7 ms of a
one-stream demo-model token on this 2-core CPU, which no thread splits. The fused call runs the same C
entry points in the same order, so its output is bitwise the op-by-op plan's. It takes a step when
every piece of it is one it knows: the layers' projections still the modules it read (fp32 panels,
or packed 4/8-bit codes computed natively), the native attention over a cache it can write (fp32, or
another dtype through the cache's native writer), and with adapter rows the LoRA kernel's plan for
the step; anything else runs op by op. The bf16 counterpart is runner/bf16_layers.py.

Measured with benchmarks/fused_layers.py on the busy 2-core machine (fused ÷ op by op, median decode
step, the same engine): one demo-model stream, fp16 KV, context 128, 2 threads: fp32 25.7 → 20.3 ms
(0.79x), GGUF Q4_1 11.3 → 7.9 ms (0.70x); with the mode flipping every step, 1 thread (2 threads
were swamped by the machine's other work): fp32 0.83x, Q4_1 0.79x, 16 streams over 4 rank-16
adapters 0.90x, the same 16 streams without adapters 0.80x.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from inference_service.worker.attention.step_metadata import StepMetadata
from inference_service.worker.kernels.bindings import KV_DTYPE_CODES, MAX_GROUPS, MAX_PANEL_K
from inference_service.worker.kernels.decode_layers import (
    CODE_PANELS,
    FIELDS,
    LORA_FIELDS,
    PACKED,
    PANELS,
    PROJECTIONS,
    FP32Layers,
    load_fp32_layers,
)
from inference_service.worker.kernels.native_build import native_address
from inference_service.worker.linears.panelled import PanelledLinear
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.lora.decode import StepAdder

# decode_step._Layer (not imported: decode_step imports this module)
_Layer = Any

_COLUMN = {name: index for index, name in enumerate(FIELDS)}
# The most rows a fused step takes: every kernel it calls takes any count, and a decode step's rows
# are its streams; this bounds the scratch the call allocates.
MAX_FUSED_ROWS = 1024


class FusedLayers:
    """`takes(meta, hidden)`, then `run(meta, hidden, cos, sin, lora)`: every layer, hidden updated in
    place, with a step's LoRA updates where `takes_lora(adder)`."""

    def __init__(self, layers: list[_Layer], kernel: FP32Layers):
        first = layers[0]
        self.kernel = kernel
        self.layers = layers
        self.modules = [projections(layer) for layer in layers]
        self.shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.down.in_features)
        self.eps = (first.input_norm.eps, first.q_norm.eps if first.q_norm is not None else 0.0)
        self.scale = first.scaling
        self.table = torch.zeros(len(layers), len(FIELDS), dtype=torch.int64)
        for row, layer, modules in zip(self.table, layers, self.modules, strict=True):
            for name, norm in (
                ("input_norm", layer.input_norm),
                ("post_norm", layer.post_norm),
                ("q_norm", layer.q_norm),
                ("k_norm", layer.k_norm),
            ):
                row[_COLUMN[name]] = norm.weight.data_ptr() if norm is not None else 0
            row[_COLUMN["window"]] = layer.window or 0
            for name, module in zip(PROJECTIONS, modules, strict=True):
                for field, value in _projection_words(cast(PanelledLinear | QuantLinear, module)).items():
                    row[_COLUMN[f"{name}.{field}"]] = value
        # The few-rows calls whose tensors (int8-activation kernels: fp16 copies of the factors) the table
        # points into: kept alive here should a module re-resolve its kernels.
        self._kept = [m.native_calls()[1] for modules in self.modules for m in modules if isinstance(m, QuantLinear)]
        self.weight_bytes = sum(_weight_bytes(m) for modules in self.modules for m in modules)
        self._cache_of_table: tuple[object, int] | None = None  # the KV cache whose pointers the table holds
        self._lora_of_table: object = None  # the LoRA sites whose parts the table holds

    def takes(self, meta: StepMetadata, hidden: torch.Tensor) -> bool:
        cache = meta.kv_cache
        return (
            cache is not None
            and (cache.kv_dtype == torch.float32 or (cache.writer is not None and cache.kv_dtype in KV_DTYPE_CODES))
            and meta.decode_kernel is not None
            and meta.decode_block_table is not None
            and meta.decode_context_lens is not None
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            and 0 < hidden.shape[0] <= MAX_FUSED_ROWS
            and all(projections(layer) == modules for layer, modules in zip(self.layers, self.modules, strict=True))
        )

    @staticmethod
    def takes_lora(adder: StepAdder) -> bool:
        """Whether the step's LoRA updates can run inside the call: the native kernel's plan."""
        return adder.plan is not None

    def run(
        self,
        meta: StepMetadata,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: StepAdder | None = None,
    ) -> torch.Tensor:
        """hidden [S, D] fp32 → the residual stream after every layer (the last MLP's output added)."""
        cache = meta.kv_cache
        assert cache is not None and meta.decode_block_table is not None and meta.decode_context_lens is not None
        stored = (cache, cache.keys[0].data_ptr())  # the cache's tensors are allocated once, with it
        if self._cache_of_table != stored:
            for row, layer in zip(self.table, self.layers, strict=True):
                keys, values = cache.layer(layer.index)
                scales = cache.scales(layer.index)
                row[_COLUMN["key_cache"]], row[_COLUMN["value_cache"]] = keys.data_ptr(), values.data_ptr()
                row[_COLUMN["key_scales"]] = scales[0].data_ptr() if scales is not None else 0
                row[_COLUMN["value_scales"]] = scales[1].data_ptr() if scales is not None else 0
            self._cache_of_table = stored
        hidden = hidden.contiguous()
        self.kernel.run(
            self.table,
            hidden,
            cos.to(torch.float32).contiguous(),
            sin.to(torch.float32).contiguous(),
            int64(meta.slot_mapping),
            int64(meta.decode_block_table),
            int64(meta.decode_context_lens),
            cache.block_size,
            self.shape,
            KV_DTYPE_CODES[cache.kv_dtype],
            self.eps,
            self.scale,
            self._lora_words(lora) if lora is not None else None,
        )
        return hidden

    def _lora_words(self, adder: StepAdder) -> torch.Tensor:
        """The step's plan as the call reads it (its projections' parts written into the table once)."""
        plan = adder.plan
        assert plan is not None
        if self._lora_of_table is not adder.layers:
            for row, sites in zip(self.table, adder.layers, strict=True):
                for name, site in zip(PROJECTIONS, sites, strict=True):
                    row[_COLUMN[f"{name}.lora_parts"]] = site.native.address
                    row[_COLUMN[f"{name}.lora_count"]] = site.native.count
            self._lora_of_table = adder.layers
        single = plan.single
        words = {
            "single": int(single is not None),
            "table": single.data_ptr() if single is not None else 0,
            "table_len": single.shape[0] if single is not None else 0,
            "rows": plan.rows.data_ptr() if plan.rows is not None else 0,
            "groups": plan.groups.data_ptr(),
            "num_groups": plan.groups.shape[0],
            "max_rank": plan.max_rank,
        }
        words |= dict(zip(("sgmv", "bgmv", "panel_row"), plan.kernel.addresses, strict=True))
        return torch.tensor([words[name] for name in LORA_FIELDS], dtype=torch.int64)


def _projection_words(module: PanelledLinear | QuantLinear) -> dict[str, int]:
    """A projection's words in the table (its kind's kernel and weights), as forward would call them."""
    bias = module.bias
    words = {"bias": bias.data_ptr() if bias is not None else 0, "k": module.in_features}
    if isinstance(module, PanelledLinear):
        return words | {"kind": PANELS, "weight": module.weight_panels.data_ptr(), "n": module.out_features}
    words |= {"n": module.out_features, "bits": module.bits, "group_size": module.group_size}
    _, few_rows = module.native_calls()
    if few_rows is None:  # 8-bit codes in panels
        words |= {"kind": CODE_PANELS, "weight": module.codes.data_ptr()}
        return words | {"scales": module.scales.data_ptr(), "offsets": module.offsets.data_ptr()}
    codes, scales, offsets, _ = few_rows.pointers
    words |= {"kind": PACKED, "few_rows": native_address(few_rows.fn), "weight": codes}
    words |= {"scales": scales, "offsets": offsets, "max_rows": few_rows.max_elements // module.in_features}
    return words | {"wide_scales": module.scales.data_ptr(), "wide_offsets": module.offsets.data_ptr()}


def _weight_bytes(module: torch.nn.Module) -> int:
    """The bytes of weights a step streams through the projection."""
    return sum(t.numel() * t.element_size() for t in module.buffers() if t is not module.bias)


def int64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.int64 and tensor.is_contiguous() else tensor.to(torch.int64).contiguous()


def fused_layers_for(layers: list[_Layer]) -> FusedLayers | None:
    """The fused call for these layers if it can run them (projections it computes natively, one shape
    and eps throughout, Q and K norms both or neither) and the kernels build; None: op by op."""
    if not layers or not all(_fusable(layer) and same_shapes(layer, layers[0]) for layer in layers):
        return None
    kernel = load_fp32_layers()
    return FusedLayers(layers, kernel) if kernel is not None else None


def projections(layer: _Layer) -> tuple[torch.nn.Module, ...]:
    return layer.qkv, layer.o_proj, layer.gate_up, layer.down


def _fusable(layer: _Layer) -> bool:
    norms = [layer.input_norm, layer.post_norm] + [n for n in (layer.q_norm, layer.k_norm) if n is not None]
    return all(_native(m) for m in projections(layer)) and all(
        n.weight.dtype == torch.float32 and n.weight.device.type == "cpu" and n.weight.is_contiguous() for n in norms
    )


def _native(module: torch.nn.Module) -> bool:
    """Whether forward computes the module's fp32 CPU rows by a kernel the fused call calls."""
    if not isinstance(module, PanelledLinear | QuantLinear):
        return False
    bias = module.bias
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return False
    if type(module) is PanelledLinear:
        panels = module.weight_panels
        return module.kernel is not None and panels.dtype == torch.float32 and panels.is_contiguous()
    if type(module) is not QuantLinear or module.input_perm is not None or module.codes.device.type != "cpu":
        return False
    panel, few_rows = module.native_calls()
    return panel and (module.panelled or (few_rows is not None and module.in_features <= MAX_PANEL_K))


def same_shapes(layer: _Layer, first: _Layer) -> bool:
    """The shapes and eps a fused call takes once for all layers: the same in every layer, Q and K norms
    both or neither, heads the attention kernel takes."""
    qkv, o, gate_up, down = layer.qkv, layer.o_proj, layer.gate_up, layer.down
    qk_eps = {n.eps for n in (layer.q_norm, layer.k_norm, first.q_norm, first.k_norm) if n is not None}
    return (
        (layer.q_norm is None) == (layer.k_norm is None) == (first.q_norm is None)
        and len(qk_eps) <= 1
        and layer.num_heads % layer.num_kv_heads == 0
        and layer.num_heads // layer.num_kv_heads <= MAX_GROUPS
        and (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling)
        == (first.num_heads, first.num_kv_heads, first.head_dim, first.scaling)
        and o.in_features == layer.num_heads * layer.head_dim
        and qkv.out_features == (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim
        and gate_up.out_features == 2 * down.in_features == 2 * first.down.in_features
        and layer.input_norm.eps == layer.post_norm.eps == first.input_norm.eps
        and layer.head_dim % 8 == 0
    )
