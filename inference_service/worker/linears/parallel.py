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

from inference_service.worker.shard_group import ShardGroup


def column_slice(linear: torch.nn.Linear, rows: torch.Tensor) -> torch.nn.Linear:
    """An `nn.Linear` computing output `rows` (int64 indices) of `linear`."""
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
    def from_linear(cls, linear: torch.nn.Linear, columns: torch.Tensor, group: ShardGroup) -> RowParallelLinear:
        weight = linear.weight.detach()[:, columns].contiguous()  # [N, k]
        inner = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        inner.to(weight.dtype)
        inner.weight = torch.nn.Parameter(weight, requires_grad=False)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(inner, bias, linear.in_features, group)

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
        scale: torch.Tensor | None = None,
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)  # [per_shard, D], zero-padded
        self.start = start
        self.num_embeddings = num_embeddings  # the whole vocabulary's
        self.embedding_dim = weight.shape[1]
        self.group = group
        self.scale = scale  # Gemma's embeddings are scaled by √D (transformers' ScaledWordEmbedding)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # [..., D]
        rows = self.group.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
        return rows if self.scale is None else rows * self.scale.to(rows.dtype)


class VocabParallelHead(torch.nn.Module):
    """Logits of this shard's vocabulary slice (`inner`, an nn.Linear the native kernels may
    replace), gathered on shard 0 into the whole vocabulary; other shards return their slice."""

    def __init__(self, inner: torch.nn.Module, out_features: int, group: ShardGroup):
        super().__init__()
        self.inner = inner
        self.out_features = out_features  # the whole vocabulary's (the sampler's width)
        self.in_features = cast(int, inner.in_features)
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        """This shard's rows (zero-padded), for code that inspects the head."""
        return cast(torch.Tensor, self.inner.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden)  # [..., per_shard]
        parts = self.group.gather_to_first(local)
        if not parts:
            return local
        return torch.cat(parts, dim=-1)[..., : self.out_features]


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
