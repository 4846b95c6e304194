"""The adapter registry: which LoRA adapters are resident, loading and unloading them.

It reads an adapter (a local PEFT folder, or a hub id fetched once into the hub cache), checks it
against the base model, and puts it in the runner's `LoraTable`; `--max-loras` bounds how many are
resident at once. The engine asks it whether requests may still name an adapter; the engine alone
decides when an unload may happen (no request running on it).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download

from inference_service.models.lora_files import CONFIG_FILE, WEIGHTS_FILE, AdapterError, read_adapter
from inference_service.worker.lora.weights import AdapterWeights, LoraTable, Site

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterInfo:
    """A resident adapter as the API lists it."""

    name: str
    source: str  # the path or hub id it was loaded from
    rank: int
    fingerprint: str


class AdapterRegistry:
    """Resident adapters of one base model (thread-safe: loads run off the engine thread)."""

    def __init__(
        self,
        table: LoraTable,
        shapes: dict[Site, tuple[int, int]],
        max_loras: int,
        max_rank: int,
        device: torch.device,
        base_name: str,
        hub_cache: str | None = None,
    ):
        self.table = table
        self.shapes = shapes
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.base_name = base_name
        self.hub_cache = hub_cache
        self._infos: dict[str, AdapterInfo] = {}
        self._unloading: set[str] = set()  # still resident, refused to new requests
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The adapters new requests may name (not those being unloaded)."""
        return [name for name in self._infos if name not in self._unloading]

    def infos(self) -> list[AdapterInfo]:
        return [info for name, info in self._infos.items() if name not in self._unloading]

    def is_resident(self, name: str) -> bool:
        """Its weights are in the table (requests already running on it may go on)."""
        return name in self._infos

    def begin_unload(self, name: str) -> None:
        """Refuse new requests naming it from now on; `unload` drops it once none runs."""
        with self._lock:
            if name not in self._infos or name in self._unloading:
                raise KeyError(name)
            self._unloading.add(name)

    def cancel_unload(self, name: str) -> None:
        with self._lock:
            self._unloading.discard(name)

    def info(self, name: str) -> AdapterInfo | None:
        return self._infos.get(name)

    def load(self, name: str, source: str) -> AdapterInfo:
        """Read, check and make resident one adapter; AdapterError (nothing changed) otherwise."""
        if not name or name == self.base_name:
            raise AdapterError(f"LoRA adapter name {name!r} is empty or the base model's name")
        with self._lock:
            if name in self._infos:
                raise AdapterError(f"a LoRA adapter named {name!r} is already loaded")
            if len(self._infos) >= self.max_loras:
                raise AdapterError(
                    f"{len(self._infos)} LoRA adapters are loaded, the most --max-loras allows; unload one first"
                )
            weights = read_adapter(name, self._folder(name, source), self.shapes, self.max_rank, self.device)
            info = AdapterInfo(name, source, weights.rank, weights.fingerprint)
            self.table.put(weights)
            self._infos = {**self._infos, name: info}
        logger.info(
            "loaded LoRA adapter %s from %s (rank %d, %.1f MiB)", name, source, weights.rank, weights.nbytes / 2**20
        )
        return info

    def unload(self, name: str) -> None:
        """Drop a resident adapter (the engine has made sure nothing runs on it)."""
        with self._lock:
            if name not in self._infos:
                raise AdapterError(f"no LoRA adapter named {name!r} is loaded")
            self._infos = {k: v for k, v in self._infos.items() if k != name}
            self._unloading.discard(name)
            self.table.remove(name)
        logger.info("unloaded LoRA adapter %s", name)

    def weights(self, name: str) -> AdapterWeights:
        return self.table.get(name)

    def _folder(self, name: str, source: str) -> Path:
        path = Path(source).expanduser()
        if path.is_dir() or os.path.isabs(source) or source.startswith((".", "~")) or source.count("/") > 1:
            return path
        try:  # a hub id: fetched once into the hub cache
            return Path(snapshot_download(source, cache_dir=self.hub_cache, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
        except Exception as error:  # noqa: BLE001 — the hub's many failures, one line
            logger.debug("hub fetch of LoRA adapter %s failed", source, exc_info=True)
            raise AdapterError(
                f"LoRA adapter {name!r}: {source!r} is no local folder and can't be fetched from the hub "
                f"({type(error).__name__})"
            ) from None
