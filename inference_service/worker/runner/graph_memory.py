"""The device memory CUDA graphs of decode steps will hold (`--cuda-graphs`), as arithmetic, so the
KV cache is sized without it (engine/kv_sizing.py) and is tested without a GPU.

StaticDecode (runner/cuda_graphs.py) captures each size at its first step, after the KV cache took
what the profiling forward left: uncounted, the graphs' memory comes out of the 10% wiggle room, and
a large vocabulary or many sizes runs a capture out of memory mid-serving. What they hold:
- per size, its logits for the step's rows, kept as the graph's output: fp32 [B, V], plus the head's
  output in the model's dtype that the cast reads (both outputs of the captured forward);
- once, the static input buffers at the largest size (ids, positions, slots, context lengths, block
  tables in int64 and the Triton kernel's int32 copy);
- once, the largest size's activations while its forward is captured: every size shares one memory
  pool and is captured one at a time, so freed activations are reused by the next capture. A decode
  layer's live rows are bounded by ACTIVATION_ROWS of its widest row (q|k|v and its rotated copies,
  gate|up and the SiLU product, the residual stream and norms);
- per size, the allocator's rounding of its small blocks (SEGMENT_BYTES: one 2 MiB segment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference_service.worker.runner.cuda_graphs import blocks_per_sequence

SEGMENT_BYTES = 2 * 2**20  # the CUDA caching allocator's segment for small allocations
# Copies of a layer's widest activation alive at once in the torch decode path, an estimate from its
# ops (not measured on a GPU yet): q|k|v with its rotated q and k and the attention output; gate|up,
# its SiLU and their product.
ACTIVATION_ROWS = 4


@dataclass(frozen=True)
class DecodeShape:
    """What a decode step's activations are sized by."""

    hidden: int
    qkv_width: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> DecodeShape:
        """From a transformers text config (Llama's names; head_dim derived where it is absent)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
        return cls(config.hidden_size, (heads + 2 * kv_heads) * head_dim, intermediate, config.vocab_size)


def decode_graph_bytes(sizes: tuple[int, ...], shape: DecodeShape, dtype_bytes: int, max_blocks: int) -> int:
    """Bytes the graphs captured at `sizes` hold (0 for none); `dtype_bytes` per activation value,
    `max_blocks` the block table's width."""
    if not sizes:
        return 0
    if min(sizes) < 1 or dtype_bytes < 1 or max_blocks < 1:
        raise ValueError(f"graph sizes, bytes per value and table width must be positive: {sizes}, {dtype_bytes}")
    logits = sum(sizes) * shape.vocab * (4 + dtype_bytes)
    largest = max(sizes)
    buffers = largest * (6 * 8 + max_blocks * (8 + 4))
    widest = max(shape.qkv_width, 2 * shape.intermediate, shape.hidden)
    activations = largest * ACTIVATION_ROWS * widest * dtype_bytes
    return logits + buffers + activations + len(sizes) * SEGMENT_BYTES


def graph_reserve_bytes(
    model_config: Any, sizes: tuple[int, ...], dtype_bytes: int, max_total_tokens: int, speculate: int, block_size: int
) -> int:
    """decode_graph_bytes for a model (its transformers config) whose rows hold up to
    `max_total_tokens` (+ `speculate` guesses) in blocks of `block_size`."""
    if not sizes:
        return 0
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    width = blocks_per_sequence(max_total_tokens, speculate, block_size)
    return decode_graph_bytes(sizes, DecodeShape.of(text_config), dtype_bytes, width)
