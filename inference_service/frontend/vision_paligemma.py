"""PaliGemma's images: every image's tokens come first, back to back (one run of `<image>` holds
them all, `image_seq_length` each), then BOS and the text. The whole prompt is a prefix that attends
both ways (prefix-LM: `token_type_ids` 0); generated tokens are causal."""

from __future__ import annotations

from typing import Any

from inference_service.frontend.vision_family import VisionFamily, runs_of


class PaliGemmaFamily(VisionFamily):
    def image_runs(self, token_ids: list[int], token_id: int, num_images: int) -> list[tuple[int, ...]]:
        positions = [p for run in runs_of(token_ids, token_id) for p in run]
        if not num_images or len(positions) % num_images:
            return runs_of(token_ids, token_id)  # the caller reports the mismatch
        size = len(positions) // num_images
        return [tuple(positions[i * size : (i + 1) * size]) for i in range(num_images)]

    def both_way_spans(self, outputs: Any, runs: list[tuple[int, ...]]) -> list[tuple[int, int] | None]:
        types = outputs.get("token_type_ids")
        prefix = int((types[0] == 0).sum()) if types is not None else len(outputs["input_ids"][0])
        return [(0, prefix)] * len(runs)
