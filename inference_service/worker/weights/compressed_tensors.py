"""compressed-tensors checkpoints (llm-compressor's output) repacked into the canonical `PackedWeight`.

Library choice: the `compressed-tensors` package (github.com/vllm-project/compressed-tensors, the
maintained format library) is pure Python and `pip install --dry-run compressed-tensors` (0.20.0)
adds only loguru and psutil next to our torch 2.13.0+cpu, so it installs cleanly. It is still not a
runtime dependency: its decompressors give a dense weight (we keep the packed codes), its
`unpack_from_int32` gives int8 codes we would only repack, while the packed words' bytes already
are our 4-bit layout (a view, see `int32_words`). The tests (dev extra) use it as the reference:
`pack_to_int32`/`unpack_from_int32`, `PackedQuantizationCompressor.decompress`, its config models, and
transformers' own compressed-tensors loading of a written checkpoint.

Formats read (from `compressed_tensors/compressors/pack_quantized/` and `naive_quantized/`):
- `pack-quantized` (int 4/8-bit weights): `weight_packed` int32 [N, ceil(K·bits/32)], the signed code
  q + 2**(bits-1) packed along K lowest bits first; `weight_scale` [N, G] (group), [N, 1] (channel)
  or [1] (tensor); asymmetric group/channel: `weight_zero_point` int32 [ceil(N·bits/32), G], the
  signed zero point + 2**(bits-1) packed along N (older checkpoints: int8 [N, G] unpacked);
  `weight_shape` [2] = (N, K). `w = s·(q − zp)`.
- `int-quantized` / `naive-quantized`: `weight` int8 [N, K] holding q, `weight_scale` as above,
  `weight_zero_point` int8 unpacked when asymmetric.

Everything else (float weights: fp8 float-quantized, nvfp4/mxfp; 2:4 sparsity; block or
tensor_group strategies; act-order `group` with a permuted `weight_g_idx`, which compressed-tensors
0.20 itself no longer accepts; transforms; quantized activations or KV cache unless the caller
serves the weights alone) is a `ModelLoadError` naming the variant.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from inference_service.errors import ModelLoadError
from inference_service.worker.kernels.packed import PackedWeight, pack_codes
from inference_service.worker.weights.int32_words import canonical_codes, check_shape, unpack_words

READ_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_STRATEGIES = ("group", "channel", "tensor")
# Formats we name in errors; any other unknown format gets the generic message.
_UNSUPPORTED_FORMATS = {
    "float-quantized": "fp8 weights (float-quantized)",
    "nvfp4-pack-quantized": "NVFP4 weights (nvfp4-pack-quantized)",
    "mxfp4-pack-quantized": "MXFP4 weights (mxfp4-pack-quantized)",
    "mxfp6-pack-quantized": "MXFP6 weights (mxfp6-pack-quantized)",
    "mxfp8-quantized": "MXFP8 weights (mxfp8-quantized)",
    "marlin-24": "2:4 sparse weights (marlin-24)",
    "sparse-24-bitmask": "2:4 sparse weights (sparse-24-bitmask)",
    "sparse-bitmask": "sparse weights (sparse-bitmask)",
    "dense": "uncompressed weights with quantization parameters (dense)",
}


def validate_compressed_tensors_config(quantization_config: Mapping[str, Any], *, weights_only: bool = False) -> None:
    """The checkpoint-wide checks (`config.json`'s `quantization_config`): a `ModelLoadError` naming what
    this server can't serve. `weights_only` accepts a quantized KV cache (served in full precision)."""
    status = quantization_config.get("quantization_status")
    if status not in (None, "compressed", "frozen"):
        raise ModelLoadError(f"the compressed-tensors checkpoint is not finished (quantization_status {status!r})")
    sparsity = quantization_config.get("sparsity_config") or {}
    sparse_format = sparsity.get("format")
    if sparse_format not in (None, "dense"):
        raise ModelLoadError(f"compressed-tensors sparsity ({sparse_format}, e.g. 2:4) is not supported")
    if quantization_config.get("transform_config"):
        raise ModelLoadError("compressed-tensors transforms (rotations, transform_config) are not supported")
    if quantization_config.get("kv_cache_scheme") and not weights_only:
        raise ModelLoadError("compressed-tensors KV-cache quantization (kv_cache_scheme) is not supported")
    fmt = quantization_config.get("format")
    if fmt in _UNSUPPORTED_FORMATS:
        raise ModelLoadError(f"compressed-tensors {_UNSUPPORTED_FORMATS[fmt]} are not supported")


def scheme_for_module(
    quantization_config: Mapping[str, Any], module_name: str, class_names: tuple[str, ...] = ("Linear",)
) -> dict[str, Any] | None:
    """The config group scheme that quantizes `module_name` (matched as compressed-tensors matches:
    a target is a class name, an exact module name, or `re:<regex>` matched from the start), with its
    effective `format` filled in; None when the module is ignored or no group targets it."""

    def matches(target: str) -> bool:
        if target.startswith("re:"):
            return re.match(target[3:], module_name) is not None
        return target == module_name or target in class_names

    if any(matches(target) for target in quantization_config.get("ignore") or ()):
        return None
    for scheme in (quantization_config.get("config_groups") or {}).values():
        if isinstance(scheme, Mapping) and any(matches(target) for target in scheme.get("targets") or ()):
            return {**scheme, "format": scheme.get("format") or quantization_config.get("format")}
    return None


def packed_from_compressed_tensors(
    tensors: Mapping[str, Tensor],
    scheme: Mapping[str, Any] | Any,
    *,
    format: str | None = None,
    weights_only: bool = False,
) -> PackedWeight:
    """One module's tensors (local names: `weight_packed`, `weight_scale`, ...) → PackedWeight.

    `scheme` is the module's config group (a dict as in `config_groups`, or compressed-tensors'
    `QuantizationScheme`); its `format` wins over `format` (the checkpoint-wide one).
    `weights_only=True` serves a scheme that also quantizes activations (W8A8) with full-precision
    activations; otherwise that is a `ModelLoadError`.
    """
    if hasattr(scheme, "model_dump"):
        scheme = scheme.model_dump()
    fmt = scheme.get("format") or format
    if fmt in _UNSUPPORTED_FORMATS:
        raise ModelLoadError(f"compressed-tensors {_UNSUPPORTED_FORMATS[fmt]} are not supported")
    if fmt not in READ_FORMATS:
        raise ModelLoadError(
            f"compressed-tensors format {fmt!r} is not supported (supported: {', '.join(READ_FORMATS)})"
        )
    args = scheme.get("weights")
    if not args:
        raise ModelLoadError("the compressed-tensors scheme does not quantize weights")
    for side in ("input_activations", "output_activations"):
        act = scheme.get(side)
        if act and not weights_only:
            raise ModelLoadError(
                f"compressed-tensors activation quantization ({side}: {act.get('type', 'int')} "
                f"{act.get('num_bits')}-bit, {act.get('strategy')}"
                f"{', dynamic' if act.get('dynamic') else ''}) is not supported"
            )
    bits, strategy, group_size = _weight_args(args)

    scale = _need(tensors, "weight_scale")
    zero_point = tensors.get("weight_zero_point")
    if fmt == "pack-quantized":
        packed = _need(tensors, "weight_packed")
        if packed.dtype != torch.int32:
            raise ModelLoadError(f"compressed-tensors weight_packed is {packed.dtype}, expected int32")
        n, k = (int(v) for v in _need(tensors, "weight_shape").flatten().tolist())
        check_shape("compressed-tensors weight_packed", packed, (n, -(-k * bits // 32)))
        codes = canonical_codes(packed, bits, k)  # stored as q + 2**(bits-1): our unsigned codes
    else:
        weight = _need(tensors, "weight")
        if weight.dtype != torch.int8:
            raise ModelLoadError(f"compressed-tensors {fmt} weight is {weight.dtype}, expected int8")
        n, k = weight.shape
        codes = pack_codes((weight.to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8), bits)

    if _g_idx_is_permuted(tensors.get("weight_g_idx"), group_size, k):
        raise ModelLoadError("compressed-tensors act-order 'group' (a permuted weight_g_idx) is not supported")
    group_size = k if strategy != "group" else group_size
    groups = -(-k // group_size)
    scales = _per_group("weight_scale", scale, n, groups).float()
    centre = 2 ** (bits - 1)
    if zero_point is None:  # symmetric: zp = 0
        if not args.get("symmetric", True):
            raise ModelLoadError("the asymmetric compressed-tensors weight has no weight_zero_point")
        zeros = torch.full((n, groups), float(centre))
    elif zero_point.dtype == torch.int32 and fmt == "pack-quantized" and strategy != "tensor":
        check_shape("compressed-tensors weight_zero_point", zero_point, (-(-n * bits // 32), groups))
        zeros = unpack_words(zero_point.T, bits, n).T.float()  # packed along N, stored as zp + 2**(bits-1)
    else:  # unpacked signed zero points
        zeros = _per_group("weight_zero_point", zero_point, n, groups).float() + centre
    return PackedWeight(
        bits=bits,
        codes=codes,
        scales=scales.contiguous(),
        offsets=(-(zeros * scales)).contiguous(),
        group_size=group_size,
        in_features=k,
    )


def _weight_args(args: Mapping[str, Any]) -> tuple[int, str, int]:
    """(bits, strategy, group_size) of a weights `QuantizationArgs`, or the error naming why not."""
    kind = args.get("type", "int")
    bits = int(args.get("num_bits", 8))
    if kind != "int":
        raise ModelLoadError(f"compressed-tensors {kind} {bits}-bit weights are not supported (int weights are)")
    if bits not in (4, 8):
        raise ModelLoadError(f"compressed-tensors int{bits} weights are not supported (supported: int4, int8)")
    if args.get("dynamic"):
        raise ModelLoadError("compressed-tensors dynamic weight quantization is not supported")
    group_size = args.get("group_size")
    strategy = args.get("strategy")
    if strategy is None:  # as compressed-tensors infers it
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    if strategy not in _STRATEGIES:
        raise ModelLoadError(
            f"compressed-tensors {strategy!r} weight strategy is not supported (supported: {', '.join(_STRATEGIES)})"
        )
    if strategy == "group" and (group_size is None or group_size <= 0):
        raise ModelLoadError(f"compressed-tensors group strategy needs a positive group_size, not {group_size}")
    if args.get("actorder") in ("group", "dynamic"):
        raise ModelLoadError(f"compressed-tensors act-order {args['actorder']!r} (weight_g_idx) is not supported")
    return bits, strategy, int(group_size or 0)


def _need(tensors: Mapping[str, Tensor], name: str) -> Tensor:
    if name not in tensors:
        raise ModelLoadError(f"the compressed-tensors module has no {name} (it has {', '.join(sorted(tensors))})")
    return tensors[name]


def _per_group(name: str, tensor: Tensor, n: int, groups: int) -> Tensor:
    """A scale or zero-point tensor → [N, G]; per-tensor [1] (or a scalar) broadcast to every row."""
    if tensor.numel() == 1:
        return tensor.reshape(1, 1).expand(n, groups)
    check_shape(f"compressed-tensors {name}", tensor, (n, groups))
    return tensor


def _g_idx_is_permuted(g_idx: Tensor | None, group_size: int, k: int) -> bool:
    if g_idx is None or group_size <= 0:
        return False
    return not torch.equal(g_idx.long(), torch.arange(k) // group_size)
