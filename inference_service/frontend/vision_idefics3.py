"""Idefics3's (and SmolVLM's) images: the processor splits an image into tiles plus a downscaled
global image; each tile's `<image>` tokens follow its own `<row_i_col_j>` (or `<global-img>`) text
tag, so one image's embedding rows sit in several runs with text between them. The global tile comes
last in each image. Pixel values come as one [1, tiles of all images, 3, H, W] tensor (with its
`pixel_attention_mask`), cut here into each image's tiles."""

from __future__ import annotations

from typing import Any

from inference_service.frontend.vision_family import VisionFamily, runs_of

GLOBAL_IMAGE_TAG = "<global-img>"


class Idefics3Family(VisionFamily):
    def __init__(self, processor: Any):
        super().__init__(processor)
        # Idefics3's processor names it `global_image_tag`, SmolVLM's `global_image_token`.
        tag = getattr(processor, "global_image_token", None) or getattr(processor, "global_image_tag", GLOBAL_IMAGE_TAG)
        self.global_tag_id: int = processor.tokenizer.convert_tokens_to_ids(tag)
        self.tile_tokens: int = processor.image_seq_len

    def image_runs(self, token_ids: list[int], token_id: int, num_images: int) -> list[tuple[int, ...]]:
        """Each image's positions over all its tiles: its runs up to the one after `<global-img>`."""
        images: list[tuple[int, ...]] = []
        current: list[int] = []
        for run in runs_of(token_ids, token_id):
            current += run
            if run[0] > 0 and token_ids[run[0] - 1] == self.global_tag_id:
                images.append(tuple(current))
                current = []
        return images + ([tuple(current)] if current else [])

    def split(self, outputs: Any, runs: list[tuple[int, ...]]) -> list[tuple[Any, dict[str, Any]]] | None:
        """Each image's tiles ([1, tiles, 3, H, W]) and pixel mask: a tile per `image_seq_len` rows."""
        pixels, mask = outputs["pixel_values"][0], outputs.get("pixel_attention_mask")
        per_image, start = [], 0
        for run in runs:
            tiles = len(run) // self.tile_tokens
            extras = {"pixel_attention_mask": mask[0, start : start + tiles][None]} if mask is not None else {}
            per_image.append((pixels[start : start + tiles][None], extras))
            start += tiles
        return per_image
