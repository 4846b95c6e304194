"""Collectives for the shards of one host through shared memory (`csrc/shm_collectives.cpp`).

gloo's all-reduce over loopback costs milliseconds, and a decode step makes two per layer; here a
collective is a copy into a shared slot, a wait on the peers' sequence numbers (a short spin, then
a futex) and a sum in rank order. Shard 0 creates the region (a file in /dev/shm, unlinked once
every shard has mapped it) and names it through the rendezvous store; the others map it. Where any
of that fails (no /dev/shm, shards on other hosts, no compiler, `INFERENCE_SERVICE_SHM_COLLECTIVES=off`
on shard 0), the shards keep gloo, agreed by all of them.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import subprocess
from pathlib import Path

import torch

from inference_service.worker.kernels import bindings

logger = logging.getLogger(__name__)

SOURCE = bindings.CSRC / "shm_collectives.cpp"
# No -ffast-math: the sums must keep their rank order exactly.
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC")
LINK_FLAGS = ("-shared",)
ENV_SWITCH = "INFERENCE_SERVICE_SHM_COLLECTIVES"
SHM_DIR = Path("/dev/shm")
# Bytes per rank and round: a larger tensor takes several rounds (a prefill's activations).
SLOT_BYTES = 1 << 20
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
STORE_KEY = "shm-collectives"
ABORTED = 1  # a collective's status: the group was aborted; 2 + r: rank r's process is gone

_POINTER, _I64, _U64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64


class PeerGone(RuntimeError):
    """A collective could not complete: a peer's process is gone, or the group was aborted."""


def switched_on() -> bool:
    return os.environ.get(ENV_SWITCH, "on").lower() not in ("0", "off", "false", "no")


def _library() -> ctypes.CDLL:
    path = bindings._build((SOURCE,), (), COMPILE_FLAGS, LINK_FLAGS, stem="shm_collectives")
    library = ctypes.CDLL(str(path))  # a CDLL call releases the GIL: shard 0's server threads go on
    signatures = {
        "shm_region_bytes": ([_I64, _I64], _I64),
        "shm_init": ([_POINTER, _I64, _I64, _U64], ctypes.c_int),
        "shm_attach": ([_POINTER, _I64, _I64, _U64, _I64], ctypes.c_int),
        "shm_abort": ([_POINTER], None),
        "shm_all_reduce": ([_POINTER, _I64, _POINTER, _I64, _I64], ctypes.c_int),
        "shm_gather": ([_POINTER, _I64, _I64, _POINTER, _I64, _POINTER], ctypes.c_int),
        "shm_broadcast": ([_POINTER, _I64, _I64, _POINTER, _I64], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    return library


class ShmCollectives:
    """This rank's view of the shared region; every rank must call the same collectives in the same order."""

    def __init__(self, library: ctypes.CDLL, region: mmap.mmap, rank: int, world_size: int):
        self._lib = library
        self._region = region  # kept mapped for the process's life
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def create(cls, world_size: int) -> tuple[ShmCollectives, str, int]:
        """Rank 0: a new region, this rank attached; returns it, the file's path and the nonce the
        others check. The caller unlinks the file once every rank has attached."""
        library = _library()
        size = library.shm_region_bytes(world_size, SLOT_BYTES)
        nonce = secrets.randbits(63)
        path = SHM_DIR / f"inference-service-shards-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            shm = cls(library, mmap.mmap(fd, size), 0, world_size)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        if library.shm_init(shm._base, world_size, SLOT_BYTES, nonce) != 0:
            path.unlink(missing_ok=True)
            raise RuntimeError("shared memory region refused its layout")
        shm._say_who(nonce, str(path))
        return shm, str(path), nonce

    @classmethod
    def attach(cls, path: str, nonce: int, rank: int, world_size: int) -> ShmCollectives:
        """Map the region rank 0 created and say which process this rank is."""
        library = _library()
        fd = os.open(path, os.O_RDWR)
        try:
            shm = cls(library, mmap.mmap(fd, os.fstat(fd).st_size), rank, world_size)
        finally:
            os.close(fd)
        shm._say_who(nonce, path)
        return shm

    @classmethod
    def try_create(cls, world_size: int) -> tuple[ShmCollectives, str, int] | None:
        """`create`, or None (with the reason logged) where shared memory or the compiler is missing."""
        if not switched_on():
            return None
        try:
            return cls.create(world_size)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            logger.warning("shared-memory collectives unavailable, the shards use gloo: %s", error)
            return None

    def _say_who(self, nonce: int, path: str) -> None:
        if self._lib.shm_attach(self._base, self.rank, self.world_size, nonce, os.getpid()) != 0:
            raise RuntimeError(f"{path} is not this group's shared memory region")

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether `all_reduce` sums this tensor (else gloo does)."""
        return tensor.device.type == "cpu" and tensor.dtype in DTYPE_CODES and tensor.is_contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (see `takes`) over the ranks in place: fp32 sums in rank order, equal on every rank."""
        status = self._lib.shm_all_reduce(
            self._base, self.rank, tensor.data_ptr(), tensor.numel(), DTYPE_CODES[tensor.dtype]
        )
        self._check(status)
        return tensor

    def gather(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor | None:
        """Every rank's `tensor` (same shape, contiguous CPU) on `root` as [world, *shape]; None elsewhere."""
        out = tensor.new_empty((self.world_size, *tensor.shape)) if self.rank == root else None
        nbytes = tensor.numel() * tensor.element_size()
        status = self._lib.shm_gather(
            self._base, self.rank, root, tensor.data_ptr(), nbytes, out.data_ptr() if out is not None else None
        )
        self._check(status)
        return out

    def broadcast_bytes(self, payload: bytes | None, root: int = 0) -> bytes:
        """`root`'s payload on every rank (the others pass None): its length, then its bytes."""
        size = ctypes.c_int64(len(payload) if payload is not None else 0)
        self._check(self._lib.shm_broadcast(self._base, self.rank, root, ctypes.addressof(size), 8))
        if self.rank == root and payload is not None:
            self._check(self._lib.shm_broadcast(self._base, self.rank, root, payload, size.value))  # read only
            return payload
        buffer = ctypes.create_string_buffer(size.value)
        self._check(self._lib.shm_broadcast(self._base, self.rank, root, ctypes.addressof(buffer), size.value))
        return buffer.raw

    def abort(self) -> None:
        """Make every rank's pending and later collectives fail at once (a shard is known to be gone)."""
        self._lib.shm_abort(self._base)

    def _check(self, status: int) -> None:
        if status == 0:
            return
        if status == ABORTED:
            raise PeerGone("the group was aborted")
        if status >= 2:
            raise PeerGone(f"shard {status - 2}'s process is gone")
        raise PeerGone(f"shared-memory collective failed (status {status})")
