"""The device memory CUDA graphs of decode steps hold (runner/graph_memory.py) is kept out of a KV
cache sized by what a profiling forward leaves: arithmetic, checked here without a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from inference_service.config import CacheConfig, parse_cuda_graphs
from inference_service.engine import kv_sizing
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache
from inference_service.worker.runner.graph_memory import (
    ACTIVATION_ROWS,
    SEGMENT_BYTES,
    DecodeShape,
    decode_graph_bytes,
    graph_reserve_bytes,
)

TGI_SIZES = parse_cuda_graphs("1,2,4,8,16,32")
# The demo model's shape (SmolLM2-135M): 9 heads and 3 KV heads of 64, MLP 1536, vocabulary 49152.
DEMO = LlamaConfig(
    hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152
)


def test_the_demo_shape_is_read_from_its_config():
    assert DecodeShape.of(DEMO) == DecodeShape(hidden=576, qkv_width=(9 + 6) * 64, intermediate=1536, vocab=49152)


def test_each_size_holds_its_logits_and_the_largest_its_activations_and_buffers():
    shape = DecodeShape.of(DEMO)
    total = decode_graph_bytes(TGI_SIZES, shape, 2, 128)
    logits = 63 * 49152 * (4 + 2)  # fp32 logits and the bf16 head output, for 1 + 2 + ... + 32 rows
    buffers = 32 * (6 * 8 + 128 * 12)
    activations = 32 * ACTIVATION_ROWS * 2 * 1536 * 2  # gate|up is the widest row
    assert total == logits + buffers + activations + 6 * SEGMENT_BYTES
    assert 30 * 2**20 < total < 32 * 2**20  # about 30 MiB for the demo model in bf16
    one_more = decode_graph_bytes((*TGI_SIZES, 64), shape, 2, 128)
    assert one_more - total > 64 * 49152 * 6  # a larger size adds its logits, and its activations
    assert decode_graph_bytes((), shape, 2, 128) == 0 == graph_reserve_bytes(DEMO, (), 2, 4096, 0, 16)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        decode_graph_bytes((0, 4), DecodeShape.of(DEMO), 2, 8)


def test_the_reserve_reads_the_block_table_width_from_the_context():
    short = graph_reserve_bytes(DEMO, TGI_SIZES, 2, 1024, 0, 16)
    long = graph_reserve_bytes(DEMO, TGI_SIZES, 2, 8192, 4, 16)
    assert long - short == 32 * 12 * (-(-(8192 + 4 + 1) // 16) - (-(-(1024 + 1) // 16)))


def test_the_graphs_come_out_of_the_kv_budget_before_blocks_are_sized():
    """profile_kv_blocks with the graphs' reserve: exactly the blocks that memory would have held fewer."""
    shapes = [LayerShape(3, 64)] * 30
    cache = CacheConfig(block_size=16, cuda_memory_fraction=0.9)
    free, total = 40 * 2**30, 80 * 2**30
    cpu = torch.device("cpu")

    class NoForward:
        def execute(self, scheduled):
            return None

    def blocks(reserved: int) -> int:
        return kv_sizing.profile_kv_blocks(
            lambda kv: NoForward(),
            shapes,
            torch.bfloat16,
            cpu,
            cache,
            16,
            lambda: (free, total),
            reserved_bytes=reserved,
        )

    reserve = graph_reserve_bytes(DEMO, TGI_SIZES, 2, 8192, 0, 16)
    per_block = PagedKVCache.bytes_per_token(shapes, torch.bfloat16) * 16
    usable = free - 0.1 * total
    assert blocks(0) - blocks(reserve) == int(usable * 0.9) // per_block - int((usable - reserve) * 0.9) // per_block
    assert blocks(0) - blocks(reserve) >= reserve * 0.9 // per_block > 0
