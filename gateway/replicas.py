"""Engine replicas for `launch --num-replicas N`: N `inference-service serve` processes, one gRPC port
and a share of the CPU threads each, supervised.

A replica that dies is started again on the same port (Envoy's cluster lists fixed endpoints; its
active health checks take the replica out while it is down and back once it serves), at most
`MAX_RESTARTS` times within `RESTART_WINDOW_S`; after that it stays down and the others carry on.
Each replica gets SIGTERM if the launcher dies without stopping it (as Envoy does), so a killed
launcher leaves no engine holding a port or memory. Each runs in its own process group, so a Ctrl-C
in a terminal reaches the launcher only, which passes stop signals on one at a time (a second one
stops a replica at once: two at the same moment would cut its drain short).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inference_service.flags import SERVE_FLAGS, args_for

API_KEY_ENV = next(flag.env for flag in SERVE_FLAGS if flag.name == "--api-key")

logger = logging.getLogger("gateway.replicas")

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
STALE_S = 5.0  # longer than Envoy takes to see a replica die (2 failed checks, 1 s apart)


@dataclass
class Replica:
    index: int
    port: int
    process: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def free_port(host: str) -> int:
    """A port nothing listens on now (the replica binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def threads_per_replica(num_threads: int | None, num_replicas: int) -> int:
    """The torch threads each replica gets: the configured total (else every core) shared out."""
    total = num_threads or os.cpu_count() or 1
    return max(1, total // num_replicas)


class ReplicaSet:
    """Starts, watches and stops the replicas; `ports` is what Envoy's cluster lists."""

    def __init__(self, engine_config, server_config, num_replicas: int, upstream_host: str):
        if num_replicas < 2:
            raise ValueError("a replica set has at least 2 replicas (1 runs in the launcher's process)")
        threads = threads_per_replica(engine_config.model.num_threads, num_replicas)
        base = server_config.grpc_port
        ports = [free_port(upstream_host) if base == 0 else base + i for i in range(num_replicas)]
        self.replicas = [Replica(i, port) for i, port in enumerate(ports)]
        self._engine_config, self._server_config = engine_config, server_config
        self._threads = threads
        self._upstream_host = upstream_host
        self._stopping = False

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(r.port for r in self.replicas)

    def command(self, replica: Replica) -> list[str]:
        args = args_for(self._engine_config, self._server_config, SERVE_FLAGS)
        # The replica's own gRPC port, thread share and metrics port (the configured one + its index,
        # or any free one with 0), for Prometheus to scrape each replica.
        metrics_port = self._server_config.prometheus_port
        for name in ("--grpc-port", "--prometheus-port", "--num-threads", "--api-key", "--master-port"):
            args = _without(args, name)  # the key goes in the environment, out of sight of ps
        if self._engine_config.model.device.startswith("cuda"):  # cuda:N → its own GPU, seen as cuda
            args = [*_without(args, "--device"), "--device", "cuda"]
        args += [
            "--grpc-port",
            str(replica.port),
            "--num-threads",
            str(self._threads),
            "--prometheus-port",
            str(metrics_port + replica.index if metrics_port else 0),
            "--master-port",  # each replica's shards meet on their own port
            str(self._engine_config.model.master_port + replica.index),
        ]
        serve = [sys.executable, "-m", "inference_service", "serve", *args]
        setpriv = shutil.which("setpriv")
        return [setpriv, "--pdeathsig", "TERM", *serve] if setpriv else serve

    def environment(self, replica: Replica, environ: dict[str, str] | None = None) -> dict[str, str]:
        """The replica's environment: the launcher's, without the server's flag variables (its
        command line carries the settings), the API key (which a command line would show to
        everyone), and on CUDA one GPU of its own: the replica's index among the visible GPUs."""
        environ = dict(os.environ) if environ is None else environ
        env = {k: v for k, v in environ.items() if k not in {flag.env for flag in SERVE_FLAGS}}
        if self._server_config.api_key:
            env[API_KEY_ENV] = self._server_config.api_key
        if self._engine_config.model.device.startswith("cuda"):
            visible = environ.get("CUDA_VISIBLE_DEVICES")
            gpus = visible.split(",") if visible else [str(i) for i in range(len(self.replicas))]
            env["CUDA_VISIBLE_DEVICES"] = gpus[replica.index % len(gpus)]
        return env

    def start(self, replica: Replica) -> None:
        replica.process = subprocess.Popen(
            self.command(replica), stdin=subprocess.DEVNULL, env=self.environment(replica), process_group=0
        )
        logger.info(
            "replica %d (pid %d): gRPC port %d, %d threads", replica.index, replica.pid, replica.port, self._threads
        )

    def start_all(self) -> None:
        for replica in self.replicas:
            self.start(replica)

    async def supervise(self, serving: Callable[[int], bool]) -> None:
        """Restart replicas as they die; return when none is left running or restartable.
        `serving(port)` says whether the replica on that port serves again (Envoy's health checks)."""
        watchers = [asyncio.ensure_future(self._watch(replica, serving)) for replica in self.replicas]
        try:
            await asyncio.gather(*watchers)
        finally:
            for watcher in watchers:
                watcher.cancel()

    async def _watch(self, replica: Replica, serving: Callable[[int], bool]) -> None:
        while True:
            code = await asyncio.to_thread(replica.process.wait)
            if self._stopping:
                return
            now = time.monotonic()
            replica.restarts = [t for t in replica.restarts if now - t < RESTART_WINDOW_S]
            if len(replica.restarts) >= MAX_RESTARTS:
                logger.error(
                    "replica %d exited with code %d, %d times within %.0fs: leaving it down",
                    replica.index,
                    code,
                    len(replica.restarts) + 1,
                    RESTART_WINDOW_S,
                )
                return
            logger.warning("replica %d (pid %d) exited with code %d: restarting", replica.index, replica.pid, code)
            replica.restarts.append(now)
            self.start(replica)
            asyncio.ensure_future(self._announce_when_serving(replica, replica.process, serving))

    async def _announce_when_serving(
        self, replica: Replica, process: subprocess.Popen, serving: Callable[[int], bool]
    ) -> None:
        """Log once Envoy's health checks pass on the new process: after they have seen the old one
        gone (Envoy's flag lags a death by a couple of checks), or after `STALE_S` at the latest."""
        started, seen_down = time.monotonic(), False
        while process.poll() is None and not self._stopping:
            healthy = await asyncio.to_thread(serving, replica.port)
            seen_down = seen_down or not healthy or time.monotonic() - started > STALE_S
            if healthy and seen_down:
                logger.info("replica %d restarted (pid %d): serving again", replica.index, process.pid)
                return
            await asyncio.sleep(0.2)

    async def stop(self, timeout_s: float, now: asyncio.Event | None = None) -> None:
        """SIGTERM every replica (each drains its requests), again once `now` is set (each stops at
        once), SIGKILL what is left after `timeout_s`."""
        self._stopping = True
        running = [r.process for r in self.replicas if r.alive]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline, passed_on = time.monotonic() + timeout_s, False
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            if now is not None and now.is_set() and not passed_on:
                passed_on = True
                for process in running:
                    if process.poll() is None:
                        process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
        for process in running:
            if process.poll() is None:
                process.kill()
                await asyncio.to_thread(process.wait)


def _without(args: list[str], name: str) -> list[str]:
    """`args` without the flag `name` and its value."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        else:
            out.append(arg)
    return out
