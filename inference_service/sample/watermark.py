"""Kirchenbauer et al. watermark ("A Watermark for Large Language Models", arXiv:2301.10226), as TGI.

The previous token seeds a CPU `torch.Generator` with `HASH_KEY * previous_token_id`; the first
`int(vocab_size * gamma)` ids of `randperm(vocab_size)` form the greenlist, whose logits get
`+delta`. A detector that knows gamma and the hash key recomputes the same greenlists from the
text. The generator is always on CPU so the greenlists do not depend on the serving device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

HASH_KEY = 15485863  # a large prime, as TGI: gives seeds of sufficient bit width


class Watermark:
    """Biases each row's greenlist, chosen by that row's previous token."""

    def __init__(self, vocab_size: int, gamma: float, delta: float) -> None:
        self.vocab_size = vocab_size
        self.greenlist_size = int(vocab_size * gamma)
        self.delta = delta
        self._generator = torch.Generator(device="cpu")

    def greenlist(self, previous_token_id: int) -> Tensor:
        """The green token ids after `previous_token_id`."""
        self._generator.manual_seed(HASH_KEY * previous_token_id)
        permutation = torch.randperm(self.vocab_size, generator=self._generator)  # [V]
        return permutation[: self.greenlist_size]  # [G]

    def apply(self, logits: Tensor, previous_token_ids: Sequence[int]) -> Tensor:
        """Add `delta` to each row's greenlist; `logits` is `[W, V]`, one previous token per row."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, the watermark {self.vocab_size}")
        green_ids = torch.stack([self.greenlist(t) for t in previous_token_ids])  # [W, G]
        bias = torch.full(green_ids.shape, self.delta, dtype=logits.dtype, device=logits.device)  # [W, G]
        return logits.scatter_add(1, green_ids.to(logits.device), bias)  # [W, V]
