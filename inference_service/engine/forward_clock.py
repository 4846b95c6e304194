"""How long a step's forward pass took, without adding a device synchronization."""

from __future__ import annotations

import time

import torch


class ForwardClock:
    """The forward pass's duration: wall clock on CPU; CUDA events on a GPU, read once sampling has
    synchronized anyway, so timing adds no synchronization of its own."""

    def __init__(self, device: torch.device):
        self._device = device
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._started = self._stopped = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()
        if self._events is not None:
            self._events[0].record(torch.cuda.current_stream(self._device))

    def stop(self) -> None:
        self._stopped = time.perf_counter()
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self._device))

    def seconds(self) -> float:
        if self._events is None:
            return self._stopped - self._started
        self._events[1].synchronize()  # done already unless the step sampled nothing
        return self._events[0].elapsed_time(self._events[1]) / 1000
