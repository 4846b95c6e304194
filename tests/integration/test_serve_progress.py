"""`inference-service serve` as a person sees it on a terminal (a pty): a bar per loading phase,
one summary line each with its time, and Ctrl-C ends it with exit 0 and no traceback."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUMMARIES = ("loaded weights in", "checked the paged attention in", "prepared the engine in", "warmed up in")


def read_until(fd: int, pattern: str, timeout_s: float = 180) -> str:
    """Everything the terminal shows until `pattern` appears (or the process closes it)."""
    text, deadline = "", time.monotonic() + timeout_s
    while not re.search(pattern, text) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the other side closed
                break
            if not chunk:
                break
            text += chunk.decode("utf-8", "replace")
    return text


def test_a_terminal_sees_bars_and_phase_times_and_ctrl_c_stops_it(tiny_model_dir):
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a window tqdm can draw in
    command = [sys.executable, "-m", "inference_service", "serve", "--model-id", str(tiny_model_dir)]
    command += ["--device", "cpu", "--hostname", "127.0.0.1", "--grpc-port", "0", "--prometheus-port", "0"]
    command += ["--max-total-tokens", "512", "--max-batch-total-tokens", "4096"]
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    try:
        shown = read_until(controller, r"serving \S+")
        assert re.search(r"loading weights:\s+\d+%\|", shown), shown  # tqdm's bar
        for summary in SUMMARIES:
            assert re.search(rf"{summary} \d+\.\ds", shown), shown
        process.send_signal(signal.SIGINT)
        shown += read_until(controller, r"INFO \S+: stopped\r?\n")
        assert process.wait(60) == 0, shown
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        os.close(controller)
    assert "Traceback" not in shown and "terminate called" not in shown
