"""The shards of one model serving together: their process group and the few collectives they use.

Tensor parallelism (`--num-shard N`) runs N processes, shard 0 the server and 1..N-1 followers. They
meet at `--master-addr:--master-port` (a TCP store shard 0 hosts) and talk through one torch
process group: gloo on CPU, NCCL on CUDA. It is an object, not torch's global default group, so a
process can hold more than one (tests do) and nothing else in it is affected.

Waiting has no time limit: a follower waits for the next step for as long as the server is idle.
A shard that dies closes its sockets and the peers' pending collective raises at once
(`ShardLost`); that, not a timeout, is how a crash is seen.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from inference_service.errors import RunnerLost

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

    def __init__(self, process_group: Any, store: dist.Store, rank: int, world_size: int):
        self.process_group = process_group
        self.store = store  # kept alive: shard 0's store is the rendezvous the others hold on to
        self.rank = rank
        self.world_size = world_size

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
        return cls(group, store, rank, world_size)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the shards, in place; returns it."""
        self._wait(self.process_group.allreduce([tensor]))
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every shard's `tensor` (same shape everywhere) on shard 0, in rank order; [] elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.is_first else []
        self._wait(self.process_group.gather(outputs, [tensor.contiguous()], options))
        return outputs[0] if self.is_first else []

    def broadcast_object(self, value: object, device: torch.device) -> object:
        """Shard 0's `value` on every shard (pickled: the small step message, never weights)."""
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

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(self.process_group.broadcast([tensor], options))

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as error:
            raise ShardLost(f"a model shard is gone ({error})") from error
