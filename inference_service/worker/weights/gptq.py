"""GPTQ and AWQ checkpoints' int32-packed tensors repacked into the canonical `PackedWeight`.

Library choice (checked on this CPU-only venv, torch 2.13.0+cpu): auto-gptq and autoawq are
archived upstream, so neither is used. GPTQModel is the maintained library for both formats, but
`pip install --dry-run gptqmodel` (7.7.0) wants torch 2.14.1 with the CUDA 13 wheels, triton,
datasets and pandas: it would replace our torch, so it is used neither at runtime nor in tests. The
unpacking is therefore our own (plain torch, no loops over elements), written from the layouts in
the maintained sources:

- GPTQ, github.com/ModelCloud/GPTQModel: `gptqmodel/nn_modules/qlinear/__init__.py`
  (`GPTQQuantLinear._register_gptq_buffers` gives the shapes, `PackableQuantLinear.pack_block` and
  `.dequantize_weight` the bit order and `w = scales[g_idx] * (q - zeros[g_idx])`) and
  `gptqmodel/utils/model.py` (`convert_gptq_v1_to_v2_format_module`: the v1 zero-point offset).
- AWQ, github.com/casper-hansen/AutoAWQ (archived; read only): `awq/modules/linear/gemm.py` and
  `awq/utils/packing_utils.py` (GEMM's interleaved nibble order), `awq/modules/linear/gemv.py`
  (GEMV); GPTQModel's `gptqmodel/nn_modules/qlinear/gemm_awq.py` packs GEMM the same way.

Layouts (K = in_features, N = out_features, G = ceil(K / group_size)); every int32 word holds
`32 // bits` codes, the first in the lowest bits:
- GPTQ: qweight int32 [ceil(K·bits/32), N] packed along K; qzeros int32 [G, ceil(N·bits/32)] packed
  along N; scales fp16 [G, N]; g_idx int32 [K] (input k's group). `w[n, k] = s·(q − z)` with the
  group of k from g_idx. checkpoint_format "gptq" (v1) stores each zero minus one, applied to the
  whole word (GPTQModel's `qzeros -= 0x11111111`), "gptq_v2" stores it as is.
- AWQ GEMM: qweight int32 [K, N/8] packed along N, nibble i holding column 8c + [0,2,4,6,1,3,5,7][i];
  qzeros int32 [G, N/8] the same way; scales fp16 [G, N].
- AWQ GEMV: qweight int32 [N, K/8] packed along K in natural order; qzeros int32 [N, ≥ceil(G/8)] and
  scales fp16 [N, ≥G], both zero-padded on the right.

Zeros and scales fold into the canonical form exactly: `offsets = -z·s` is exact in fp32 (z has at
most 8 significant bits, an fp16 scale 11), so `PackedWeight.dequantize()` equals the format's
`s·(q − z)` bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference_service.errors import ModelLoadError
from inference_service.worker.kernels.packed import PackedWeight, pack_codes
from inference_service.worker.weights.int32_words import add_words, canonical_codes, check_shape, unpack_words

# AutoAWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i] of its block of 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits in nibble AWQ_REVERSE_ORDER[c]

GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm", "gemv")


def packed_from_gptq(
    qweight: Tensor,
    qzeros: Tensor | None,
    scales: Tensor,
    g_idx: Tensor | None,
    *,
    bits: int,
    group_size: int,
    sym: bool = True,
    checkpoint_format: str | None = "gptq",
) -> tuple[PackedWeight, Tensor | None]:
    """One GPTQ linear → `(PackedWeight, perm)`.

    `perm` is None unless the checkpoint was quantized with act-order (desc_act) and its g_idx is
    not `k // group_size`: then the PackedWeight's columns are the inputs in the order `perm` (an
    int64 [K]), so that `x[..., perm] @ packed.dequantize().T == x @ W.T`. g_idx None means the
    natural order. Stored zeros are used as stored, sym or not (GPTQModel's torch kernel does the
    same); a missing qzeros is only allowed for `sym` (zero = 2**(bits-1)).
    """
    _check_bits(bits, "GPTQ")
    fmt = (checkpoint_format or "gptq").lower()
    if fmt not in GPTQ_FORMATS:
        raise ModelLoadError(
            f"GPTQ checkpoint_format {checkpoint_format!r} is not supported (supported: {', '.join(GPTQ_FORMATS)})"
        )
    _check_int32("GPTQ", qweight=qweight, qzeros=qzeros)
    per_word = 32 // bits
    n = scales.shape[-1]
    k = g_idx.numel() if g_idx is not None else qweight.shape[0] * per_word
    group_size = _group_size(group_size, k, "GPTQ")
    groups = -(-k // group_size)
    check_shape("GPTQ qweight", qweight, (-(-k // per_word), n))
    check_shape("GPTQ scales", scales, (groups, n))

    if qzeros is None:
        if not sym:
            raise ModelLoadError("the asymmetric GPTQ checkpoint has no qzeros")
        zeros = torch.full((n, groups), 2 ** (bits - 1), dtype=torch.uint8)
    else:
        check_shape("GPTQ qzeros", qzeros, (groups, None))
        if qzeros.shape[1] * per_word < n:
            raise ModelLoadError(f"GPTQ qzeros {tuple(qzeros.shape)} hold fewer than the {n} zeros of a group")
        if fmt == "gptq":  # v1: undo GPTQModel's whole-word `-= 0x11..1` (carries included) with a whole-word add
            qzeros = add_words(qzeros, sum(1 << shift for shift in range(0, 32, bits)))
        zeros = unpack_words(qzeros, bits, n).T  # [N, G]

    perm = None
    natural = torch.arange(k) // group_size
    if g_idx is not None and not torch.equal(g_idx.long(), natural):
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], natural):
            raise ModelLoadError(
                f"GPTQ g_idx does not give each group exactly {group_size} inputs: "
                "not an act-order permutation of the groups"
            )

    words = qweight.T.contiguous()  # [N, ceil(K·bits/32)]: each row's codes along K, as ours
    # Natural order: the words' bytes are the canonical codes; act-order: unpack, permute K, repack.
    codes = canonical_codes(words, bits, k) if perm is None else pack_codes(unpack_words(words, bits, k)[:, perm], bits)
    scales = scales.T.float().contiguous()  # [N, G]
    offsets = -(zeros.float() * scales)
    return PackedWeight(
        bits=bits, codes=codes, scales=scales, offsets=offsets.contiguous(), group_size=group_size, in_features=k
    ), perm


def packed_from_awq(
    qweight: Tensor, qzeros: Tensor | None, scales: Tensor, *, bits: int = 4, group_size: int, version: str = "gemm"
) -> PackedWeight:
    """One AWQ linear (GEMM layout, or GEMV) → PackedWeight; `w = s·(q − z)`.

    AWQ stores qzeros even when `zero_point` is false; a missing qzeros means zero = 8.
    """
    if bits != 4:
        raise ModelLoadError(f"AWQ {bits}-bit weights are not supported (AWQ checkpoints are 4-bit)")
    version = (version or "gemm").lower()
    if version not in AWQ_VERSIONS:
        raise ModelLoadError(
            f"AWQ version {version!r} (its on-disk layout) is not supported (supported: {', '.join(AWQ_VERSIONS)})"
        )
    _check_int32("AWQ", qweight=qweight, qzeros=qzeros)
    if version == "gemm":
        k, n = qweight.shape[0], qweight.shape[1] * 8
        group_size = _group_size(group_size, k, "AWQ")
        groups = -(-k // group_size)
        check_shape("AWQ qweight", qweight, (k, n // 8))
        check_shape("AWQ scales", scales, (groups, n))
        codes = pack_codes(_awq_columns(unpack_words(qweight, 4, n)).T, 4)  # [K, N] → [N, K]
        if qzeros is None:
            zeros = torch.full((n, groups), 8, dtype=torch.uint8)
        else:
            check_shape("AWQ qzeros", qzeros, (groups, n // 8))
            zeros = _awq_columns(unpack_words(qzeros, 4, n)).T  # [N, G]
        scales = scales.T.float().contiguous()  # [N, G]
    else:  # gemv: already along K per output row, zeros and scales padded per row
        n, k = qweight.shape[0], qweight.shape[1] * 8
        group_size = _group_size(group_size, k, "AWQ")
        groups = -(-k // group_size)
        check_shape("AWQ GEMV scales", scales, (n, None))
        if scales.shape[1] < groups:
            raise ModelLoadError(f"AWQ GEMV scales {tuple(scales.shape)} hold fewer than {groups} groups")
        codes = canonical_codes(qweight, 4, k)
        if qzeros is None:
            zeros = torch.full((n, groups), 8, dtype=torch.uint8)
        else:
            check_shape("AWQ GEMV qzeros", qzeros, (n, None))
            if qzeros.shape[1] * 8 < groups:
                raise ModelLoadError(f"AWQ GEMV qzeros {tuple(qzeros.shape)} hold fewer than {groups} groups")
            zeros = unpack_words(qzeros, 4, groups)  # [N, G]
        scales = scales[:, :groups].float().contiguous()
    offsets = -(zeros.float() * scales)
    return PackedWeight(
        bits=4, codes=codes, scales=scales, offsets=offsets.contiguous(), group_size=group_size, in_features=k
    )


# -- helpers ------------------------------------------------------------------------------------------
def _check_bits(bits: int, what: str) -> None:
    if bits not in (4, 8):
        raise ModelLoadError(f"{what} {bits}-bit weights are not supported (supported: 4, 8)")


def _check_int32(what: str, **tensors: Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.dtype != torch.int32:
            raise ModelLoadError(f"{what} {name} is {tensor.dtype}; only int32 packing is supported")


def _group_size(group_size: int, k: int, what: str) -> int:
    if group_size == -1:
        return k  # one group per row
    if group_size <= 0:
        raise ModelLoadError(f"{what} group_size {group_size} is invalid (a positive size, or -1)")
    return group_size


def _awq_columns(unpacked: Tensor) -> Tensor:
    """[..., N] codes in AWQ's nibble order → natural column order."""
    blocks = unpacked.view(*unpacked.shape[:-1], -1, 8)
    return blocks[..., list(AWQ_REVERSE_ORDER)].flatten(-2)
