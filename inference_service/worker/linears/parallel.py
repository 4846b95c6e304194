"""Tensor-parallel layers: each shard holds a slice of a weight, and a collective joins the slices.

- Column-parallel projections (q/k/v, gate/up) need no module of their own: a shard's slice of
  output rows is an ordinary `nn.Linear` (`column_slice`), so the native kernels and the decode
  plan's fusing take it like any other.
- `RowParallelLinear` (o, down): a slice of input columns, partial sums added over the shards.
- `VocabParallelEmbedding` and `VocabParallelHead`: a slice of the vocabulary each; the embedding
  sums (one shard holds each token's row, the others add zeros: exact), the head gathers the
  logits on shard 0, the one that samples.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from inference_service.worker.kernels.packed import PackedWeight
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.shard_group import ShardGroup


class ShardingRefused(ValueError):
    """A weight can't be cut into this many shards; the message says why."""


def column_slice(linear: torch.nn.Module, rows: torch.Tensor) -> torch.nn.Module:
    """A module computing output `rows` (int64 indices) of `linear` (an nn.Linear or a QuantLinear,
    whose codes, scales and offsets are cut by output row: exact for every scheme)."""
    if isinstance(linear, QuantLinear):
        bias = linear.bias[rows].contiguous() if linear.bias is not None else None
        return QuantLinear(packed_rows(linear.packed, rows), bias, linear.input_perm)
    if type(linear) is not torch.nn.Linear:
        raise _not_cut(linear)
    weight = linear.weight.detach()[rows]  # [n, K]
    sliced = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None, device=weight.device)
    sliced.to(weight.dtype)
    sliced.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    if linear.bias is not None:
        sliced.bias = torch.nn.Parameter(linear.bias.detach()[rows].contiguous(), requires_grad=False)
    return sliced


class RowParallelLinear(torch.nn.Module):
    """y = Σ_shards x[..., cols_s] · W[:, cols_s]ᵀ + bias: this shard's input columns in `inner`
    (an nn.Linear without bias, which the native kernels may replace), the bias added once after the sum."""

    bias: torch.Tensor | None

    def __init__(self, inner: torch.nn.Module, bias: torch.Tensor | None, in_features: int, group: ShardGroup):
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias)
        self.in_features = in_features  # the whole layer's, for code that reads it
        self.out_features = cast(int, inner.out_features)
        self.group = group

    @classmethod
    def from_linear(cls, linear: torch.nn.Module, columns: torch.Tensor, group: ShardGroup) -> RowParallelLinear:
        """`columns`: a contiguous run of input indices."""
        if isinstance(linear, QuantLinear):
            if linear.input_perm is not None:
                raise ShardingRefused("GPTQ act-order (desc_act) weights can't be cut by input columns")
            start, end = int(columns[0]), int(columns[-1]) + 1
            quant = QuantLinear(packed_columns(linear.packed, start, end))
            bias = linear.bias.clone() if linear.bias is not None else None
            return cls(quant, bias, linear.in_features, group)
        if type(linear) is not torch.nn.Linear:
            raise _not_cut(linear)
        weight = linear.weight.detach()[:, columns].contiguous()  # [N, k]
        inner = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        inner.to(weight.dtype)
        inner.weight = torch.nn.Parameter(weight, requires_grad=False)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(inner, bias, linear.in_features, group)

    @property
    def weight(self) -> torch.Tensor | None:
        """This shard's columns, for code that reads a projection's dtype (T5's MLP); None when
        the inner module keeps no plain weight."""
        weight = getattr(self.inner, "weight", None)
        return weight if isinstance(weight, torch.Tensor) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.inner(x).contiguous())
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """The rows of tokens [start, start + num_local) of an embedding; others contribute zeros."""

    def __init__(
        self,
        weight: torch.Tensor,
        start: int,
        num_embeddings: int,
        group: ShardGroup,
        scale: torch.Tensor | float | None = None,
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)  # [per_shard, D], zero-padded
        self.start = start
        self.num_embeddings = num_embeddings  # the whole vocabulary's
        self.embedding_dim = weight.shape[1]
        self.group = group
        # Gemma's and BART's embeddings are scaled by √D (transformers' ScaledWordEmbedding): a tensor or a float
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # [..., D]
        rows = self.group.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
        if self.scale is None:
            return rows
        return rows * (self.scale.to(rows.dtype) if isinstance(self.scale, torch.Tensor) else self.scale)


