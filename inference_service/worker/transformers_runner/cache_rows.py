"""Stacking batch-1 transformers caches into one batch and taking rows back out.

The fallback runner keeps one cache per request; requests whose caches hold the same number of
tokens can run one forward together when their caches are stacked along the batch axis. Rows
taken out are views (no copy); stacking copies once. Only plain `DynamicLayer`s stack: a sliding
or quantized layer keeps state a concatenation would not carry.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache, EncoderDecoderCache
from transformers.cache_utils import Cache, DynamicLayer


def stackable(cache: Cache) -> bool:
    """Whether `cache` is made of plain dynamic layers, all filled (the ones `stack` handles)."""
    if isinstance(cache, EncoderDecoderCache):
        return stackable(cache.self_attention_cache) and stackable(cache.cross_attention_cache)
    return (
        isinstance(cache, DynamicCache)
        and len(cache.layers) > 0
        and all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers)
    )


def stack(caches: list[DynamicCache], pad_to: int | None = None) -> DynamicCache:
    """One cache of len(caches) rows; with `pad_to`, each row's tokens are zero-padded at the end
    to that length (cross-attention K/V of encoder outputs of several lengths, masked by the caller)."""
    layers = []
    for parts in zip(*(cache.layers for cache in caches), strict=True):
        keys = [_padded(layer.keys, pad_to) for layer in parts]
        values = [_padded(layer.values, pad_to) for layer in parts]
        layers.append(_layer(torch.cat(keys), torch.cat(values)))
    return _cache(layers)


def select(cache: Cache, rows: torch.Tensor) -> Cache:
    """The stacked cache's `rows` (indices [R]) as a new stacked cache (one copy)."""
    if isinstance(cache, EncoderDecoderCache):
        return EncoderDecoderCache(select(cache.self_attention_cache, rows), select(cache.cross_attention_cache, rows))
    return _cache(
        [
            _layer(keys.index_select(0, rows), values.index_select(0, rows))
            for keys, values in map(_filled, cache.layers)
        ]
    )


def row(cache: DynamicCache, index: int, length: int | None = None) -> DynamicCache:
    """Row `index` of a stacked cache as a batch-1 cache of views; `length` keeps only its first
    tokens (dropping the padding `stack` added)."""
    end = length if length is not None else None
    return _cache(
        [
            _layer(keys[index : index + 1, :, :end], values[index : index + 1, :, :end])
            for keys, values in map(_filled, cache.layers)
        ]
    )


def _filled(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked cache's layer's keys and values: it is a filled DynamicLayer (`_layer`), whose
    tensors transformers types as optional."""
    return cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)


def _padded(tensor: torch.Tensor, length: int | None) -> torch.Tensor:
    """[1, heads, n, dim] zero-padded to `length` tokens."""
    if length is None or tensor.shape[-2] == length:
        return tensor
    return F.pad(tensor, (0, 0, 0, length - tensor.shape[-2]))


def _layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


def _cache(layers: list[DynamicLayer]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = cast(list[Any], layers)  # list is invariant: transformers declares a list of all its layer kinds
    return cache
