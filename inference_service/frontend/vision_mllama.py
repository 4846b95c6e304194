"""Mllama's images: each image is one `<|image|>` token that stays in the prompt as a token (the
language model reads the image through cross-attention, not as embedding rows in its place). The
processor batches a prompt's images along axis 1 (pixel values [1, images, tiles, 3, H, W], aspect
ratio ids and masks) and says which prompt tokens see which image (cross_attention_mask [1, prompt,
images, tiles]); each image keeps its own slice of each, put back together by the runner."""

from __future__ import annotations

from typing import Any

from inference_service.frontend.vision_family import VisionFamily


class MllamaFamily(VisionFamily):
    def split(self, outputs: Any, runs: list[tuple[int, ...]]) -> list[tuple[Any, dict[str, Any]]] | None:
        """Image i's tiles, aspect ratio, and column of the cross-attention mask."""
        per_image = []
        for i in range(len(runs)):
            extras = {
                "aspect_ratio_ids": outputs["aspect_ratio_ids"][:, i : i + 1],
                "aspect_ratio_mask": outputs["aspect_ratio_mask"][:, i : i + 1],
                "cross_attention_mask": outputs["cross_attention_mask"][:, :, i : i + 1],
            }
            per_image.append((outputs["pixel_values"][:, i : i + 1], extras))
        return per_image
