"""Cut a model the fallback runner serves (transformers' own attention) down to one shard's slice.

The same Megatron plan as the paged families (shard_model.py), applied to transformers' modules of
the families the paged attention can't serve: every attention module (self-attention, an encoder's,
a decoder's cross-attention) keeps the query heads [s·H/N, (s+1)·H/N) and the KV heads they read,
its output projection row-parallel; every MLP's input projections are cut by output rows and its
output projection by input columns; the embedding and the head are vocabulary-parallel. The
attention code then runs unchanged on this shard's heads: it reads the head counts the module keeps
(set here), and transformers' per-request caches hold this shard's heads only.

What differs by family is where the projections are and how a fused q/k/v weight lays out its
heads (BLOOM: [head][q|k|v]; Falcon: three layouts; MPT: [q|k|v]), and the few per-head tensors a
model builds above its layers: ALiBi slopes (BLOOM, Falcon with alibi, MPT) are built for every
head and sliced to this shard's on the way into each attention module; T5's relative-position
bias table is cut by head. Families not listed here are refused with ShardingRefused, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from inference_service.worker.linears.parallel import RowParallelLinear, ShardingRefused, column_slice
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.runner.shard_model import head_rows, heads_of, set_head_counts, shard_vocabulary, share
from inference_service.worker.shard_group import ShardGroup

# Attention modules with separate projections: (q, k, v, o) attribute names.
_SEPARATE = (("q_proj", "k_proj", "v_proj", "out_proj"), ("q", "k", "v", "o"))
# MLPs: (input projections cut by output rows, output projection cut by input columns).
_MLPS = (
    (("fc_in",), "fc_out"),  # GPT-J
    (("fc1",), "fc2"),  # BART, mBART, M2M100, Marian, Pegasus
    (("dense_h_to_4h",), "dense_4h_to_h"),  # BLOOM, Falcon
    (("up_proj",), "down_proj"),  # MPT
    (("wi",), "wo"),  # T5
    (("wi_0", "wi_1"), "wo"),  # T5 v1.1, mT5, UMT5 (gated)
)
# The decoder-only and encoder-decoder families the fallback runner serves that this file cuts.
FALLBACK_FAMILIES = (
    "gptj",
    "bloom",
    "falcon",
    "mpt",
    "t5",
    "mt5",
    "umt5",
    "bart",
    "mbart",
    "m2m_100",
    "marian",
    "pegasus",
)


def shard_fallback_model(model: Any, group: ShardGroup) -> None:
    """Keep this shard's slice of `model` (a fallback family's transformers model), the collectives
    wired in; raises ShardingRefused, having changed nothing, for a model it can't cut."""
    model_type = model.config.model_type
    if model_type not in FALLBACK_FAMILIES:
        raise ShardingRefused(
            f"tensor parallelism does not cut {model_type!r} models on the fallback runner yet "
            f"(it cuts {', '.join(FALLBACK_FAMILIES)} there)"
        )
    attentions, mlps = _plan(model, group.world_size)
    for attention in attentions:
        attention(group)
    for mlp in mlps:
        mlp(group)
    shard_vocabulary(model, group, full_width=True)


def _plan(model: Any, num_shards: int) -> tuple[list[Callable[[ShardGroup], None]], list[Callable[[ShardGroup], None]]]:
    """Every cut to make, checked before any is made (all or nothing)."""
    attentions: list[Callable[[ShardGroup], None]] = []
    mlps: list[Callable[[ShardGroup], None]] = []
    for module in model.modules():
        cut = _attention_cut(model.config, module, num_shards)
        if cut is not None:
            attentions.append(cut)
        for columns, row in _MLPS:
            if all(hasattr(module, name) for name in (*columns, row)):
                mlps.append(_mlp_cut(module, columns, row, num_shards))
                break
    layers = _num_layers(model.config)
    if len(attentions) < layers or len(mlps) < layers:
        raise ShardingRefused(
            f"found {len(attentions)} attention modules and {len(mlps)} MLPs to cut in a "
            f"{model.config.model_type!r} model of {layers} layers: its layout is not the one this version cuts"
        )
    _check_vocabulary(model)
    return attentions, mlps


def _num_layers(config: Any) -> int:
    text = config.get_text_config()
    for name in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
        value = getattr(text, name, None)
        if isinstance(value, int):
            return value
    return 1


