"""Gemma 3's images: the prompt's `<start_of_image>` expands to `<start_of_image>`, one soft token
per embedding row and `<end_of_image>`; the soft tokens of one image attend to each other both ways
(transformers' `token_type_ids` blocks), text stays causal."""

from __future__ import annotations

from typing import Any

from inference_service.frontend.vision_family import VisionFamily


class Gemma3Family(VisionFamily):
    def placeholder_id(self) -> int:
        return self.processor.tokenizer.image_token_id  # the soft token, not the prompt's `image_token`

    def both_way_spans(self, outputs: Any, runs: list[tuple[int, ...]]) -> list[tuple[int, int] | None]:
        return [(run[0], run[-1] + 1) for run in runs]
