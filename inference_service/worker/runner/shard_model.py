"""Cut a loaded transformers model down to one shard's slice, in place (tensor parallelism).

Megatron's plan, as TGI shards: in each decoder layer q/k/v and gate/up are column-parallel (a
slice of heads, of the MLP's width), o and down row-parallel (summed over the shards); the
embedding and the head are vocabulary-parallel. Shard s keeps query heads [s·H/N, (s+1)·H/N) and
the KV heads they read: its share of them when N divides the KV heads, else (fewer KV heads than
shards, N a multiple of them) the one KV head its query heads share, held by several shards. The
attention function and the KV cache then see this shard's heads only, with no change: they learn
the head counts from the tensors.

It runs before the native linears go in (they take the slices like any nn.Linear). Quantized
projections (QuantLinear: every scheme's group-wise codes) are cut along their groups
(linears/parallel.py); the head and the embedding must be full precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inference_service.worker.linears.parallel import (
    RowParallelLinear,
    ShardingRefused,
    VocabParallelEmbedding,
    VocabParallelHead,
    column_slice,
    vocab_rows,
)
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.shard_group import ShardGroup


@dataclass(frozen=True)
class _Names:
    """Where a family keeps its layers and projections (attribute names)."""

    layers: tuple[str, ...]  # path from the causal LM to the decoder layers
    q: str
    k: str
    v: str
    o: str
    mlp: str | None  # the layer's MLP module; None: the projections are on the layer itself
    column: tuple[str, ...]  # MLP projections cut by output rows
    row: str  # the MLP projection cut by input columns


_LLAMA = _Names(
    ("model", "layers"), "q_proj", "k_proj", "v_proj", "o_proj", "mlp", ("gate_proj", "up_proj"), "down_proj"
)
_OPT = _Names(("model", "decoder", "layers"), "q_proj", "k_proj", "v_proj", "out_proj", None, ("fc1",), "fc2")
# Families whose layers are cut by name; others are refused (their attention fuses q/k/v in ways
# each needs its own plan for: phi3, gpt2, gpt_neox, ...).
FAMILIES: dict[str, _Names] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo"), _LLAMA),
    "opt": _OPT,
}


def shard_model(model: Any, group: ShardGroup) -> None:
    """Keep this shard's slice of every layer of `model` (a transformers causal LM) and wire the
    collectives; raises ShardingRefused (nothing changed) for a model it can't cut."""
    names, heads, kv_heads, head_dim = _check(model, group.world_size)
    q_heads, kv_heads_kept = heads_of(group.rank, group.world_size, heads, kv_heads)
    q_rows, kv_rows = head_rows(q_heads, head_dim), head_rows(kv_heads_kept, head_dim)
    for layer in _layers(model, names):
        attn = layer.self_attn
        for name, rows in ((names.q, q_rows), (names.k, kv_rows), (names.v, kv_rows)):
            setattr(attn, name, column_slice(getattr(attn, name), rows))
        setattr(attn, names.o, RowParallelLinear.from_linear(getattr(attn, names.o), q_rows, group))
        set_head_counts(attn, len(q_heads), len(kv_heads_kept))
        mlp = getattr(layer, names.mlp) if names.mlp else layer
        width = getattr(mlp, names.column[0]).out_features
        mlp_rows = share(width, group.rank, group.world_size)
        for name in names.column:
            setattr(mlp, name, column_slice(getattr(mlp, name), mlp_rows))
        setattr(mlp, names.row, RowParallelLinear.from_linear(getattr(mlp, names.row), mlp_rows, group))
    shard_vocabulary(model, group)