def _attention_cut(config: Any, module: Any, num_shards: int) -> Callable[[ShardGroup], None] | None:
    """The cut of `module` if it is an attention module (None if it is not)."""
    for names in _SEPARATE:
        if all(isinstance(getattr(module, n, None), torch.nn.Module) for n in names):
            return _separate_cut(module, names, num_shards)
    if hasattr(module, "query_key_value") and hasattr(module, "dense"):
        return _fused_cut(config, module, "query_key_value", "dense", num_shards)
    if hasattr(module, "Wqkv") and hasattr(module, "out_proj"):
        return _fused_cut(config, module, "Wqkv", "out_proj", num_shards)
    return None


def _head_count(module: Any) -> int:
    for name in ("num_heads", "n_heads", "num_attention_heads"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    raise ShardingRefused(f"{type(module).__name__} does not say how many heads it has")


def _check_heads(module: Any, heads: int, kv_heads: int, num_shards: int) -> None:
    kind = type(module).__name__
    if heads % num_shards:
        raise ShardingRefused(f"{kind}: {heads} attention heads can't be split evenly over {num_shards} shards")
    if kv_heads % num_shards and num_shards % kv_heads:
        raise ShardingRefused(
            f"{kind}: {kv_heads} KV heads can't be split over {num_shards} shards (nor one repeated on each)"
        )


def _separate_cut(module: Any, names: tuple[str, ...], num_shards: int) -> Callable[[ShardGroup], None]:
    q, k, v, o = names
    heads = _head_count(module)
    kv_heads = getattr(module, "num_key_value_heads", None) or heads
    head_dim = getattr(module, q).out_features // heads
    _check_heads(module, heads, kv_heads, num_shards)
    for name in names:
        _check_linear(getattr(module, name))
    relative = getattr(module, "relative_attention_bias", None)

    def cut(group: ShardGroup) -> None:
        q_heads, kv_kept = heads_of(group.rank, group.world_size, heads, kv_heads)
        q_rows, kv_rows = head_rows(q_heads, head_dim), head_rows(kv_kept, head_dim)
        for name, rows in ((q, q_rows), (k, kv_rows), (v, kv_rows)):
            setattr(module, name, column_slice(_plain(getattr(module, name)), rows))
        setattr(module, o, RowParallelLinear.from_linear(_plain(getattr(module, o)), q_rows, group))
        set_head_counts(module, len(q_heads), len(kv_kept))
        if hasattr(module, "n_heads"):  # T5's names
            module.n_heads = len(q_heads)
            module.inner_dim = len(q_heads) * head_dim
        if isinstance(relative, torch.nn.Embedding):  # T5's bias table: a column per head
            weight = relative.weight.detach()[:, q_heads].contiguous()
            module.relative_attention_bias = torch.nn.Embedding.from_pretrained(weight, freeze=True)

    return cut


def _fused_cut(config: Any, module: Any, fused: str, out: str, num_shards: int) -> Callable[[ShardGroup], None]:
    """BLOOM's, Falcon's and MPT's one q/k/v projection: the rows of this shard's heads, in the layout
    the module's own split expects."""
    heads = _head_count(module)
    weight_rows = getattr(module, fused).out_features
    model_type = config.model_type
    kv_heads = module.num_kv_heads if model_type == "falcon" else heads
    head_dim = getattr(module, "head_dim", None) or weight_rows // (heads + 2 * kv_heads)
    _check_heads(module, heads, kv_heads, num_shards)
    _check_linear(getattr(module, fused))
    _check_linear(getattr(module, out))
    if getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False):
        raise ShardingRefused("BLOOM's slow_but_exact pretraining_tp projections are not cut")
    # Falcon with ALiBi also folds the slopes into its mask: [B, H, q, k]
    per_head = {"bloom": ("alibi",), "falcon": ("alibi", "attention_mask"), "mpt": ("position_bias",)}[model_type]

    def cut(group: ShardGroup) -> None:
        q_heads, kv_kept = heads_of(group.rank, group.world_size, heads, kv_heads)
        rows, kv_count = _fused_rows(module, model_type, heads, kv_heads, head_dim, q_heads, kv_kept)
        setattr(module, fused, column_slice(_plain(getattr(module, fused)), rows))
        setattr(
            module,
            out,
            RowParallelLinear.from_linear(_plain(getattr(module, out)), head_rows(q_heads, head_dim), group),
        )
        set_head_counts(module, len(q_heads), kv_count)
        if hasattr(module, "n_heads"):  # MPT's name
            module.n_heads = len(q_heads)
        if hasattr(module, "num_kv_heads"):  # Falcon's
            module.num_kv_heads = kv_count
        module.register_forward_pre_hook(_slice_heads(per_head, heads, q_heads), with_kwargs=True)

    return cut


