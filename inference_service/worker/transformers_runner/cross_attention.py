"""Cross-attention vision-language models (Mllama) over transformers' own caches.

The language model reads each image through cross-attention layers: a request's first forward
(its first prompt chunk, again after a preemption) passes the pixel values, the vision tower runs
inside the model, and each cross-attention layer keeps the image's K/V in its slot of the request's
cache; later chunks and decode steps read them there. Which prompt tokens see which image is the
processor's cross-attention mask ([1, prompt, images, tiles]); a token past the prompt sees what the
prompt's last token sees, as `generate` extends the mask.

A cross-attention layer's cache slot holds image tokens, not text: cutting the cache back (after
speculation's rejected guesses) cuts only the self-attention layers. Decode rows stack into a batch
when their caches line up: the same number of computed tokens and of images (so of image K/V).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from inference_service.outputs import ScheduledRequest
from inference_service.worker.transformers_runner import cache_rows
from inference_service.worker.transformers_runner.forward import Batch, DecoderOnlyForward, Sequence

# Model types whose language model reads images through cross-attention (served here).
CROSS_ATTENTION_MODELS = ("mllama",)
# The processor's per-image tensors the model takes in its first forward, and the axis that counts images.
IMAGE_AXES = {"pixel_values": 1, "aspect_ratio_ids": 1, "aspect_ratio_mask": 1, "cross_attention_mask": 2}


class CrossAttentionCache(DynamicCache):
    """A DynamicCache whose cross-attention layers hold image K/V that a crop must keep."""

    def __init__(self, config: Any, cross_layers: frozenset[int]):
        super().__init__(config=config)
        self.cross_layers = cross_layers

    def crop(self, max_length: int) -> None:
        for index, layer in enumerate(self.layers):
            if index not in self.cross_layers:
                cast(Any, layer).crop(max_length)  # every layer kind of a DynamicCache crops


@dataclass
class ImageSequence(Sequence):
    """A request's cache, and its images as the model takes them (empty: a text-only request)."""

    images: dict[str, torch.Tensor] = field(default_factory=dict)


class CrossAttentionForward(DecoderOnlyForward):
    def __init__(self, model: Any, device: torch.device):
        super().__init__(model, device)
        self.cross_layers = frozenset(model.config.get_text_config().cross_attention_layers)

    def start(self, item: ScheduledRequest) -> Sequence:
        images: dict[str, torch.Tensor] = {}
        if item.images:
            for name, axis in IMAGE_AXES.items():
                parts = [image.pixel_values if name == "pixel_values" else image.extras[name] for image in item.images]
                images[name] = torch.cat(parts, dim=axis).to(self.device)
            images["pixel_values"] = images["pixel_values"].to(self.model.dtype)
        return ImageSequence(CrossAttentionCache(self.model.config, self.cross_layers), images=images)

    def batch(self, ids: tuple[str, ...], sequences: list[Sequence]) -> Batch | None:  # type: ignore[override]
        """Decode rows of requests with the same number of images; None: they run alone."""
        masks = [cast(ImageSequence, s).images.get("cross_attention_mask") for s in sequences]
        if any(mask is None for mask in masks) or len({cast(torch.Tensor, m).shape[2] for m in masks}) != 1:
            return None
        stacked = cache_rows.stack([cast(DynamicCache, s.cache) for s in sequences])
        last_rows = torch.cat([cast(torch.Tensor, m)[:, -1:] for m in masks])  # [B, 1, images, tiles]
        return Batch(ids, stacked, {"cross_attention_mask": last_rows})

    def take(self, batch: Batch, index: int, sequence: Sequence) -> Cache:
        row = cache_rows.row(cast(DynamicCache, batch.cache), index)
        cache = CrossAttentionCache(self.model.config, self.cross_layers)
        cache.layers = row.layers
        return cache

    def inputs(self, sequence: Sequence) -> dict:
        return cast(ImageSequence, sequence).images

    def logits(self, ids: torch.Tensor, cache: Cache, inputs: dict, num_cached: int) -> torch.Tensor:
        """fp32 logits [B, n, V] of `ids` [B, n]; the images go in only with the first tokens."""
        extra: dict[str, torch.Tensor] = {}
        mask = inputs.get("cross_attention_mask")
        if mask is not None:
            rows = torch.arange(num_cached, num_cached + ids.shape[1], device=mask.device).clamp(max=mask.shape[1] - 1)
            extra["cross_attention_mask"] = mask[:, rows]
            if num_cached == 0:
                extra.update((name, inputs[name]) for name in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"))
        attention = torch.ones(ids.shape[0], num_cached + ids.shape[1], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, attention_mask=attention, past_key_values=cache, use_cache=True, **extra)
        return out.logits.float()


def cross_attention_forward(model: Any, device: torch.device) -> CrossAttentionForward | None:
    """The forward for a cross-attention vision-language model; None for any other model."""
    if getattr(model.config, "model_type", None) in CROSS_ATTENTION_MODELS:
        return CrossAttentionForward(model, device)
    return None
