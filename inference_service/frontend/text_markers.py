"""Finding markers in text that arrives in pieces: a marker may be split across pieces."""

from __future__ import annotations

from collections.abc import Iterable


def held_back(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of `text` could begin one of `markers` (hold them until the
    next piece tells whether they do)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
