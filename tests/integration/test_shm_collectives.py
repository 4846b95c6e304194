"""The shards' shared-memory collectives (worker/kernels/shm_collectives.py) against torch.distributed's
gloo ones on random tensors, in real processes: sums equal gloo's (within rounding for 3 ranks,
whose ring adds in another order) and bit-equal on every rank; gather and the step message too.
A shard whose process dies, or an aborted group, ends the peers' collectives with ShardLost, never a
hang; with the switch off the shards agree on gloo."""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket

import numpy as np
import pytest
import torch

from inference_service.worker.kernels import shm_collectives
from inference_service.worker.shard_group import ShardAddress, ShardGroup, ShardLost

CPU = torch.device("cpu")
HANG_GUARD_S = 120  # a hang fails the test instead of blocking the suite (not a speed check)
# Shapes: a decode row, a few rows, and one larger than a slot (several rounds).
SHAPES = ((1, 768), (5, 333), (3, shm_collectives.SLOT_BYTES // 4 + 17))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def connect(rank: int, world_size: int, port: int) -> ShardGroup:
    torch.set_num_threads(1)
    return ShardGroup.connect(ShardAddress("127.0.0.1", port), rank, world_size, CPU)


def gloo_all_reduce(group: ShardGroup, tensor: torch.Tensor) -> torch.Tensor:
    group._wait(group.process_group.allreduce([tensor]))
    return tensor


def compare_with_gloo(rank: int, world_size: int, port: int, results) -> None:
    group = connect(rank, world_size, port)
    out: dict = {"shm": group.shm is not None, "sums": []}
    generator = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            tensor = torch.randn(shape, generator=generator).to(dtype)
            ours = group.all_reduce(tensor.clone())
            theirs = gloo_all_reduce(group, tensor.float())
            out["sums"].append((ours.dtype, ours.float().numpy(), theirs.numpy()))
    # The gloo fallback's own paths, for the same values, next to ours.
    logits = torch.randn(2, 7, generator=generator)
    out["gathered"] = [part.numpy() for part in group.gather_to_first(logits)]
    out["own_logits"] = logits.numpy()
    message = {"step": list(range(50_000)), "text": "é" * 100} if rank == 0 else None
    out["message"] = group.broadcast_object(message, CPU)
    results.put((rank, out))


def run_ranks(target, world_size: int, *args) -> dict[int, object]:
    context = multiprocessing.get_context("forkserver")
    # The fork server imports torch and the engine once (as shards.py's does); each rank forks from it.
    context.set_forkserver_preload([__name__])
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=target, args=(rank, world_size, port, results, *args), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        collected = dict(results.get(timeout=HANG_GUARD_S) for _ in range(world_size))
    except queue.Empty:
        pytest.fail("a rank did not report: a collective hung")
    finally:
        for process in processes:
            process.join(HANG_GUARD_S)
            if process.is_alive():
                process.kill()
    return collected


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_equals_gloo_and_is_equal_on_every_rank(world_size):
    outputs = run_ranks(compare_with_gloo, world_size)
    assert all(out["shm"] for out in outputs.values())
    first = outputs[0]
    for rank, out in outputs.items():
        for (dtype, ours, theirs), (_, first_ours, _) in zip(out["sums"], first["sums"], strict=True):
            assert np.array_equal(ours, first_ours), f"rank {rank}'s sum differs from rank 0's"
            if dtype == torch.float32 and world_size == 2:
                assert np.array_equal(ours, theirs)  # a + b: one rounding, either order
            else:  # bf16: ours sums in fp32 and rounds once; 3 ranks: gloo's ring adds in another order
                tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
                np.testing.assert_allclose(ours, theirs, rtol=tolerance, atol=tolerance)
        assert out["message"] == {"step": list(range(50_000)), "text": "é" * 100}
    gathered = first["gathered"]
    assert len(gathered) == world_size
    for rank, out in outputs.items():
        assert np.array_equal(gathered[rank], out["own_logits"])
        if rank:
            assert out["gathered"] == []


def fall_back(rank: int, world_size: int, port: int, results) -> None:
    if rank == 0:  # shard 0 decides for all of them
        os.environ[shm_collectives.ENV_SWITCH] = "off"
    group = connect(rank, world_size, port)
    summed = group.all_reduce(torch.full((4,), float(rank + 1)))
    results.put((rank, (group.shm is None, summed.tolist())))


def test_switched_off_on_shard_0_every_shard_keeps_gloo():
    outputs = run_ranks(fall_back, 2)
    assert outputs == {0: (True, [3.0] * 4), 1: (True, [3.0] * 4)}


def die_or_wait(rank: int, world_size: int, port: int, results) -> None:
    """Rank 1 dies before its second all-reduce; the others wait in it and must see ShardLost."""
    group = connect(rank, world_size, port)
    group.all_reduce(torch.ones(8))
    if rank == 1:
        results.put((rank, "died"))
        results.close()
        results.join_thread()  # the message is out before the process ends
        os._exit(3)
    try:
        group.all_reduce(torch.ones(8))
    except ShardLost as error:
        results.put((rank, f"lost: {error}"))
    else:
        results.put((rank, "no error"))


@pytest.mark.parametrize("world_size", [3])
def test_a_dead_shard_ends_the_others_collective_with_shard_lost(world_size):
    outputs = run_ranks(die_or_wait, world_size)
    assert outputs.pop(1) == "died"
    for outcome in outputs.values():
        assert outcome == "lost: a model shard is gone (shard 1's process is gone)"


def abort_while_waiting(rank: int, world_size: int, port: int, results) -> None:
    """Rank 0 waits in an all-reduce rank 1 has not joined; its watcher aborts the group (as shards.py
    does when a follower exits): that call ends, and so does rank 1's all-reduce after it."""
    import threading

    group = connect(rank, world_size, port)
    if rank == 0:
        threading.Timer(0.5, group.abort).start()
    else:
        group.store.wait(["aborted"])
    try:
        group.all_reduce(torch.ones(8))
    except ShardLost as error:
        results.put((rank, str(error)))
    else:
        results.put((rank, "no error"))
    if rank == 0:
        group.store.set("aborted", "yes")


def test_an_aborted_group_ends_pending_and_later_collectives():
    outputs = run_ranks(abort_while_waiting, 2)
    expected = "a model shard is gone (the group was aborted)"
    assert outputs == {0: expected, 1: expected}
