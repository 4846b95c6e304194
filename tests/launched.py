"""`inference-service launch` as a child process for tests, its log lines collected as they come."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

START_TIMEOUT_S = 120


def whole_line(line: str) -> str | None:
    return line


class Launched:
    """A running `inference-service launch` on the model in `model_dir`, loopback and free ports.

    `message_of` maps a log line to the text patterns are searched in (None: skip the line); with
    `--json-output`, for instance, to the entry's message.
    """

    def __init__(
        self,
        model_dir: Path,
        *extra_args: str,
        message_of: Callable[[str], str | None] = whole_line,
        env: dict[str, str] | None = None,
    ):
        command = [
            str(Path(sys.executable).with_name("inference-service")),
            "launch",
            "--model-id",
            str(model_dir),
            "--device",
            "cpu",
            "--hostname",
            "127.0.0.1",
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--max-total-tokens",
            "512",
            "--max-batch-total-tokens",
            "4096",
            "--graceful-termination-timeout",
            "5",
            *extra_args,
        ]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.lines: list[str] = []
        self._message_of = message_of
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line.rstrip())

    def matches(self, pattern: str) -> list[re.Match]:
        messages = (self._message_of(line) for line in list(self.lines))
        return [match for message in messages if message is not None and (match := re.search(pattern, message))]

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = START_TIMEOUT_S) -> re.Match:
        """The `count`-th log line matching `pattern`, once it is there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.matches(pattern)
            if len(found) >= count:
                return found[count - 1]
            if self.process.poll() not in (None, 0):
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} (x{count}) in the log:\n{self.log()}")

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
