"""The device-independent parts of the CUDA path: which captured CUDA-graph size a decode batch runs
at (`--cuda-graphs`), and how many KV blocks the memory left after a profiling forward pass holds
(`--cuda-memory-fraction`). The profiling pass itself runs here on CPU; only the device's memory
figures (torch.cuda.mem_get_info, which needs a GPU) are given as numbers."""

from __future__ import annotations

import pytest
import torch

from inference_service.config import CacheConfig, parse_cuda_graphs
from inference_service.engine import kv_sizing, memory_plan
from inference_service.worker.attention.kv_cache import PagedKVCache
from inference_service.worker.runner.cuda_graphs import graph_batch_size, pad_rows, plan_decode_batch
from inference_service.worker.runner.model_runner import ModelRunner, probe_layer_shapes

TGI_SIZES = parse_cuda_graphs("1,2,4,8,16,32")
GIB = 2**30


@pytest.mark.parametrize(
    ("rows", "size"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 32), (32, 32), (33, None), (500, None)]
)
def test_a_batch_runs_at_the_next_captured_size(rows, size):
    assert graph_batch_size(rows, TGI_SIZES) == size


def test_no_sizes_means_no_graphs_and_graphs_are_for_cuda_only():
    assert graph_batch_size(1, parse_cuda_graphs("0")) is None
    on_cuda = plan_decode_batch(3, TGI_SIZES, "cuda")
    assert (on_cuda.size, on_cuda.graph, on_cuda.padding) == (4, True, 1)
    on_cpu = plan_decode_batch(3, TGI_SIZES, "cpu")
    assert (on_cpu.size, on_cpu.graph, on_cpu.padding) == (3, False, 0)
    too_big = plan_decode_batch(40, TGI_SIZES, "cuda")
    assert (too_big.size, too_big.graph) == (40, False)
    with pytest.raises(ValueError, match="at least one row"):
        graph_batch_size(0, TGI_SIZES)


def test_padding_rows_fill_the_batch():
    assert pad_rows([7, 9, 11], 4, 0) == [7, 9, 11, 0]
    with pytest.raises(ValueError, match="do not fit"):
        pad_rows([1, 2, 3], 2, 0)


def test_memory_left_is_free_memory_less_the_share_that_is_not_ours():
    assert memory_plan.usable_free_memory(60 * GIB, 80 * GIB, 1.0) == 60 * GIB
    assert memory_plan.usable_free_memory(60 * GIB, 80 * GIB, 0.5) == 20 * GIB
    assert memory_plan.usable_free_memory(10 * GIB, 80 * GIB, 0.5) == 0  # the rest is already taken
    with pytest.raises(ValueError, match="fraction"):
        memory_plan.usable_free_memory(1, 1, 0.0)


def test_blocks_keep_tgis_wiggle_room():
    # 20 GiB usable, 90% of it, in blocks of 1 MiB.
    assert memory_plan.kv_blocks_from_memory(60 * GIB, 80 * GIB, 0.5, 2**20) == int(20 * GIB * 0.9) // 2**20
    assert memory_plan.kv_blocks_from_memory(10 * GIB, 80 * GIB, 0.5, 2**20) == 0


def test_profiling_forward_runs_then_sizes_the_cache(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from inference_service.worker.attention import paged

    paged.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=paged.ATTENTION_NAME).eval()
    cpu = torch.device("cpu")
    shapes = probe_layer_shapes(model, cpu)
    cache = CacheConfig(block_size=16, cuda_memory_fraction=0.5)
    caches: list[PagedKVCache] = []

    def runner_over(kv_cache: PagedKVCache) -> ModelRunner:
        caches.append(kv_cache)
        return ModelRunner(model, kv_cache, cpu)

    free, total = 3 * 2**20, 4 * 2**20
    blocks = kv_sizing.profile_kv_blocks(runner_over, shapes, torch.float32, cpu, cache, 40, lambda: (free, total))
    bytes_per_block = PagedKVCache.bytes_per_token(shapes, torch.float32) * 16
    assert blocks == int((free - 0.5 * total) * 0.9) // bytes_per_block + 3  # + the profile's 3 blocks
    (profiled,) = caches
    assert profiled.num_blocks == 3 and profiled.keys[0][:40].abs().sum() > 0  # the forward pass wrote K
