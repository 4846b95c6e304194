"""The paged attention function that transformers' model code calls for every layer.

Registered with `transformers.AttentionInterface` under ATTENTION_NAME; a model loaded with
`attn_implementation=ATTENTION_NAME` hands us per-layer q/k/v (after RoPE) for a packed, ragged
batch (batch dim 1, `position_ids` per token). We write k/v into the paged cache and attend
each sequence over its own prefix. transformers builds no mask for a custom name: causality,
sliding windows and softcap are all ours. Per-step metadata (`step_metadata`) arrives
through a contextvar, because some decoder layers drop `**kwargs` on the way down.
"""

from __future__ import annotations

import weakref
from typing import cast

import torch
from transformers import AttentionInterface

from inference_service.worker import step_yield
from inference_service.worker.attention.kv_cache import widen
from inference_service.worker.attention.prefill import attend_chunk
from inference_service.worker.attention.softcap import attend_masked
from inference_service.worker.attention.step_metadata import (
    StepMetadata,
    current_step,
    gpu_layout,
    needed,
)

ATTENTION_NAME = "engine_paged"

# Arguments that change the math in ways this function does not implement.
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias", "alibi", "head_mask")


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """q [1, H, T, D], k/v [1, KVH, T, D] → ([1, T, H, Dv], None)."""
    meta = kwargs.get("paged_meta") or current_step()
    if meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention called outside an engine step")
    _check_supported(module, kwargs)
    meta.num_calls += 1
    layer = cast(int, module.layer_idx)  # transformers' attention modules carry their layer's index
    if meta.recorded_shapes is not None:  # shape probe: learn KVH, D and dtype per layer
        meta.recorded_shapes[layer] = (key.shape[1], key.shape[3], key.dtype)
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[3]), None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    window = sliding_window if sliding_window else None
    kv_cache = needed(meta.kv_cache, "KV cache")
    step_yield.poll(layer, len(kv_cache.keys))  # a lone prefill step may give way to an arrival here
    kv_cache.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))  # [T, KVH, D]
    key_cache, value_cache = kv_cache.layer(layer)
    scales = kv_cache.scales(layer)

    if meta.decode_only:
        out = attend_decode(meta, query[0], key_cache, value_cache, scaling, window, softcap, scales)  # [Sd, H, Dv]
        return out.unsqueeze(0), None
    both_ways = any(chunk.both_way_spans for chunk in meta.prefills)  # those take the torch path
    if query.is_cuda and not both_ways and _flash_attn_takes(query[0].transpose(0, 1), key_cache, value_cache, meta):
        from inference_service.worker.attention import flash_attn_backend

        out = flash_attn_backend.attend_step(
            query[0].transpose(0, 1), key_cache, value_cache, gpu_layout(meta, "step"),
            needed(meta.kv_cache, "KV cache").block_size, scaling, window, softcap,
        )  # fmt: skip
        return out.unsqueeze(0), None
    if _use_triton(query, value) and not both_ways:
        # prefill chunks and decode rows in one launch (causal only)
        from inference_service.worker.attention import triton_paged

        out = triton_paged.paged_attention(
            query[0].transpose(0, 1), key_cache, value_cache, gpu_layout(meta, "step"),
            needed(meta.kv_cache, "KV cache").block_size, scaling, window, softcap,
        )  # fmt: skip
        return out.unsqueeze(0), None
    return attend_mixed(meta, query, key, value, layer, scaling, window, softcap).unsqueeze(0), None


