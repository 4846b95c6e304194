"""How a vision-language family's processor output maps to images: which token stands for an
image's embedding rows, where each image's run(s) of them are, each image's own pixel tensors, and
which tokens attend both ways. The default fits LLaVA-style processors (one run of the processor's
`image_token` per image, one batch entry of pixels per image, causal attention); a family that
differs has its own module beside this one.
"""

from __future__ import annotations

from typing import Any


class VisionFamily:
    """LLaVA's (and LLaVA-NeXT's) layout, for the model's `processor`."""

    def __init__(self, processor: Any):
        self.processor = processor

    def placeholder_id(self) -> int:
        """The token id each of an image's embedding rows replaces."""
        return self.processor.tokenizer.convert_tokens_to_ids(self.processor.image_token)

    def image_runs(self, token_ids: list[int], token_id: int, num_images: int) -> list[tuple[int, ...]]:
        """Each image's positions: maximal runs of `token_id`, one per image."""
        return runs_of(token_ids, token_id)

    def split(self, outputs: Any, runs: list[tuple[int, ...]]) -> list[tuple[Any, dict[str, Any]]] | None:
        """Each image's pixel values and per-image extras; None: the processor's batch has one
        entry per image (or Qwen2-VL's packed patches), cut the usual way."""
        return None

    def both_way_spans(self, outputs: Any, runs: list[tuple[int, ...]]) -> list[tuple[int, int] | None]:
        """Per image, the prompt span it attends both ways in (None: causal)."""
        return [None] * len(runs)


def runs_of(token_ids: list[int], token_id: int) -> list[tuple[int, ...]]:
    """Maximal runs of `token_id`."""
    runs: list[tuple[int, ...]] = []
    current: list[int] = []
    for position, token in enumerate(token_ids):
        if token == token_id:
            current.append(position)
        elif current:
            runs.append(tuple(current))
            current = []
    if current:
        runs.append(tuple(current))
    return runs
