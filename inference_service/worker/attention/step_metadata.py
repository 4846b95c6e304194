"""What every attention call of one step reads: the step's rows, cache slots and block tables.

ModelRunner builds a `StepMetadata` once per step; the attention paths (attention/paged.py, the
decode plan) read it, from a contextvar where transformers' layers call us. The GPU kernels' view of
the same sequences (`gpu_layout`) is built from it once per step.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F

from inference_service.worker.attention.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from inference_service.worker.attention.triton_paged import PagedLayout
    from inference_service.worker.kernels.bindings import PagedDecodeKernel


@dataclass
class PrefillChunk:
    """A sequence running more than one token this step: packed rows [token_start, +num_new)."""

    token_start: int
    num_new: int
    num_computed: int
    context_slots: torch.Tensor  # [num_computed + num_new] cache slots of the whole context
    # Position spans [start, end) whose tokens attend to each other both ways (image tokens of
    # PaliGemma's prefix or of a Gemma 3 image); the scheduler never ends a chunk inside one.
    both_way_spans: tuple[tuple[int, int], ...] = ()


@dataclass
class StepMetadata:
    """Everything the attention function needs for one forward pass, built once per step."""

    kv_cache: PagedKVCache | None
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] cache slot of each packed token
    decode_token_index: torch.Tensor | None = None  # [Sd] packed rows of one-token sequences
    decode_block_table: torch.Tensor | None = None  # [Sd, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [Sd] tokens each attends over, new one included
    decode_only: bool = False  # every row is a decode, in order: no scatter needed
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_kernel: PagedDecodeKernel | None = None  # reads the cache in place; None: gather + SDPA
    # Filled while running: masks per window value, calls per layer (the load-time probe counts them).
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    num_calls: int = 0
    recorded_shapes: dict[int, tuple[int, int, torch.dtype]] | None = None  # shape probe mode
    gpu_layouts: dict[str, PagedLayout] = field(default_factory=dict)  # the Triton kernel's, built once a step


_STEP: contextvars.ContextVar[StepMetadata | None] = contextvars.ContextVar("paged_step", default=None)


@contextlib.contextmanager
def step_context(meta: StepMetadata) -> Iterator[StepMetadata]:
    token = _STEP.set(meta)
    try:
        yield meta
    finally:
        _STEP.reset(token)


def current_step() -> StepMetadata | None:
    """The metadata of the step running in this context (None outside a step)."""
    return _STEP.get()


_T = TypeVar("_T")


def needed(value: _T | None, what: str) -> _T:
    """`value`, which this step's metadata must have set."""
    if value is None:
        raise RuntimeError(f"the step's metadata has no {what}")
    return value


def gpu_layout(meta: StepMetadata, which: str) -> PagedLayout:
    """The step's sequences as the Triton kernel reads them, built once per step: "decode" for q
    holding the decode rows in order, "step" for q holding every packed row."""
    layout = meta.gpu_layouts.get(which)
    if layout is not None:
        return layout
    from inference_service.worker.attention.triton_paged import PagedLayout

    block_size = needed(meta.kv_cache, "KV cache").block_size
    device = meta.slot_mapping.device
    starts: list[torch.Tensor] = []
    lens: list[torch.Tensor] = []
    contexts: list[torch.Tensor] = []
    tables: list[torch.Tensor] = []
    if meta.decode_block_table is not None:
        context_lens = needed(meta.decode_context_lens, "decode context lengths")
        rows = context_lens.shape[0]
        index = needed(meta.decode_token_index, "decode rows") if which == "step" else None
        starts.append(index if index is not None else torch.arange(rows, device=device))
        lens.append(torch.ones(rows, dtype=torch.long, device=device))
        contexts.append(context_lens)
        tables.append(meta.decode_block_table)
    if which == "step":
        for chunk in meta.prefills:
            starts.append(torch.tensor([chunk.token_start], device=device))
            lens.append(torch.tensor([chunk.num_new], device=device))
            contexts.append(torch.tensor([chunk.num_computed + chunk.num_new], device=device))
            tables.append((chunk.context_slots[::block_size] // block_size)[None, :])
    width = max(t.shape[1] for t in tables)
    table = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
    q_len = torch.cat(lens)
    layout = PagedLayout(
        q_start=torch.cat(starts).to(torch.int32),
        q_len=q_len.to(torch.int32),
        seq_lens=torch.cat(contexts).to(torch.int32),
        block_table=table.to(torch.int32).contiguous(),
        max_q_len=int(q_len.max()),
    )
    meta.gpu_layouts[which] = layout
    return layout
