"""The launched server as tests/e2e/test_hostile.py drives and watches it: its two ports, its gRPC
stub, its engine's stats and health, and, from /proc, what its processes (and Envoy's) use of the
machine: CPU by process and thread, resident memory. Kept apart from the tests so that the soak's
accounting reads on its own.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from pathlib import Path

import grpc

from tests.e2e.hostile_cases import Target
from tests.launched import Launched
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

READY = r"ready: TGI REST API on http://127\.0\.0\.1:(\d+), gRPC API on port (\d+)"


class Server:
    """`inference-service launch` on the tiny model with a chat template, and its two ports."""

    def __init__(self, run: Launched):
        self.run = run
        ready = run.wait_for(READY)
        self.target = Target(gateway_port=int(ready.group(1)), grpc_port=int(ready.group(2)))
        self.envoy_pid = int(run.wait_for(r"Envoy (\d+): REST on port").group(1))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.target.grpc_port}")
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)

    def stats(self):
        return self.stub.Info(pb.InfoRequest(), timeout=10).stats

    def wait_idle(self, timeout: float = 30):
        """Engine stats once nothing runs or waits and every KV block is free (or the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_total_blocks):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def health(self) -> int:
        import http.client

        connection = http.client.HTTPConnection("127.0.0.1", self.target.gateway_port, timeout=30)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status
        finally:
            connection.close()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes (all their threads) have used so far."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_by_thread(pids: list[int], api_pid: int) -> Counter:
    """CPU seconds used so far by the threads of the server's API process and its children (the engine
    core), by name (Python's own threads all bear the process's name, so the main one, the engine
    core's step loop, is told apart): where the server's time goes."""
    used: Counter = Counter()
    for pid in pids:
        process = "api" if pid == api_pid else f"child {Path(f'/proc/{pid}/cmdline').read_text()[-40:]!r}"
        if "resource_tracker" in process:
            continue
        process = "engine core" if process.startswith("child") and "forkserver" not in process else process
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                name = (task / "comm").read_text().strip().rstrip("0123456789_-")
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                niced = " (niced)" if int(fields[16]) > 0 else ""  # grammar compiles (sample/grammar.py)
                name = "main thread" if task.name == str(pid) else f"other {name}{niced}"
                used[f"{process}/{name}"] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def cpu_of(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: cpu_seconds(pids) for name, pids in groups.items()}


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += descendants(int(child))
    return found


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
