"""Decode batches as CUDA graphs (`--cuda-graphs`, TGI's sizes 1, 2, 4, 8, 16, 32): which sizes
(pure functions) and the static-buffer decode that is captured and replayed (`StaticDecode`).

A graph replays a decode step captured for a fixed number of rows, so a batch runs at the next
captured size, its extra rows padding (they read block 0 and their outputs are dropped); a batch
larger than every captured size, and every step when the list is empty (`0`), runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from inference_service.worker.attention.kv_cache import PagedKVCache
from inference_service.worker.attention.step_metadata import StepMetadata
from inference_service.worker.attention.triton_paged import PagedLayout
from inference_service.worker.kernels.bindings import PagedDecodeKernel

logger = logging.getLogger(__name__)

# Blocks the KV cache holds beyond the block manager's pool for static decode: padding rows write there.
PADDING_BLOCKS = 1

# The ordinary forward of a step: (metadata, input ids [1, S], positions [1, S], rows to keep) → logits [K, V].
DecodeForward = Callable[[StepMetadata, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


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


def static_decode_sizes(cuda_graphs: tuple[int, ...], device_type: str, sharded: bool) -> tuple[int, ...]:
    """The batch sizes decode steps are captured at: `--cuda-graphs`' on one CUDA device; none with
    `--cuda-graphs 0`, on CPU (padding would only add work there) or with shards (their NCCL
    collectives are not captured)."""
    return cuda_graphs if device_type == "cuda" and not sharded else ()


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


class StaticDecode:
    """Decode-only steps over static buffers padded to a captured batch size: on CUDA each size's
    forward is captured once with `torch.cuda.graph` and replayed (one launch instead of hundreds);
    elsewhere (`capture=False`) the same buffer code runs eagerly, which is how it is tested on CPU.

    The buffers (ids, positions, slots, block tables, context lengths) hold the largest size; a
    size's step reads their first `size` rows. Padding rows are token 0 at position 0 writing its
    K/V into `padding_block` (the KV cache's last block, which the block manager never hands out)
    and attending over that one slot; their logits are dropped. A step the buffers can't hold (more
    rows than the largest size, a longer block table) runs the ordinary path.
    """

    def __init__(
        self,
        forward: DecodeForward,
        kv_cache: PagedKVCache,
        decode_kernel: PagedDecodeKernel | None,
        sizes: tuple[int, ...],
        max_blocks_per_seq: int,
        capture: bool,
    ):
        """`kv_cache`: allocated one block larger than the block manager's pool (`PADDING_BLOCKS`)."""
        if not sizes:
            raise ValueError("static decode needs at least one batch size")
        self.forward = forward
        self.kv_cache = kv_cache
        self.decode_kernel = decode_kernel
        self.sizes = sizes
        self.capture = capture
        self.padding_block = kv_cache.num_blocks - PADDING_BLOCKS
        device = kv_cache.keys[0].device
        block_size = kv_cache.block_size
        largest = sizes[-1]
        self.input_ids = torch.zeros(1, largest, dtype=torch.long, device=device)  # [1, B]
        self.positions = torch.zeros(1, largest, dtype=torch.long, device=device)  # [1, B]
        self.slots = torch.zeros(largest, dtype=torch.long, device=device)  # [B]
        self.block_table = torch.zeros(largest, max_blocks_per_seq, dtype=torch.long, device=device)  # [B, NB]
        self.context_lens = torch.ones(largest, dtype=torch.long, device=device)  # [B]
        self.token_index = torch.arange(largest, dtype=torch.long, device=device)  # [B]
        # The Triton kernel's layout of the same rows (int32), kept in step with the buffers above:
        # built per step from them it would read the longest query back to the host, which a
        # capture forbids.
        self.gpu_layout = PagedLayout(
            q_start=self.token_index.to(torch.int32),
            q_len=torch.ones(largest, dtype=torch.int32, device=device),
            seq_lens=self.context_lens.to(torch.int32),
            block_table=self.block_table.to(torch.int32),
            max_q_len=1,
        )
        self._padding_slot = self.padding_block * block_size
        self._graphs: dict[int, tuple[Any, torch.Tensor, int]] = {}  # size → (graph, its logits [B, V], calls)
        self._failed: set[int] = set()  # sizes whose capture failed: they run eagerly
        self._pool: Any = None  # one memory pool shared by every size's graph
        self.steps_by_size: Counter[int] = Counter()  # decode steps run here, by padded size

    def takes(self, meta: StepMetadata, input_ids: torch.Tensor) -> bool:
        """Whether this step runs here: decode-only, at most the largest size, its tables fit."""
        table = meta.decode_block_table
        return (
            meta.decode_only
            and table is not None
            and input_ids.shape[1] <= self.sizes[-1]
            and table.shape[1] <= self.block_table.shape[1]
        )

    def run(
        self, meta: StepMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor, keep_rows: list[int]
    ) -> torch.Tensor:
        """The step's logits of `keep_rows` ([K, V] fp32), computed at the padded size."""
        num_rows = input_ids.shape[1]
        size = graph_batch_size(num_rows, self.sizes)
        if size is None:
            raise ValueError(f"{num_rows} rows exceed the largest static batch {self.sizes[-1]}")
        self._fill(meta, input_ids, position_ids, num_rows, size)
        self.steps_by_size[size] += 1
        if self.capture and size not in self._failed:
            captured = self._graphs.get(size) or self._capture(size)
            if captured is not None:
                graph, logits, calls = captured
                graph.replay()
                meta.num_calls = calls
                return logits[torch.tensor(keep_rows, dtype=torch.long, device=logits.device)]
        static = self._meta(size)
        logits = self.forward(static, self.input_ids[:, :size], self.positions[:, :size], list(range(size)))
        meta.num_calls = static.num_calls
        return logits[torch.tensor(keep_rows, dtype=torch.long, device=logits.device)]

    def _fill(
        self, meta: StepMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor, num_rows: int, size: int
    ) -> None:
        """The step's rows into the buffers' first `num_rows`, padding rows after them up to `size`."""
        table, lens = meta.decode_block_table, meta.decode_context_lens
        if table is None or lens is None:
            raise ValueError("a decode step needs its block tables and context lengths")
        self.input_ids[0, :num_rows].copy_(input_ids[0], non_blocking=True)
        self.input_ids[0, num_rows:size].zero_()
        self.positions[0, :num_rows].copy_(position_ids[0], non_blocking=True)
        self.positions[0, num_rows:size].zero_()
        self.slots[:num_rows].copy_(meta.slot_mapping, non_blocking=True)
        self.slots[num_rows:size].fill_(self._padding_slot)
        self.block_table[:size].fill_(self.padding_block)
        self.block_table[:num_rows, : table.shape[1]].copy_(table, non_blocking=True)
        self.context_lens[:num_rows].copy_(lens, non_blocking=True)
        self.context_lens[num_rows:size].fill_(1)
        if self.capture:
            self.gpu_layout.seq_lens[:size].copy_(self.context_lens[:size])
            self.gpu_layout.block_table[:size].copy_(self.block_table[:size])

    def _meta(self, size: int) -> StepMetadata:
        """A fresh step metadata over the buffers' first `size` rows (masks and layouts are per step)."""
        meta = StepMetadata(
            kv_cache=self.kv_cache,
            num_tokens=size,
            slot_mapping=self.slots[:size],
            decode_token_index=self.token_index[:size],
            decode_block_table=self.block_table[:size],
            decode_context_lens=self.context_lens[:size],
            decode_only=True,
            decode_kernel=self.decode_kernel,
        )
        if self.capture:
            layout = self.gpu_layout
            meta.gpu_layouts["decode"] = PagedLayout(
                layout.q_start[:size], layout.q_len[:size], layout.seq_lens[:size], layout.block_table[:size], 1
            )
        return meta

    def _capture(self, size: int) -> tuple[Any, torch.Tensor, int] | None:
        """Capture `size`'s forward (after eager warm-up runs on a side stream, as torch requires);
        None, logged, when capture fails: that size then runs eagerly."""
        static = self._meta(size)
        ids, positions, rows = self.input_ids[:, :size], self.positions[:, :size], list(range(size))
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward(self._meta(size), ids, positions, rows)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.forward(static, ids, positions, rows)
            self._pool = graph.pool()
        except RuntimeError as error:  # an op that cannot be captured (torch.cuda.CudaError is one too)
            logger.warning("CUDA graph capture of decode batch %d failed, it runs eagerly: %s", size, error)
            self._failed.add(size)
            return None
        self._graphs[size] = (graph, logits, static.num_calls)
        return self._graphs[size]


def blocks_per_sequence(max_total_tokens: int, speculate: int, block_size: int) -> int:
    """The widest block table a decode row can have (its tokens, guesses included); wider: eager."""
    return -(-(max_total_tokens + speculate + 1) // block_size)
