"""Loading and unloading LoRA adapters while serving (vLLM's load/unload routes).

A load reads and checks the adapter off the engine thread and makes it resident in one swap; a bad
one changes nothing. An unload first refuses new requests naming the adapter, then drops it on the
engine thread, between steps, once no request runs or waits on it; if some still do after the
timeout, it gives up and the adapter keeps serving.
"""

from __future__ import annotations

import asyncio
import time

from inference_service.engine.async_engine import AsyncEngine
from inference_service.errors import AdapterBusyError, AdapterLoadError, NotFoundError
from inference_service.models.lora_files import AdapterError
from inference_service.models.lora_registry import AdapterInfo, AdapterRegistry

DEFAULT_UNLOAD_TIMEOUT_S = 60.0
_POLL_S = 0.05


def _registry(engine: AsyncEngine) -> AdapterRegistry:
    if engine.adapters is None:
        raise AdapterLoadError("LoRA adapters are off: start the server with --lora-adapters or --max-loras")
    return engine.adapters


async def load_adapter(engine: AsyncEngine, name: str, source: str) -> AdapterInfo:
    registry = _registry(engine)
    try:
        return await asyncio.to_thread(registry.load, name, source)
    except AdapterError as error:
        raise AdapterLoadError(str(error)) from None


async def unload_adapter(engine: AsyncEngine, name: str, timeout_s: float = DEFAULT_UNLOAD_TIMEOUT_S) -> None:
    registry = _registry(engine)
    try:
        registry.begin_unload(name)
    except KeyError:
        loaded = ", ".join(map(repr, registry.names())) or "none"
        raise NotFoundError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})") from None
    deadline = time.monotonic() + timeout_s
    try:
        while not await engine.on_engine_thread(lambda llm: llm.try_unload_adapter(name)):
            if time.monotonic() >= deadline:
                raise AdapterBusyError(
                    f"LoRA adapter {name!r} was not unloaded: requests still ran on it after {timeout_s:g} s; "
                    "it keeps serving"
                )
            await asyncio.sleep(_POLL_S)
    except BaseException:
        registry.cancel_unload(name)
        raise
