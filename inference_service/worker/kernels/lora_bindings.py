"""The native LoRA kernel (`csrc/lora_sgmv.cpp`): a step's rows grouped by adapter, each group's
shrink and expand added into one projection's output in a single call (SGMV; one row: BGMV).

Built like the other native kernels (bindings._build: the machine's C++ compiler, cached on disk) as
its own small library; the same switch (`INFERENCE_SERVICE_CPU_KERNELS=off`) and a failed build leave
the torch path of worker/lora/linear.py, which computes the same thing.

The arrays it reads are int64 tensors of C structs, made once and reused: an adapter's table (one
`Entry` per site), a step's groups (`Group`) and a projection's parts (`Part`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from inference_service.worker.kernels import bindings
from inference_service.worker.kernels.native_build import native_address

logger = logging.getLogger(__name__)

SOURCES = (bindings.CSRC / "lora_sgmv.cpp",)
ENTRY_WORDS = 4  # Entry: a pointer, b pointer, rank, (scale fp32, padding)
GROUP_WORDS = 4  # Group: table pointer, table length, first and end position in the rows
PART_WORDS = 3  # Part: site, first column in y, width
MAX_RANK = 1024  # the kernel's bound (csrc/lora_sgmv.cpp kMaxRank)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def entry_table(entries: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> torch.Tensor:
    """An adapter's table: per site (a [rank, in], b [rank, out], scale), or None where it has none.
    The tensors must stay alive (and in place) as long as the table is used."""
    table = torch.zeros(len(entries), ENTRY_WORDS, dtype=torch.int64)
    for site, entry in enumerate(entries):
        if entry is None:
            continue
        a, b, scale = entry
        scale_bits = int(torch.tensor([scale], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF
        table[site] = torch.tensor([a.data_ptr(), b.data_ptr(), a.shape[0], scale_bits], dtype=torch.int64)
    return table


def group_table(groups: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """A step's groups: (adapter table, first position, end position) each."""
    rows = [[table.data_ptr(), table.shape[0], start, end] for table, start, end in groups]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(groups), GROUP_WORDS)


def part_table(parts: list[tuple[int, int, int]]) -> torch.Tensor:
    """A projection's parts: (site, first column in y, width) each."""
    return torch.tensor(parts, dtype=torch.int64).reshape(len(parts), PART_WORDS)


class LoraKernel:
    """y[rows, parts' columns] += each group's LoRA update of x, fp32 on CPU."""

    def __init__(self, library: ctypes.CDLL):
        self._sgmv = bindings._bind(library, "lora_sgmv_f32", [_P, _I64, _P, _I64, _P, _P, _I64, _P, _I64, _I64])
        self._bgmv = bindings._bind(library, "lora_bgmv_f32", [_P, _I64, _P, _P, _I64, _P, _I64])
        self._panel_row = bindings._bind(
            library, "lora_panel_row_f32", [_P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _I64]
        )
        # The ctypes functions themselves, for a caller that binds a step's arguments once and checks
        # the status itself (lora/decode.py: four calls per layer of every decode step).
        self.sgmv_raw, self.bgmv_raw, self.panel_row_raw = self._sgmv, self._bgmv, self._panel_row
        # Their addresses, for native code that calls them (kernels/decode_layers.py's fused layers).
        self.addresses = tuple(native_address(f) for f in (self._sgmv, self._bgmv, self._panel_row))
        self._force_threads = bindings._bind(library, "lora_force_threads", [ctypes.c_int])

    def force_threads(self, mode: int) -> int:
        """How decode-sized calls run: 0 several rows on the team and a single row inline (the
        default), 1 always one thread, 2 always the team; returns the previous mode."""
        previous = self._force_threads(mode)
        if previous < 0:
            raise ValueError(f"no thread mode {mode}")
        return previous

    @staticmethod
    def supports(x: torch.Tensor, y: torch.Tensor) -> bool:
        """x [T, in] and y [T, out] fp32 on CPU, rows contiguous, `in` a multiple of 8 (the device is
        the plan's to check, once per step)."""
        return (
            x.dtype is torch.float32
            and y.dtype is torch.float32
            and x.dim() == 2
            and y.dim() == 2
            and x.is_contiguous()
            and y.stride(1) == 1
            and x.shape[1] % 8 == 0
        )

    def sgmv(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        rows: torch.Tensor | None,
        groups: torch.Tensor,
        parts: int,
        num_parts: int,
        max_rank: int,
    ) -> None:
        """`rows` [R] int64: the step's row of each position the groups name (None: position = row);
        `parts` the address of `num_parts` Parts (part_table)."""
        status = self._sgmv(
            x.data_ptr(),
            x.shape[1],
            y.data_ptr(),
            y.stride(0),
            rows.data_ptr() if rows is not None else None,
            groups.data_ptr(),
            groups.shape[0],
            parts,
            num_parts,
            max_rank,
        )
        if status != 0:
            raise RuntimeError(f"LoRA kernel refused x {list(x.shape)} (rank up to {max_rank})")

    def bgmv(self, x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, parts: int, num_parts: int) -> None:
        """One row: x [1, in], y [1, out], one adapter's table; `parts` as in sgmv."""
        status = self._bgmv(x.data_ptr(), x.shape[1], y.data_ptr(), table.data_ptr(), table.shape[0], parts, num_parts)
        if status != 0:
            raise RuntimeError(f"LoRA kernel refused x {list(x.shape)}")

    def panel_row(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        bias: torch.Tensor | None,
        table: torch.Tensor,
        parts: int,
        num_parts: int,
    ) -> torch.Tensor:
        """One row's projection and its LoRA update in one call: x [1, in] · W + bias + the update of
        `table`'s adapter over `parts` (as in sgmv) → y [1, out], W as panels [out / 32, in, 32]
        (linears/panelled.py)."""
        count, k, width = panels.shape
        y = torch.empty(1, count * width)
        status = self._panel_row(
            x.data_ptr(),
            k,
            panels.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            count * width,
            table.data_ptr(),
            table.shape[0],
            parts,
            num_parts,
        )
        if status != 0:
            raise RuntimeError(f"LoRA kernel refused x {list(x.shape)} over panels {list(panels.shape)}")
        return y


@functools.cache
def load_lora_kernel() -> LoraKernel | None:
    """The kernel, built once per machine and source; None (torch path) when switched off or unbuildable."""
    if bindings._switched_off():
        return None
    try:
        return LoraKernel(ctypes.CDLL(str(bindings._build(SOURCES))))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        logger.warning("native LoRA kernel unavailable, using the torch path: %s", error)
        return None