class VocabParallelHead(torch.nn.Module):
    """Logits of this shard's vocabulary slice (`inner`, an nn.Linear the native kernels may
    replace), gathered on shard 0 into the whole vocabulary; other shards return their slice, or with
    `full_width` zeros of the whole vocabulary's width (a broadcast view: no memory), where the model
    adds a full-width tensor to the logits (BART's final_logits_bias)."""

    def __init__(self, inner: torch.nn.Module, out_features: int, group: ShardGroup, full_width: bool = False):
        super().__init__()
        self.inner = inner
        self.out_features = out_features  # the whole vocabulary's (the sampler's width)
        self.in_features = cast(int, inner.in_features)
        self.group = group
        self.full_width = full_width

    @property
    def weight(self) -> torch.Tensor:
        """This shard's rows (zero-padded), for code that inspects the head."""
        return cast(torch.Tensor, self.inner.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden)  # [..., per_shard]
        parts = self.group.gather_to_first(local)
        if not parts:
            return local.new_zeros(()).expand(*local.shape[:-1], self.out_features) if self.full_width else local
        return torch.cat(parts, dim=-1)[..., : self.out_features]


def _not_cut(module: torch.nn.Module) -> ShardingRefused:
    return ShardingRefused(f"tensor parallelism cuts nn.Linear and quantized projections, not {type(module).__name__}")


def packed_rows(packed: PackedWeight, rows: torch.Tensor) -> PackedWeight:
    """Output `rows` of a packed weight: every row keeps its codes and its groups' scales and offsets."""
    return PackedWeight(
        packed.bits,
        packed.codes[rows].contiguous(),
        packed.scales[rows].contiguous(),
        packed.offsets[rows].contiguous(),
        packed.group_size,
        packed.in_features,
    )


def packed_columns(packed: PackedWeight, start: int, end: int) -> PackedWeight:
    """Input columns [start, end) of a packed weight, cut along its groups: whole groups (their
    scales and offsets sliced), or a part of one group (a per-channel scheme's: that group's scale
    and offset for the part). Anything else would need new scales: refused."""
    width, group_size = end - start, packed.group_size
    if start % group_size == 0 and width % group_size == 0:
        groups = slice(start // group_size, end // group_size)
        new_group_size = group_size
    elif start // group_size == (end - 1) // group_size and (group_size % width == 0 or end == packed.in_features):
        groups = slice(start // group_size, start // group_size + 1)
        new_group_size = width
    else:
        raise ShardingRefused(
            f"input columns [{start}, {end}) cut across quantization groups of {group_size}: "
            "use a number of shards whose slices hold whole groups"
        )
    if packed.bits == 4 and (start % 2 or width % 2):
        raise ShardingRefused("4-bit codes (two per byte) can't be cut at an odd column")
    codes = packed.codes[:, start:end] if packed.bits == 8 else packed.codes[:, start // 2 : end // 2]
    return PackedWeight(
        packed.bits,
        codes.contiguous(),
        packed.scales[:, groups].contiguous(),
        packed.offsets[:, groups].contiguous(),
        new_group_size,
        width,
    )


def vocab_range(vocab_size: int, group: ShardGroup) -> tuple[int, int]:
    """(first token, rows per shard) of this shard's slice; the last one is zero-padded."""
    per_shard = -(-vocab_size // group.world_size)
    return group.rank * per_shard, per_shard


def vocab_rows(weight: torch.Tensor, group: ShardGroup) -> tuple[torch.Tensor, int]:
    """This shard's rows of a [V, D] weight, zero-padded to the same count on every shard, and the first token."""
    start, per_shard = vocab_range(weight.shape[0], group)
    rows = weight.detach()[start : start + per_shard]
    if rows.shape[0] < per_shard:
        rows = torch.cat([rows, rows.new_zeros(per_shard - rows.shape[0], rows.shape[1])])
    return rows.contiguous(), start
