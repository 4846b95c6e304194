"""The shards of one model serving together: their process group and the few collectives they use.

Tensor parallelism (`--num-shard N`) runs N processes, shard 0 the server and 1..N-1 followers. They
meet at `--master-addr:--master-port` (a TCP store shard 0 hosts) and talk through one torch
process group: gloo on CPU, NCCL on CUDA. It is an object, not torch's global default group, so a
process can hold more than one (tests do) and nothing else in it is affected.

On CPU, with every shard on this host, the collectives of a step (the all-reduces, the head's
gather, the step message) go through shared memory (kernels/shm_collectives.py: microseconds where
gloo over loopback takes milliseconds); gloo stays for the rest and is the fallback.

Waiting has no time limit: a follower waits for the next step for as long as the server is idle.
A shard that dies closes its sockets (gloo) or leaves its process gone (shared memory, checked
every few milliseconds while waiting) and the peers' pending collective raises (`ShardLost`);
that, not a timeout, is how a crash is seen.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from inference_service.errors import RunnerLost
from inference_service.worker.kernels.shm_collectives import STORE_KEY, PeerGone, ShmCollectives

logger = logging.getLogger(__name__)

# How long shard 0 waits for every follower to join (they import torch and start first).
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=5)
# No limit on a collective (see the module docstring): a day stands for none.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=1)


class ShardLost(RunnerLost):
    """A collective failed: another shard is gone (crashed, killed) or unreachable."""


@dataclass(frozen=True)
class ShardAddress:
    """Where the shards meet: shard 0 listens there."""

    host: str
    port: int


class ShardGroup:
    """This process's place among the shards (`rank` of `world_size`) and the collectives over them."""

    def __init__(
        self,
        process_group: Any,
        store: dist.Store,
        rank: int,
        world_size: int,
        shm: ShmCollectives | None = None,
    ):
        self.process_group = process_group
        self.store = store  # kept alive: shard 0's store is the rendezvous the others hold on to
        self.rank = rank
        self.world_size = world_size
        self.shm = shm  # the shared-memory collectives, when every shard maps them (else gloo)

    @classmethod
    def connect(cls, address: ShardAddress, rank: int, world_size: int, device: torch.device) -> ShardGroup:
        """Join the group (shard 0 hosts the store); returns once all `world_size` shards have joined."""
        try:
            store = dist.TCPStore(
                address.host, address.port, world_size, is_master=rank == 0, timeout=RENDEZVOUS_TIMEOUT
            )
            group: Any  # a gloo or NCCL backend (torch types their collectives loosely)
            if device.type == "cuda":
                group = dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
            else:
                group = dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)
        except (RuntimeError, dist.DistError) as error:
            raise ShardLost(
                f"shard {rank} could not join the shards at {address.host}:{address.port}: {error}"
            ) from error
        shard_group = cls(group, store, rank, world_size)
        if device.type == "cpu":
            shard_group.shm = shard_group._share_memory()
        return shard_group

    def _share_memory(self) -> ShmCollectives | None:
        """Shard 0 creates the region and names it in the store, every shard maps it, and all of them
        agree (over gloo) to use it; the file is unlinked then. Anything short of that: gloo."""
        created = ShmCollectives.try_create(self.world_size) if self.is_first else None
        if self.is_first:
            self.store.set(STORE_KEY, f"{created[1]}\0{created[2]}" if created else "")
        named = self.store.get(STORE_KEY).decode()
        shm: ShmCollectives | None = created[0] if created else None
        if named and not self.is_first:
            path, nonce = named.split("\0")
            try:
                shm = ShmCollectives.attach(path, int(nonce), self.rank, self.world_size)
            except (OSError, RuntimeError) as error:
                logger.warning("shard %d can't map the shared-memory collectives, using gloo: %s", self.rank, error)
        agreed = self.all_succeeded(shm is not None, torch.device("cpu")) if named else False
        if created:
            with contextlib.suppress(OSError):
                os.unlink(created[1])  # every shard has mapped it (or none will): nothing left behind
        return shm if agreed else None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the shards, in place; returns it."""
        if self.shm is not None and self.shm.takes(tensor):
            with self._peers():
                return self.shm.all_reduce(tensor)
        self._wait(self.process_group.allreduce([tensor]))
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every shard's `tensor` (same shape everywhere) on shard 0, in rank order; [] elsewhere."""
        if self.shm is not None and tensor.device.type == "cpu":
            with self._peers():
                gathered = self.shm.gather(tensor.contiguous())
            return list(gathered.unbind(0)) if gathered is not None else []
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.is_first else []
        self._wait(self.process_group.gather(outputs, [tensor.contiguous()], options))
        return outputs[0] if self.is_first else []

    def broadcast_object(self, value: object, device: torch.device) -> object:
        """Shard 0's `value` on every shard (pickled: the small step message, never weights)."""
        if self.shm is not None:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if self.is_first else None
            with self._peers():
                received = self.shm.broadcast_bytes(payload)
            return value if self.is_first else pickle.loads(received)
        size = torch.zeros(1, dtype=torch.int64, device=device)
        payload = b""
        if self.is_first:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            size[0] = len(payload)
        self._broadcast(size)
        buffer = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
            if self.is_first
            else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        )
        self._broadcast(buffer)
        return value if self.is_first else pickle.loads(buffer.cpu().numpy().tobytes())

    def all_succeeded(self, succeeded: bool, device: torch.device) -> bool:
        """Whether every shard succeeded (each says whether it did): a checkpoint after loading."""
        flag = torch.tensor([1 if succeeded else 0], dtype=torch.int64, device=device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the binding takes the enum
        self._wait(self.process_group.allreduce([flag], options))
        return bool(flag.item())

    def close(self) -> None:
        """Release the process group and the store now, while the interpreter runs. Left alive to the
        process's exit, their native threads could be torn down unjoined there, which aborts the
        process (`terminate called without an active exception`) after its work is done."""
        for name in ("process_group", "store"):  # the group first: it holds the store too
            self.__dict__.pop(name, None)

    def abort(self) -> None:
        """A shard is known to be gone: every pending and later shared-memory collective fails at once."""
        if self.shm is not None:
            self.shm.abort()

    @contextlib.contextmanager
    def _peers(self) -> Iterator[None]:
        try:
            yield
        except PeerGone as error:
            raise ShardLost(f"a model shard is gone ({error})") from error

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(self.process_group.broadcast([tensor], options))

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as error:
            raise ShardLost(f"a model shard is gone ({error})") from error
