"""Which decode batches run as CUDA graphs (`--cuda-graphs`, TGI's sizes 1, 2, 4, 8, 16, 32): the
device-independent part, so it is tested without a GPU.

A graph replays a decode step captured for a fixed number of rows, so a batch runs at the next
captured size, its extra rows padding (they read block 0 and their outputs are dropped); a batch
larger than every captured size, and every step when the list is empty (`0`), runs eagerly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def graph_batch_size(num_rows: int, sizes: tuple[int, ...]) -> int | None:
    """The captured size a decode batch of `num_rows` runs at (the smallest one that holds it);
    None: no captured size does, the step runs without a graph. `sizes` sorted ascending."""
    if num_rows < 1:
        raise ValueError(f"a decode batch has at least one row, not {num_rows}")
    index = bisect.bisect_left(sizes, num_rows)
    return sizes[index] if index < len(sizes) else None


@dataclass(frozen=True)
class PaddedBatch:
    """How a decode batch of `num_rows` runs: at `size` rows (`size - num_rows` of them padding) in
    the graph captured for that size, or eagerly at its own size when `graph` is False."""

    num_rows: int
    size: int
    graph: bool

    @property
    def padding(self) -> int:
        return self.size - self.num_rows


def plan_decode_batch(num_rows: int, sizes: tuple[int, ...], device_type: str) -> PaddedBatch:
    """The padded batch for a decode step: graphs on CUDA only, at the sizes `--cuda-graphs` lists."""
    size = graph_batch_size(num_rows, sizes) if device_type == "cuda" else None
    if size is None:
        return PaddedBatch(num_rows, num_rows, False)
    return PaddedBatch(num_rows, size, True)


def pad_rows(values: list[int], size: int, fill: int) -> list[int]:
    """`values` (one per row) padded to `size` rows with `fill` (a padding row's slot, length, id)."""
    if len(values) > size:
        raise ValueError(f"{len(values)} rows do not fit a batch of {size}")
    return values + [fill] * (size - len(values))
