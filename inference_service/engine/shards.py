"""Build the engine on N tensor-parallel shards (`--num-shard`), or on one (builder.build_engine).

This process is shard 0: it starts shards 1..N-1 as processes (forked from a fork server, which
imports torch and the engine once: a clean process, safe beside gRPC's threads, started in
a fraction of an interpreter's start), meets them at `--master-addr:--master-port`, and every shard then
loads the model, keeps its slice (worker/runner/shard_model.py; for a model the fallback runner
serves, worker/runner/shard_fallback.py) and builds the same runner: the paged one, or the fallback's
over transformers' caches. Shard 0 serves: it schedules, samples and drives the others through
ShardedRunner's step message.

A follower that dies takes the engine to its failed state (AsyncEngine: every request ends with
ServerFailed, the server goes NOT_SERVING and exits, as TGI's launcher does when a shard crashes):
seen by the next step's collective, or by the watcher here when the server is idle.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Sequence

import torch

from inference_service import progress
from inference_service.config import EngineConfig
from inference_service.engine import builder, model_load
from inference_service.engine.llm_engine import LLMEngine
from inference_service.errors import ModelLoadError
from inference_service.models import loader
from inference_service.outputs import Runner
from inference_service.worker.linears.parallel import ShardingRefused
from inference_service.worker.runner.shard_fallback import shard_fallback_model
from inference_service.worker.runner.shard_model import FAMILIES, shard_model
from inference_service.worker.runner.sharded import ShardedRunner, follow
from inference_service.worker.shard_group import ShardAddress, ShardGroup, ShardLost
from inference_service.worker.transformers_runner.runner import TransformersRunner

logger = logging.getLogger(__name__)

# How often a follower looks whether shard 0's process is still there.
SERVER_POLL_S = 1.0
# Seconds the followers get to leave their loop after Stop before they are terminated.
FOLLOWER_EXIT_S = 10.0


def num_shards(config: EngineConfig) -> int:
    """--num-shard, else every CUDA device with --sharded true, else 1."""
    model = config.model
    if model.num_shard is not None:
        return model.num_shard
    if model.sharded:
        count = torch.cuda.device_count() if loader.resolve_device(model.device).type == "cuda" else 0
        if count < 2:
            raise ModelLoadError(
                "--sharded true without --num-shard needs two CUDA devices or more; give --num-shard N"
            )
        return count
    return 1


def build_engine(config: EngineConfig) -> LLMEngine:
    """The engine ready to serve: on one shard, or as shard 0 of `num_shards(config)`."""
    world_size = num_shards(config)
    if world_size == 1:
        return builder.build_engine(config)
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    followers = Followers.start(config, world_size)
    try:
        shard_config = for_shard(config, 0)
        group = _connect(shard_config, 0, world_size)
        loaded = load_shard(shard_config, group)
        with progress.phase("preparing the engine", "prepared the engine", total=3) as phase:

            def sharded_runner(runner: Runner) -> Runner:
                sharded = ShardedRunner(runner, group, followers.join)
                followers.watch(sharded)
                return sharded

            return builder.build_from(config, loaded, phase, sharded_runner, group)
    except ShardLost as error:
        followers.stop()
        raise ModelLoadError(f"a model shard failed while loading: {error}") from error
    except BaseException:
        followers.stop()
        raise


def for_shard(config: EngineConfig, rank: int) -> EngineConfig:
    """Shard `rank`'s config: on CUDA its own device (the first one's index + rank)."""
    device = loader.resolve_device(config.model.device)
    if device.type != "cuda":
        return config
    name = f"cuda:{(device.index or 0) + rank}"
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=name))


def load_shard(config: EngineConfig, group: ShardGroup) -> model_load.LoadedModel:
    """Load the model and keep this shard's slice; every shard says whether it could, and all fail
    together (each one's reason is in its own log; shard 0 raises its own, or names the others)."""
    device = loader.resolve_device(config.model.device)
    failure: Exception | None = None
    try:
        loaded = model_load.load(config)
        _shard(loaded, group)
    except ShardingRefused as error:
        failure = ModelLoadError(f"--num-shard {group.world_size}: {error}")
    except Exception as error:  # noqa: BLE001 — said by every shard, raised after they agree
        failure = error
    if not group.all_succeeded(failure is None, device):
        if failure is not None:
            raise failure
        raise ModelLoadError("another model shard could not load the model (its log above says why)")
    if failure is not None:  # cannot be: every shard succeeded
        raise failure
    return loaded


def _shard(loaded: model_load.LoadedModel, group: ShardGroup) -> None:
    """Keep this shard's slice: the paged families' plan, or the fallback families' (a paged family
    that failed the probe is cut by the paged plan: the same transformers modules)."""
    model_type = loaded.model.config.get_text_config().model_type
    if loaded.fallback_reason is None or model_type in FAMILIES:
        shard_model(loaded.model, group)
    else:
        shard_fallback_model(loaded.model, group)


def _connect(config: EngineConfig, rank: int, world_size: int) -> ShardGroup:
    address = ShardAddress(config.model.master_addr, config.model.master_port)
    return ShardGroup.connect(address, rank, world_size, loader.resolve_device(config.model.device))


def exit_with(server_pid: int) -> None:
    """End this follower when shard 0's process is gone, whatever this one is doing (loading, waiting
    for a rendezvous that will never come): a follower never outlives its server."""
    while True:
        time.sleep(SERVER_POLL_S)
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            os._exit(1)


class Followers:
    """Shards 1..N-1: their processes, and a watcher that tells the runner when one ends unasked."""

    def __init__(self, processes: Sequence[multiprocessing.process.BaseProcess]):
        self.processes = processes
        self._stopping = threading.Event()

    @classmethod
    def start(cls, config: EngineConfig, world_size: int) -> Followers:
        context = multiprocessing.get_context("forkserver")
        # The fork server imports torch and the engine once; every follower forks from it after.
        context.set_forkserver_preload([__name__])
        processes = [
            context.Process(
                target=follower_main, args=(config, rank, world_size, os.getpid()), name=f"shard-{rank}", daemon=True
            )
            for rank in range(1, world_size)
        ]
        for process in processes:
            process.start()
        return cls(processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def watch(self, runner: ShardedRunner) -> None:
        """Set `runner.lost` as soon as a follower's process ends while serving."""

        def wait() -> None:
            sentinels = {p.sentinel: p for p in self.processes}
            ended = multiprocessing.connection.wait(list(sentinels))
            if not self._stopping.is_set() and runner.lost is None:
                process = sentinels[ended[0]]  # type: ignore[index]
                process.join(1)
                runner.lost = ShardLost(f"{process.name} exited (exit code {process.exitcode})")
                runner.group.abort()  # a step waiting on the dead shard ends now
                logger.error("model %s", runner.lost)

        threading.Thread(target=wait, name="shard-watcher", daemon=True).start()

    def join(self) -> None:
        """The followers were told to stop: wait for them, then end those that did not."""
        self._stopping.set()
        for process in self.processes:
            process.join(FOLLOWER_EXIT_S)
        self.stop()

    def stop(self) -> None:
        self._stopping.set()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(FOLLOWER_EXIT_S)


def follower_main(config: EngineConfig, rank: int, world_size: int, server_pid: int) -> None:
    """A follower shard's process: join, load this shard's slice, follow shard 0's steps until Stop."""
    logging.basicConfig(level=logging.WARNING, format=f"shard {rank}: %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=exit_with, args=(server_pid,), name="server-watcher", daemon=True).start()
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    config = for_shard(config, rank)
    try:
        group = _connect(config, rank, world_size)
        loaded = load_shard(config, group)
        builder.install_native_linears(loaded)
        runner: Runner
        if loaded.fallback_reason is None:
            runner, _num_blocks = builder.paged_runner(config, loaded, group)
        else:
            runner = TransformersRunner(loaded.model, loaded.device)
        follow(runner, group)
    except ShardLost as error:  # shard 0 is gone (it stopped or crashed): nothing to follow
        logger.warning("%s", error)
        sys.exit(1)
    except Exception as error:  # noqa: BLE001 — said here, in this shard's log, once
        logger.error("shard %d failed: %s", rank, error, exc_info=not isinstance(error, ModelLoadError))
        sys.exit(1)
