"""`inference-service launch` as a child process on loopback and free ports, as a user runs it:
the load generator then measures the real server and the real Envoy, not an in-process copy."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

READY = re.compile(r"ready: TGI REST API on (http://\S+), gRPC API on port (\d+)")


class LaunchError(RuntimeError):
    """The server did not come up; the message ends with its last log lines."""


class LaunchedServer:
    """Starts on construction; `rest_url` and `grpc_target` once ready; `stop()` sends SIGTERM."""

    def __init__(
        self,
        model_id: str,
        server_args: list[str],
        log_path: Path,
        start_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
    ):
        command = [
            str(Path(sys.executable).with_name("inference-service")),
            "launch",
            "--model-id",
            model_id,
            "--hostname",
            "127.0.0.1",
            "--port",
            "0",
            "--grpc-port",
            "0",
            *server_args,
        ]
        self.command = shlex.join(["inference-service", *command[1:]])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        self._tail: deque[str] = deque(maxlen=40)
        self._ready = threading.Event()
        self.rest_url = ""
        self.grpc_target = ""
        # Its own process group: if it must be killed, its Envoy goes with it.
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},  # extra variables: an A/B of the server's environment
        )
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        self._wait_ready(start_timeout_s)

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self._log.write(line)
            self._tail.append(line.rstrip())
            match = READY.search(line)
            if match and not self._ready.is_set():
                self.rest_url, self.grpc_target = match.group(1), f"127.0.0.1:{match.group(2)}"
                self._ready.set()
        self._log.flush()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                reason = (
                    f"exited with code {self.process.returncode}"
                    if self.process.returncode is not None
                    else f"not ready within {timeout_s:.0f}s"
                )
                raise LaunchError(f"`{self.command}` {reason}:\n" + "\n".join(self._tail))

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the server drains, then Envoy stops); SIGKILL if it takes too long."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._reader.join(10)
        return self.process.returncode

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        if not self._reader.is_alive():
            self._log.close()
