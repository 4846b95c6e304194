"""A bfloat16 decode step's decoder layers as one native call (kernels/bf16_layers.py), for the plan
in runner/decode_step.py.

Op by op, each layer of a bf16 step costs four projections, four glue calls and the attention, each
through Python, ctypes and fresh tensors: at one stream of the demo model about as long as the
layer's weights take to stream once they are bf16. The fused call runs the same kernels in the same
order, so its output is bitwise the op-by-op plan's. It takes a step only when every piece of it is
the plain one: the layers' projections still the BF16NativeLinear modules the plan fused (LoRA
replaces them), a bf16 paged cache read by the native attention, and few enough rows for the bf16
linear kernel; anything else runs op by op.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from inference_service.worker.attention.step_metadata import StepMetadata
from inference_service.worker.kernels.bf16_layers import FIELDS, BF16Layers, load_bf16_layers
from inference_service.worker.kernels.bindings import MAX_BF16_LINEAR_ROWS
from inference_service.worker.linears.bf16 import BF16NativeLinear
from inference_service.worker.runner.fused_layers import int64, projections, same_shapes

# decode_step._Layer (not imported: decode_step imports this module)
_Layer = Any

_COLUMN = {name: index for index, name in enumerate(FIELDS)}


class FusedBF16Layers:
    """`takes(meta, hidden)`, then `run(meta, hidden, cos, sin)`: every layer, hidden updated in place."""

    def __init__(self, layers: list[_Layer], kernel: BF16Layers):
        first = layers[0]
        self.kernel = kernel
        self.layers = layers
        self.modules = [projections(layer) for layer in layers]
        linears = [cast(tuple[BF16NativeLinear, ...], modules) for modules in self.modules]  # _fusable checked
        self.shape = (first.num_heads, first.num_kv_heads, first.head_dim, linears[0][3].in_features)
        self.norm_eps = first.input_norm.eps
        self.qk_eps = first.q_norm.eps if first.q_norm is not None else 0.0
        self.scale = first.scaling
        self.table = torch.zeros(len(layers), len(FIELDS), dtype=torch.int64)
        for row, layer, modules in zip(self.table, layers, linears, strict=True):
            pointers: dict[str, torch.Tensor | None] = {
                "input_norm": layer.input_norm.weight,
                "post_norm": layer.post_norm.weight,
                "q_norm": layer.q_norm.weight if layer.q_norm is not None else None,
                "k_norm": layer.k_norm.weight if layer.k_norm is not None else None,
            }
            for name, module in zip(("qkv", "o", "gate_up", "down"), modules, strict=True):
                pointers[name], pointers[f"{name}_bias"] = module.weight, module.bias
            for name, tensor in pointers.items():
                row[_COLUMN[name]] = tensor.data_ptr() if tensor is not None else 0
            row[_COLUMN["window"]] = layer.window or 0
        self.weight_bytes = sum(m.weight.numel() * m.weight.element_size() for ms in linears for m in ms)
        self._cache_of_table: tuple[object, int] | None = None  # the KV cache whose pointers the table holds

    def takes(self, meta: StepMetadata, hidden: torch.Tensor) -> bool:
        cache = meta.kv_cache
        return (
            cache is not None
            and cache.kv_dtype == torch.bfloat16
            and meta.decode_kernel is not None
            and meta.decode_block_table is not None
            and meta.decode_context_lens is not None
            and hidden.dtype == torch.bfloat16
            and hidden.device.type == "cpu"
            and 0 < hidden.shape[0] <= MAX_BF16_LINEAR_ROWS
            and all(projections(layer) == modules for layer, modules in zip(self.layers, self.modules, strict=True))
        )

    def run(self, meta: StepMetadata, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [S, D] bf16 → the residual stream after every layer (the last MLP's output added)."""
        cache = meta.kv_cache
        assert cache is not None and meta.decode_block_table is not None and meta.decode_context_lens is not None
        stored = (cache, cache.keys[0].data_ptr())  # the cache's tensors are allocated once, with it
        if self._cache_of_table != stored:
            for row, layer in zip(self.table, self.layers, strict=True):
                keys, values = cache.layer(layer.index)
                row[_COLUMN["key_cache"]], row[_COLUMN["value_cache"]] = keys.data_ptr(), values.data_ptr()
            self._cache_of_table = stored
        hidden = hidden.contiguous()
        self.kernel.run(
            self.table,
            hidden,
            cos.to(torch.bfloat16).contiguous(),
            sin.to(torch.bfloat16).contiguous(),
            int64(meta.slot_mapping),
            int64(meta.decode_block_table),
            int64(meta.decode_context_lens),
            cache.block_size,
            self.shape,
            self.norm_eps,
            self.qk_eps,
            self.scale,
        )
        return hidden


def fused_bf16_layers_for(layers: list[_Layer]) -> FusedBF16Layers | None:
    """The fused call for these layers if it can run them (plain bf16 projections on CPU, one shape and
    eps throughout, Q and K norms both or neither) and the kernels build; None: op by op."""
    if not layers or not all(_fusable(layer, layers[0]) for layer in layers):
        return None
    kernel = load_bf16_layers()
    return FusedBF16Layers(layers, kernel) if kernel is not None else None


def _fusable(layer: _Layer, first: _Layer) -> bool:
    if not all(type(m) is BF16NativeLinear for m in projections(layer)):
        return False
    qkv = cast(BF16NativeLinear, layer.qkv)
    norms = [layer.input_norm, layer.post_norm] + [n for n in (layer.q_norm, layer.k_norm) if n is not None]
    return (
        qkv.weight.device.type == "cpu"
        and all(n.weight.dtype == torch.bfloat16 and n.weight.is_contiguous() for n in norms)
        and same_shapes(layer, first)
    )