def _fused_rows(
    module: Any, model_type: str, heads: int, kv_heads: int, head_dim: int, q_heads: list[int], kv_kept: list[int]
) -> tuple[torch.Tensor, int]:
    """The fused weight's rows for this shard's heads, and the KV head count its split then sees."""

    def block(start: int, count: int = 1) -> torch.Tensor:
        return torch.arange(start * head_dim, (start + count) * head_dim)

    if model_type == "bloom" or (
        model_type == "falcon" and not module.new_decoder_architecture and not module.multi_query
    ):
        # [head][q | k | v]: each head's three rows together
        return torch.cat([block(3 * h, 3) for h in q_heads]), len(q_heads)
    if model_type == "mpt":  # [q of every head | k of every head | v of every head]
        return torch.cat(
            [block(h) for h in q_heads] + [block(heads + h) for h in q_heads] + [block(2 * heads + h) for h in q_heads]
        ), len(q_heads)
    if not module.new_decoder_architecture:  # Falcon multi-query: [q of every head | k | v]
        return torch.cat([*[block(h) for h in q_heads], block(heads), block(heads + 1)]), 1
    # Falcon's new layout: per KV group [its query heads | k | v]
    group_size = heads // kv_heads
    width = group_size + 2
    parts = []
    for g in kv_kept:
        mine = [h for h in q_heads if h // group_size == g]
        parts += [block(g * width + h % group_size) for h in mine]
        parts += [block(g * width + group_size), block(g * width + group_size + 1)]
    return torch.cat(parts), len(kv_kept)


def _slice_heads(arguments: tuple[str, ...], heads: int, q_heads: list[int]) -> Callable:
    """A pre-hook giving an attention module this shard's rows of the per-head tensors built for all
    heads above the layers: BLOOM's ALiBi [B·H, 1, S], Falcon's [B·H, 1, S] and its mask with the
    slopes folded in [B, H, q, k], MPT's [H, 1, S]. A mask shared by every head ([B, 1, q, k]) is
    left alone."""
    first, count = q_heads[0], len(q_heads)

    def sliced(tensor: torch.Tensor) -> torch.Tensor:
        shape = tensor.shape
        if tensor.dim() == 4:  # [B, H, q, k], or [B, 1, q, k] for every head
            return tensor[:, first : first + count] if shape[1] == heads else tensor
        return tensor.reshape(-1, heads, *shape[1:])[:, first : first + count].reshape(-1, *shape[1:])

    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        found = {name: kwargs[name] for name in arguments if isinstance(kwargs.get(name), torch.Tensor)}
        return args, {**kwargs, **{name: sliced(tensor) for name, tensor in found.items()}}

    return hook


def _mlp_cut(module: Any, columns: tuple[str, ...], row: str, num_shards: int) -> Callable[[ShardGroup], None]:
    width = getattr(module, columns[0]).out_features
    if width % num_shards:
        raise ShardingRefused(f"an MLP of width {width} can't be split evenly over {num_shards} shards")
    for name in (*columns, row):
        _check_linear(getattr(module, name))

    def cut(group: ShardGroup) -> None:
        rows = share(width, group.rank, group.world_size)
        for name in columns:
            setattr(module, name, column_slice(_plain(getattr(module, name)), rows))
        setattr(module, row, RowParallelLinear.from_linear(_plain(getattr(module, row)), rows, group))

    return cut


def _check_linear(module: Any) -> None:
    if not isinstance(module, torch.nn.Linear | QuantLinear):
        kind = type(module).__name__
        raise ShardingRefused(f"tensor parallelism cuts nn.Linear and packed quantized projections, not {kind}")


def _plain(module: Any) -> Any:
    """An nn.Linear subclass that computes x·Wᵀ + b its own way (Falcon's) as a plain nn.Linear."""
    if isinstance(module, QuantLinear) or type(module) is torch.nn.Linear:
        return module
    plain = torch.nn.Linear(
        module.in_features, module.out_features, bias=module.bias is not None, device=module.weight.device
    )
    plain.to(module.weight.dtype)
    plain.weight = module.weight
    if module.bias is not None:
        plain.bias = module.bias
    return plain


def _check_vocabulary(model: Any) -> None:
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, torch.nn.Embedding) or not isinstance(head, torch.nn.Linear | QuantLinear):
        raise ShardingRefused("tensor parallelism needs a plain embedding and a linear head")
