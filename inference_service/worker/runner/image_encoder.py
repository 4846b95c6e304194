"""A vision-language model's image encoder (vision tower + projector), run through the model's own
`get_image_features`: images of one shape are stacked into one batch, each image's rows come back
as [num_tokens, H] in the language model's dtype, and their count is checked against its
placeholders (a mismatch is a bug to report, never rows merged at the wrong places). Images admitted
together are encoded in batches within the memory kept for the encoder at startup.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from inference_service.sampling_params import ImageInput
from inference_service.worker.runner.encoder_memory import EncoderBudget


class ImageEncoder:
    """Encodes images for one loaded vision-language model."""

    def __init__(self, model: Any, device: torch.device, budget: EncoderBudget | None = None):
        # model: a transformers PreTrainedModel, whose attributes torch types as tensors
        self.model = model
        self.device = device
        self.budget = budget  # the memory kept for it: a batch of images never needs more
        self.inner: Any = getattr(model, "model", model)  # the VLM body that has get_image_features
        embed = model.get_input_embeddings()  # its table: a parameter, or a buffer once in panels (tied_head.py)
        self.dtype = next(itertools.chain(embed.parameters(), embed.buffers())).dtype

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        groups: dict[tuple, list[int]] = {}
        for index, image in enumerate(images):
            groups.setdefault(_shape_key(image), []).append(index)
        rows: list[torch.Tensor | None] = [None] * len(images)
        for same_shape in groups.values():
            for indices in self._within_budget(same_shape, images):
                for index, embeds in zip(indices, self._encode_group([images[i] for i in indices]), strict=True):
                    rows[index] = embeds
        return [r for r in rows if r is not None]

    def _within_budget(self, indices: list[int], images: list[ImageInput]) -> list[list[int]]:
        """`indices` in batches whose activations fit the encoder's budget (an image alone always
        runs: validation refused any that needs more)."""
        if self.budget is None:
            return [indices]
        batches: list[list[int]] = [[]]
        used = 0
        for index in indices:
            need = self.budget.bytes_for(images[index].pixel_values.numel())
            if batches[-1] and used + need > self.budget.reserved_bytes:
                batches.append([])
                used = 0
            batches[-1].append(index)
            used += need
        return batches

    def _encode_group(self, images: list[ImageInput]) -> list[torch.Tensor]:
        pixels = torch.cat([image.pixel_values for image in images]).to(self.device)
        extras = {key: torch.cat([image.extras[key] for image in images]).to(self.device) for key in images[0].extras}
        with torch.inference_mode():
            features: Any = self.inner.get_image_features(pixel_values=pixels.to(self.dtype), **extras)
        features = getattr(features, "pooler_output", features)
        sizes = [image.num_tokens for image in images]
        if isinstance(features, torch.Tensor):
            features = features.reshape(-1, features.shape[-1]).split(sizes)
        else:
            features = [f.reshape(-1, f.shape[-1]) for f in features]
        got = [f.shape[0] for f in features]
        if got != sizes:
            raise RuntimeError(f"the image encoder gave {got} rows for images of {sizes} placeholder tokens")
        return [f.to(self.dtype) for f in features]


def _shape_key(image: ImageInput) -> tuple:
    return (tuple(image.pixel_values.shape[1:]), tuple(sorted(image.extras)))
