"""A prefill chunk's attention on the torch path: its new rows over the cached prefix and themselves.

A long prompt runs in chunks (`--max-batch-prefill-tokens`), so a late chunk of a 16k prompt is 2k
queries over 16k keys. No matrix of that size is built, neither scores nor a mask: on CPU the chunk
attends the prefix (every key visible) and itself (causal, square) as two calls of torch's flash
attention kernel, which takes the keys a tile at a time, and the two parts are merged by their
log-sum-exp. Sliding windows, softcap and both-way spans take the masked path: a boolean mask
[n, ctx] (its float copy made by SDPA), the scores in tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_service.worker.attention.kv_cache import PagedKVCache
from inference_service.worker.attention.softcap import attend_masked

# torch's CPU flash attention with its log-sum-exp (the public SDPA returns the output alone).
_FLASH_WITH_LSE = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attend_chunk(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv_cache: PagedKVCache,
    layer: int,
    context_slots: torch.Tensor,
    num_computed: int,
    scaling: float,
    window: int | None,
    softcap: float | None,
    both_way_spans: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    """q [1, H, n, D] → [n, H, Dv]: n new tokens at positions num_computed.. over the cached prefix
    and themselves. k_new/v_new [1, KVH, n, D]: the new rows as computed (None: read back from the
    cache); context_slots [num_computed + n]: the cache slots of the whole context."""
    plain = window is None and softcap is None and not both_way_spans
    if k_new is None or v_new is None:  # everything from the cache
        keys, values = _read(kv_cache, layer, context_slots)
    elif num_computed == 0:  # a fresh prompt: no need to read the cache back
        keys, values = k_new, v_new
        if plain:
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scaling, enable_gqa=keys.shape[1] != q.shape[1]
            )
            return out[0].transpose(0, 1)
    else:  # the prefix from the cache, the chunk's own rows as computed (as a fresh prompt's are)
        prefix_keys, prefix_values = _read(kv_cache, layer, context_slots[:num_computed])
        if plain and _splits(q):
            return _attend_split(q, prefix_keys, prefix_values, k_new, v_new, scaling)[0].transpose(0, 1)
        keys, values = torch.cat([prefix_keys, k_new], dim=2), torch.cat([prefix_values, v_new], dim=2)
    mask = prefill_mask(q.shape[2], num_computed, window, q.device, both_way_spans)  # [n, ctx]
    return attend_masked(q, keys, values, mask, scaling, softcap)[0].transpose(0, 1)


def prefill_mask(
    num_new: int,
    num_computed: int,
    window: int | None,
    device: torch.device,
    both_way_spans: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    """Causal, or both ways within a span (transformers' blockwise overlay), then the window's cut
    (AND(window, OR(causal, span)), as Gemma 3's sliding layers do)."""
    query_pos = torch.arange(num_computed, num_computed + num_new, device=device)[:, None]  # [n, 1]
    key_pos = torch.arange(num_computed + num_new, device=device)[None, :]  # [1, ctx]
    mask = key_pos <= query_pos
    for start, end in both_way_spans:
        mask |= (query_pos >= start) & (query_pos < end) & (key_pos >= start) & (key_pos < end)
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


def _splits(q: torch.Tensor) -> bool:
    """Whether the chunk takes the split path: torch's CPU flash kernel serves it."""
    return q.device.type == "cpu" and q.dtype in _FLASH_DTYPES


def _read(kv_cache: PagedKVCache, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached K and V at `slots` [L] → [1, KVH, L, D] each, in the model's dtype."""
    keys, values = kv_cache.read(layer, slots)  # [L, KVH, D]
    return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


def _attend_split(
    q: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """q [1, H, n, D] over a prefix it sees whole and over its own n rows causally → [1, H, n, Dv]:
    softmax over both parts at once, from each part's output and log-sum-exp [1, H, n]."""
    on_prefix, lse_prefix = _FLASH_WITH_LSE(q, prefix_keys, prefix_values, 0.0, False, scale=scaling)
    on_self, lse_self = _FLASH_WITH_LSE(q, new_keys, new_values, 0.0, True, scale=scaling)
    # Each part's share of the whole softmax: exp(lse_a) / (exp(lse_a) + exp(lse_b)).
    prefix_share = torch.sigmoid(lse_prefix - lse_self).unsqueeze(-1)  # [1, H, n, 1] fp32
    merged = on_self.float() + prefix_share * (on_prefix.float() - on_self.float())
    return merged.to(q.dtype)