def _check(model: Any, num_shards: int) -> tuple[_Names, int, int, int]:
    config = model.config.get_text_config()
    names = FAMILIES.get(config.model_type)
    if names is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ShardingRefused(f"tensor parallelism does not cut {config.model_type!r} models yet (it cuts {supported})")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % num_shards:
        raise ShardingRefused(f"{heads} attention heads can't be split evenly over {num_shards} shards")
    if kv_heads % num_shards and num_shards % kv_heads:
        raise ShardingRefused(
            f"{kv_heads} KV heads can't be split over {num_shards} shards (nor one repeated on each): "
            "use a number of shards that divides them or that they divide"
        )
    for layer in _layers(model, names):
        attn, mlp = layer.self_attn, getattr(layer, names.mlp) if names.mlp else layer
        modules = [getattr(attn, n, None) for n in (names.q, names.k, names.v, names.o)]
        modules += [getattr(mlp, n, None) for n in (*names.column, names.row)]
        for module in modules:
            if type(module) is not torch.nn.Linear and not isinstance(module, QuantLinear):
                kind = type(module).__name__
                raise ShardingRefused(f"tensor parallelism cuts nn.Linear and packed quantized projections, not {kind}")
        width = getattr(mlp, names.column[0]).out_features
        if width % num_shards:
            raise ShardingRefused(f"an MLP of width {width} can't be split evenly over {num_shards} shards")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    head_kind_ok = type(head) is torch.nn.Linear or isinstance(head, QuantLinear)
    if not isinstance(embed, torch.nn.Embedding) or not head_kind_ok or head.bias is not None:
        raise ShardingRefused("tensor parallelism needs a plain embedding and a linear head without bias")
    return names, heads, kv_heads, head_dim


def _layers(model: Any, names: _Names) -> list[Any]:
    module = model
    for name in names.layers:
        module = getattr(module, name)
    return list(module)


def heads_of(rank: int, num_shards: int, heads: int, kv_heads: int) -> tuple[list[int], list[int]]:
    """This shard's query heads and the KV heads they read."""
    per_shard = heads // num_shards
    q_heads = list(range(rank * per_shard, (rank + 1) * per_shard))
    if kv_heads % num_shards == 0:
        kv_per_shard = kv_heads // num_shards
        return q_heads, list(range(rank * kv_per_shard, (rank + 1) * kv_per_shard))
    group_size = heads // kv_heads  # query heads per KV head: this shard's all read one
    return q_heads, [q_heads[0] // group_size]


def head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def share(width: int, rank: int, num_shards: int) -> torch.Tensor:
    per_shard = width // num_shards
    return torch.arange(rank * per_shard, (rank + 1) * per_shard)


def set_head_counts(attn: Any, num_heads: int, num_kv_heads: int) -> None:
    """Head counts some attention modules keep (OPT reshapes by `num_heads`; eager attention repeats KV
    by `num_key_value_groups`)."""
    for name, value in (
        ("num_heads", num_heads),
        ("num_attention_heads", num_heads),
        ("num_key_value_heads", num_kv_heads),
        ("num_key_value_groups", num_heads // num_kv_heads),
    ):
        if hasattr(attn, name):
            setattr(attn, name, value)
    if hasattr(attn, "embed_dim") and hasattr(attn, "head_dim"):
        attn.embed_dim = num_heads * attn.head_dim


def shard_vocabulary(model: Any, group: ShardGroup, full_width: bool = False) -> None:
    """The embedding and the head cut by vocabulary. `full_width`: followers' heads return logits
    of the whole vocabulary's width (not their values), for models that add a full-width bias after
    the head (BART's final_logits_bias)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = getattr(head, "weight", None) is embed.weight
    rows, start = vocab_rows(embed.weight, group)
    scale = getattr(embed, "embed_scale", None)
    parallel_embed = VocabParallelEmbedding(rows, start, embed.num_embeddings, group, scale)
    model.set_input_embeddings(parallel_embed)
    inner: torch.nn.Module
    last = head.out_features - 1
    token_rows = torch.arange(start, start + rows.shape[0]).clamp(max=last)
    if tied:
        inner = torch.nn.Linear(head.in_features, rows.shape[0], bias=head.bias is not None, device=rows.device)
        inner.weight = parallel_embed.weight  # still one tensor: the panel layout leaves it alone
        if head.bias is not None:
            inner.bias = torch.nn.Parameter(head.bias.detach()[token_rows].contiguous(), requires_grad=False)
    else:  # the last shard's padding rows repeat the last token's: their logits are cut off
        inner = column_slice(head, token_rows)
    model.set_output_embeddings(VocabParallelHead(inner, head.out_features, group, full_width))
