"""`launch --num-replicas N` (N >= 2): N engine processes behind the one Envoy.

Order of things:
1. the replicas start (`gateway.replicas`), each loading the model on its own gRPC port;
2. Envoy starts in front of all of them (`gateway.upstream`: least request or prefix routing,
   gRPC health checks, outlier detection, safe retries);
3. once a replica serves, REST `/health` is 200 and the command says it is ready; each replica is
   announced as it comes up. Envoy and the replicas are supervised: a dead one is restarted;
4. on SIGTERM/SIGINT the replicas drain (Envoy still carries their in-flight requests), then Envoy
   stops; a second signal is passed on, so each replica stops at once and says what it cut. The
   command exits 1 when Envoy can't be kept running or no replica is left.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path

from gateway.envoy import Envoy
from gateway.launch import LaunchOptions, healthy, keep_running, loopback, make_envoy, start_envoy
from gateway.replicas import ReplicaSet
from inference_service.api.stopping import StopSignals

logger = logging.getLogger("gateway.launch")

POLL_S = 0.2


async def launch_replicas(server_config, engine_config, options: LaunchOptions) -> int:
    signals = StopSignals.install()
    replicas = ReplicaSet(engine_config, server_config, options.num_replicas, loopback(server_config.hostname))
    replicas.start_all()
    drain_s = server_config.graceful_termination_timeout + 5
    try:
        with tempfile.TemporaryDirectory(prefix="inference-service-envoy-") as workdir:
            envoy = make_envoy(server_config, options, replicas.ports, Path(workdir))
            await start_envoy(envoy)
            try:
                return await _serve(replicas, envoy, signals.stop)
            finally:
                # drains while Envoy still carries the in-flight requests
                await replicas.stop(drain_s, signals.now)
                await asyncio.to_thread(envoy.stop)
    finally:
        await replicas.stop(drain_s, signals.now)


async def _serve(replicas: ReplicaSet, envoy: Envoy, stop: asyncio.Event) -> int:
    tasks = {
        "envoy": asyncio.ensure_future(keep_running(envoy)),
        "replicas": asyncio.ensure_future(replicas.supervise(lambda port: port in envoy.healthy_ports())),
        "stop": asyncio.ensure_future(stop.wait()),
        "announce": asyncio.ensure_future(_announce(replicas, envoy)),
    }
    try:
        await asyncio.wait({tasks["envoy"], tasks["replicas"], tasks["stop"]}, return_when=asyncio.FIRST_COMPLETED)
        if tasks["stop"].done():
            return 0
        if tasks["replicas"].done():
            logger.error("no replica is left running: shutting down")
        return 1
    finally:
        for task in tasks.values():
            task.cancel()


async def _announce(replicas: ReplicaSet, envoy: Envoy) -> None:
    """Log each replica as Envoy's health checks first see it serve, and readiness once REST
    `/health` answers 200."""
    pending, ready = list(replicas.replicas), False
    while pending or not ready:
        serving_ports = await asyncio.to_thread(envoy.healthy_ports)
        for replica in list(pending):
            if replica.alive and replica.port in serving_ports:
                pending.remove(replica)
                logger.info("replica %d (pid %d) serving on gRPC port %d", replica.index, replica.pid, replica.port)
        some_serve = len(pending) < len(replicas.replicas)
        if not ready and some_serve and await asyncio.to_thread(healthy, envoy.url("/health"), envoy.ssl_context()):
            ready = True
            logger.info(
                "ready: TGI REST API on %s (gRPC too), balanced over %d replicas", envoy.url(), len(replicas.replicas)
            )
        await asyncio.sleep(POLL_S)
