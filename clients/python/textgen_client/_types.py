"""Type aliases the client's modules share (a module of its own, so that they import it, not each other)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Call metadata as the caller passes it: a mapping or (key, value) pairs.
Metadata = Mapping[str, str] | Sequence[tuple[str, str]]