def attend_mixed(
    meta: StepMetadata,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    layer: int,
    scaling: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [1, H, T, D] of a step holding prefill chunks (and perhaps decode rows), its new K/V rows
    already in the cache → [T, H, Dv] (torch's attention on any device). key/value [1, KVH, T, D]:
    the new rows as computed, which a chunk that starts its sequence attends over without reading
    them back (None: read from the cache)."""
    kv_cache = needed(meta.kv_cache, "KV cache")
    key_cache, value_cache = kv_cache.layer(layer)
    out = query.new_empty(meta.num_tokens, query.shape[1], value_cache.shape[-1])  # [T, H, Dv]
    if meta.decode_token_index is not None:
        q_decode = query[0].index_select(1, meta.decode_token_index)  # [H, Sd, D]
        out[meta.decode_token_index] = attend_decode(
            meta, q_decode, key_cache, value_cache, scaling, window, softcap, kv_cache.scales(layer)
        )
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_new)
        out[rows] = attend_chunk(
            query[:, :, rows],
            key[:, :, rows] if key is not None else None,
            value[:, :, rows] if value is not None else None,
            kv_cache,
            layer,
            chunk.context_slots,
            chunk.num_computed,
            scaling,
            window,
            softcap,
            chunk.both_way_spans,
        )
    return out


_CHECKED_MODULES: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _check_supported(module: torch.nn.Module, kwargs: dict) -> None:
    """Refuse math we don't implement; a module's own attributes are looked at once (getattr on a
    module is slow, and this runs for every layer of every step)."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise RuntimeError(f"{ATTENTION_NAME} attention does not implement '{name}'")
    if module in _CHECKED_MODULES:
        return
    for name in _UNSUPPORTED_KWARGS:
        if getattr(module, name, None) is not None:
            raise RuntimeError(f"{ATTENTION_NAME} attention does not implement '{name}'")
    _CHECKED_MODULES.add(module)


def attend_decode(
    meta: StepMetadata,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scaling: float,
    window: int | None,
    softcap: float | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [H, Sd, D] → [Sd, H, Dv]: each sequence's one new token over its own blocks (stored in the
    cache's dtype; `scales`: the int8 cache's K and V scales)."""
    kernel, q_by_seq = meta.decode_kernel, q.transpose(0, 1)  # [Sd, H, D]
    # The CPU kernel is asked first: it serves CPU tensors only and Triton CUDA ones only, so the
    # order changes nothing but what a CPU step pays per layer. It computes a bf16 model's attention
    # in fp32, from its bf16 (or other) cache in place.
    q_kernel = q_by_seq.float() if kernel is not None and q.dtype == torch.bfloat16 else q_by_seq
    if kernel is not None and kernel.supports(q_kernel, key_cache, value_cache):
        return kernel(
            q_kernel,
            key_cache,
            value_cache,
            # Checked inline, not through `_needed`: this runs per layer of every decode step.
            meta.decode_block_table if meta.decode_block_table is not None else needed(None, "decode block table"),
            meta.decode_context_lens if meta.decode_context_lens is not None else needed(None, "context lengths"),
            (meta.kv_cache if meta.kv_cache is not None else needed(None, "KV cache")).block_size,
            scaling,
            window,
            softcap,
            scales,
        ).to(q.dtype)
    if q.is_cuda and _flash_attn_takes(q_by_seq, key_cache, value_cache, meta):
        from inference_service.worker.attention import flash_attn_backend

        return flash_attn_backend.attend_decode(
            q_by_seq, key_cache, value_cache,
            needed(meta.decode_block_table, "decode block table"),
            needed(meta.decode_context_lens, "decode context lengths"),
            needed(meta.kv_cache, "KV cache").block_size, scaling, window, softcap,
        )  # fmt: skip
    if _use_triton(q, value_cache):
        from inference_service.worker.attention import triton_paged

        return triton_paged.paged_attention(
            q_by_seq, key_cache, value_cache, gpu_layout(meta, "decode"),
            needed(meta.kv_cache, "KV cache").block_size, scaling, window, softcap,
        )  # fmt: skip
    block_table = needed(meta.decode_block_table, "decode block table")  # [Sd, NB]
    num_seqs, num_blocks = block_table.shape
    block_size = needed(meta.kv_cache, "KV cache").block_size
    keys = _gather_blocks(key_cache, block_table, block_size)  # [Sd, KVH, NB*bs, D]
    values = _gather_blocks(value_cache, block_table, block_size)
    if scales is not None or keys.dtype != q.dtype:  # the cache's dtype, widened to the model's
        key_scales = value_scales = None
        if scales is not None:
            key_scales, value_scales = (_gather_blocks(s, block_table, block_size) for s in scales)
        keys, values = widen(keys, key_scales, q.dtype), widen(values, value_scales, q.dtype)
    mask = meta.decode_masks.get(window)
    if mask is None:
        context_lens = needed(meta.decode_context_lens, "decode context lengths")
        mask = _decode_mask(context_lens, num_blocks * block_size, window)  # [Sd, 1, 1, L]
        meta.decode_masks[window] = mask
    out = attend_masked(q_by_seq.unsqueeze(2), keys, values, mask, scaling, softcap)  # [Sd, H, 1, Dv]
    return out.squeeze(2)


def _flash_attn_takes(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: StepMetadata) -> bool:
    """Whether flash-attn's kernels (the optional extra) compute this CUDA attention: asked before
    the Triton kernel, which computes the rest (attention/flash_attn_backend.py says what it takes)."""
    from inference_service.worker.attention import flash_attn_backend

    return flash_attn_backend.takes(q, key_cache, value_cache, needed(meta.kv_cache, "KV cache").block_size)


def _use_triton(query: torch.Tensor, value: torch.Tensor) -> bool:
    """The Triton kernel serves CUDA tensors where Triton imports, for V heads as wide as Q's."""
    if not query.is_cuda or query.shape[-1] != value.shape[-1]:
        return False
    from inference_service.worker.attention import triton_paged

    return triton_paged.available()


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [slots, KVH, ...] → [Sd, KVH, NB*bs, ...] (scales [slots, KVH] → [Sd, KVH, NB*bs])."""
    num_seqs, num_blocks = block_table.shape
    blocks = cache.view(-1, block_size, *cache.shape[1:])  # [num_blocks_total, bs, KVH, D]
    picked = blocks.index_select(0, block_table.reshape(-1))  # [Sd*NB, bs, KVH, D]
    return picked.view(num_seqs, num_blocks * block_size, *cache.shape[1:]).transpose(1, 2)


def _decode_mask(context_lens: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    positions = torch.arange(length, device=context_lens.device)  # [L]
    lens = context_lens[:, None]  # [Sd, 1]
    mask = positions[None, :] < lens  # [Sd, L]
    if window is not None:
        mask &= positions[None, :] > lens - 1 - window
    return mask[:, None, None, :]


def register() -> None:
    """Make `attn_implementation=ATTENTION_NAME` valid for transformers models (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
