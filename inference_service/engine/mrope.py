"""Multimodal rotary positions (M-RoPE) of Qwen2-VL and Qwen2.5-VL: every token has three
positions (time, height, width). Text tokens have the same one in all three, counting on from the
largest position before them; an image's tokens sit on its grid of merged patches, all starting
where the text before it stopped. Tokens after the prompt (generated, drafted) are at their
sequence index plus the prompt's `delta` in all three, as transformers' `get_rope_index` and
`rope_deltas` place them.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import isqrt

import torch

from inference_service.sampling_params import ImageInput

# Vision-language families whose language model reads three positions per token.
MROPE_ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class PromptPositions:
    """A prompt's three positions per token, and where the tokens after it go."""

    table: torch.Tensor  # [3, prompt_len]
    delta: int  # generated token at sequence index p: position p + delta in all three

    def of(self, start: int, count: int) -> torch.Tensor:
        """Positions of sequence indices [start, start + count): [3, count]."""
        prompt_len = self.table.shape[1]
        head = self.table[:, start : start + count]
        if start + count <= prompt_len:
            return head
        first_after = max(start, prompt_len)
        tail = torch.arange(first_after, start + count).add_(self.delta).expand(3, -1)
        return torch.cat([head, tail], dim=1)


def prompt_positions(prompt_len: int, images: tuple[ImageInput, ...]) -> PromptPositions:
    """The positions of a prompt whose images sit at their placeholders' indices, each with its
    processor's `image_grid_thw` (patches; `merge²` patches make one token)."""
    parts: list[torch.Tensor] = []
    next_position = 0  # the position the next text token takes
    text_start = 0
    for image in images:
        first = image.positions[0]
        if first > text_start:
            parts.append(torch.arange(next_position, next_position + first - text_start).expand(3, -1))
            next_position += first - text_start
        grid, merge = _grid_and_merge(image)
        t, h, w = grid[0], grid[1] // merge, grid[2] // merge
        time = torch.arange(t).view(-1, 1, 1).expand(t, h, w)
        height = torch.arange(h).view(1, -1, 1).expand(t, h, w)
        width = torch.arange(w).view(1, 1, -1).expand(t, h, w)
        parts.append(torch.stack([time, height, width]).reshape(3, -1) + next_position)
        next_position += max(h, w)
        text_start = image.positions[-1] + 1
    if prompt_len > text_start:
        parts.append(torch.arange(next_position, next_position + prompt_len - text_start).expand(3, -1))
    table = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    if table.shape[1] != prompt_len:
        raise ValueError(f"M-RoPE positions for {table.shape[1]} tokens of a {prompt_len}-token prompt")
    delta = int(table.max()) + 1 - prompt_len if prompt_len else 0
    return PromptPositions(table.contiguous(), delta)


def _grid_and_merge(image: ImageInput) -> tuple[list[int], int]:
    """The image's (t, h, w) patch grid, and the side of the square of patches merged per token."""
    grid_thw = image.extras.get("image_grid_thw")
    if grid_thw is None:
        raise ValueError("an M-RoPE model's image needs its processor's `image_grid_thw`")
    grid = [int(x) for x in grid_thw.reshape(-1).tolist()]
    patches_per_token, rest = divmod(grid[0] * grid[1] * grid[2], image.num_tokens)
    merge = isqrt(patches_per_token)
    if rest or merge * merge != patches_per_token or grid[1] % merge or grid[2] % merge:
        raise ValueError(f"an image grid {grid} does not make {image.num_tokens} tokens")
    return grid, merge
