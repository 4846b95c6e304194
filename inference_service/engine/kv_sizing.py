"""How many blocks the paged KV cache holds: a capacity in tokens, a share or size of free memory,
or (CUDA, nothing given) what a profiling forward pass leaves (engine/memory_plan.py has TGI's rule)."""

from __future__ import annotations

import logging
import os

import torch

from inference_service.config import CacheConfig, parse_memory
from inference_service.engine import memory_plan
from inference_service.errors import ModelLoadError
from inference_service.outputs import ScheduledRequest
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache

logger = logging.getLogger(__name__)

# Share of memory the KV cache takes when --kv-cache-memory is not given.
DEFAULT_KV_FRACTION = {"cpu": 0.1, "cuda": 0.85}


def plan_num_blocks(
    cache: CacheConfig, shapes: list[LayerShape], dtype: torch.dtype, device: torch.device, reserved_bytes: int = 0
) -> int:
    """Blocks in the pool: from --max-batch-total-tokens, else from the memory budget (`dtype`: what
    the cache stores, so smaller KV entries fit more blocks) less `reserved_bytes` (a vision model's
    image encoder: its activations share the budget)."""
    if cache.max_batch_total_tokens is not None:
        return -(-cache.max_batch_total_tokens // cache.block_size)
    fraction, size = parse_memory(cache.kv_cache_memory) if cache.kv_cache_memory else (None, None)
    if size is None:
        fraction = fraction or DEFAULT_KV_FRACTION[device.type]
        size = int(fraction * _available_memory(device))
    bytes_per_block = PagedKVCache.bytes_per_token(shapes, dtype) * cache.block_size
    num_blocks = (size - reserved_bytes) // bytes_per_block
    if num_blocks < 1:
        encoder = f", less {reserved_bytes} for the image encoder," if reserved_bytes else ""
        raise ModelLoadError(
            f"the KV cache budget ({size} bytes{encoder}) holds no block of {bytes_per_block} bytes; "
            "raise --kv-cache-memory" + (" or lower --max-images-per-request" if reserved_bytes else "")
        )
    if reserved_bytes:
        logger.info("the image encoder's activations take %.1f MiB of the KV cache budget", reserved_bytes / 2**20)
    return num_blocks


def sized_by_memory(cache: CacheConfig) -> bool:
    """Whether the KV cache takes what memory is left (neither a capacity nor a size was given)."""
    return cache.max_batch_total_tokens is None and cache.kv_cache_memory is None


def profile_kv_blocks(
    runner_over,
    shapes: list[LayerShape],
    dtype: torch.dtype,
    device: torch.device,
    cache: CacheConfig,
    profile_tokens: int,
    memory_info=None,
    kv_dtype: torch.dtype | None = None,
    reserved_bytes: int = 0,
) -> int:
    """KV blocks from the memory left after a profiling forward pass of `profile_tokens` tokens
    (TGI's warm-up; engine/memory_plan.py has the rule). `runner_over(kv_cache)` makes the runner;
    `memory_info()` → (free, total) bytes, torch.cuda.mem_get_info on the device by default;
    `kv_dtype`: what the cache stores (None: `dtype`)."""
    profile_blocks = -(-profile_tokens // cache.block_size)
    profile_cache = PagedKVCache(shapes, profile_blocks, cache.block_size, dtype, device, kv_dtype)
    table = list(range(profile_blocks))
    runner_over(profile_cache).execute(
        [ScheduledRequest(_PROFILE_ID, 0, profile_tokens, [0] * profile_tokens, table, True)]
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    free, total = memory_info() if memory_info is not None else torch.cuda.mem_get_info(device)
    bytes_per_block = PagedKVCache.bytes_per_token(shapes, kv_dtype or dtype) * cache.block_size
    # The profile's own blocks go back to torch's allocator when it is dropped: they count too.
    # A vision model's image encoder runs at admission, beside the cache: its activations stay free, and
    # so does what the CUDA graphs captured after sizing will hold (runner/graph_memory.py).
    free = max(0, free - reserved_bytes)
    num_blocks = memory_plan.kv_blocks_from_memory(free, total, cache.cuda_memory_fraction, bytes_per_block)
    num_blocks += profile_blocks
    logger.info(
        "KV cache sized after a profiling forward of %d tokens: %d blocks (%.1f GiB free of %.1f GiB, "
        "--cuda-memory-fraction %.2f)",
        profile_tokens,
        num_blocks,
        free / 2**30,
        total / 2**30,
        cache.cuda_memory_fraction,
    )
    return num_blocks


_PROFILE_ID = "__profile__"


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
