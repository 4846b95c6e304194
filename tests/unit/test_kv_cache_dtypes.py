"""The KV cache in each --kv-cache-dtype, and the native decode attention reading it in place.

Every cache is filled through `PagedKVCache.write` (the conversion the engine runs) from random fp32
rows, in shuffled blocks. The kernel is checked two ways: against float64 math over the values the
cache holds (only the kernel's own arithmetic differs: tight), and against float64 math over the
fp32 rows before conversion (the dtype's rounding: the stated tolerances below). Contexts are ragged
up to 16k positions, so the split along the context and the merge of its parts run; grouped-query
ratios, sliding windows and softcap are all covered.
"""

from __future__ import annotations

import pytest
import torch

from inference_service import config
from inference_service.engine import kv_sizing
from inference_service.worker.attention import paged as attention
from inference_service.worker.attention.kv_cache import (
    KV_CACHE_DTYPES,
    LayerShape,
    PagedKVCache,
    quantize_int8,
    resolve_kv_dtype,
    widen,
)
from inference_service.worker.attention.prefill import prefill_mask
from inference_service.worker.attention.softcap import attend_softcapped
from inference_service.worker.attention.step_metadata import StepMetadata
from inference_service.worker.kernels import bindings as cpu_kernels

KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
# The kernel against float64 math over the stored values: fp32 accumulation only.
KERNEL_TOLERANCE = 1e-5
# Against float64 math over the fp32 rows before conversion, absolute, on outputs that are averages of
# N(0, 1) values with keys up to 4x that (largest errors seen over these tests: fp32 1.5e-6, fp16
# 2.4e-3, bf16 2.2e-2, int8 4.3e-2): fp16 keeps 11 significant bits, bf16 8, int8 absmax / 127 per
# row of a head.
DTYPE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2, torch.int8: 6e-2}


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.PagedDecodeKernel:
    built = cpu_kernels.load_paged_decode()
    assert built is not None, "the native decode kernel did not build (is a C++ compiler installed?)"
    return built


@pytest.fixture(scope="module")
def writer() -> cpu_kernels.KVWriter:
    built = cpu_kernels.load_kv_writer()
    assert built is not None
    return built


class Batch:
    """A decode batch over a cache of `kv_dtype` written from random fp32 rows, blocks shuffled."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        context_lens: list[int],
        kv_dtype: torch.dtype,
        block_size: int = 16,
        writer: cpu_kernels.KVWriter | None = None,
        seed: int = 0,
    ):
        generator = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        blocks_needed = [-(-n // block_size) for n in context_lens]
        num_blocks = sum(blocks_needed) + 3
        self.cache = PagedKVCache(
            [LayerShape(num_kv_heads, head_dim)],
            num_blocks,
            block_size,
            torch.float32,
            torch.device("cpu"),
            kv_dtype,
            writer,
        )
        num_slots = num_blocks * block_size
        # Per-head offsets: rows of different heads and positions differ in scale, as real keys do.
        self.keys = torch.randn(num_slots, num_kv_heads, head_dim, generator=generator) * (
            1 + 3 * torch.rand(num_slots, num_kv_heads, 1, generator=generator)
        )
        self.values = torch.randn(num_slots, num_kv_heads, head_dim, generator=generator)
        self.cache.write(0, torch.arange(num_slots), self.keys, self.values)
        order = torch.randperm(num_blocks, generator=generator).tolist()
        self.tables: list[list[int]] = []
        for count in blocks_needed:
            self.tables.append(order[:count])
            order = order[count:]
        width = max(blocks_needed)
        self.block_table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        self.context_lens = torch.tensor(context_lens)
        self.q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator)
        self.scale = head_dim**-0.5

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The values the cache holds, in float64."""
        scales = self.cache.scales(0) or (None, None)
        keys, values = (widen(t, s, torch.float64) for t, s in zip(self.cache.layer(0), scales, strict=True))
        return keys, values

    def reference(
        self, window: int | None, softcap: float | None, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Per sequence, in float64: softmax over the (windowed) prefix, weighted values."""
        groups = self.q.shape[1] // keys.shape[1]
        out = torch.empty(self.q.shape, dtype=torch.float64)
        bs = self.block_size
        for s, (table, length) in enumerate(zip(self.tables, self.context_lens.tolist(), strict=True)):
            positions = torch.arange(max(0, length - window) if window else 0, length)
            slots = torch.tensor(table)[positions // bs] * bs + positions % bs
            q = self.q[s].double().view(keys.shape[1], groups, -1)  # [KVH, G, D]
            scores = torch.einsum("nkd,kgd->kgn", keys[slots], q) * self.scale  # [KVH, G, n]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[s] = torch.einsum("kgn,nkd->kgd", torch.softmax(scores, dim=-1), values[slots]).flatten(0, 1)
        return out

    def run(self, decode_kernel, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Through the attention module's decode path ([S, H, Dv]), with or without the kernel."""
        meta = StepMetadata(
            kv_cache=self.cache,
            num_tokens=len(self.context_lens),
            slot_mapping=torch.zeros(0, dtype=torch.long),
            decode_block_table=self.block_table,
            decode_context_lens=self.context_lens,
            decode_only=True,
            decode_kernel=decode_kernel,
        )
        keys, values = self.cache.layer(0)
        q = self.q.transpose(0, 1)
        return attention.attend_decode(meta, q, keys, values, self.scale, window, softcap, self.cache.scales(0))


def max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.double() - expected).abs().max().item()


RAGGED = [1, 15, 16, 17, 300, 2049]
LONG = [16384, 5, 9000, 1000]  # up to 16k; fewer sequences than parts: split along the context


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window", "softcap"),
    [
        (9, 3, 64, None, None),  # the demo model's shape
        (8, 1, 32, 37, None),  # 8 query heads per KV head, a window not a multiple of the block
        (16, 2, 128, None, 2.0),
        (4, 4, 16, 700, 1.5),  # one query head per KV head; window and softcap together
        (6, 3, 8, 16, None),  # a window of exactly one block
    ],
)
def test_kernel_equals_float64_math_per_kv_dtype(kernel, kv_dtype, num_heads, num_kv_heads, head_dim, window, softcap):
    batch = Batch(num_heads, num_kv_heads, head_dim, RAGGED, kv_dtype)
    assert kernel.supports(batch.q, *batch.cache.layer(0))
    out = batch.run(kernel, window, softcap)
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    assert max_error(out, batch.reference(window, softcap, *batch.stored())) < KERNEL_TOLERANCE
    exact = batch.reference(window, softcap, batch.keys.double(), batch.values.double())
    assert max_error(out, exact) < DTYPE_TOLERANCE[kv_dtype]
    torch_path = batch.run(None, window, softcap)  # the fallback widens a gathered copy
    assert max_error(out, torch_path.double()) < KERNEL_TOLERANCE


@pytest.mark.parametrize(
    ("kv_dtype", "window", "softcap"),
    [(torch.float32, None, None), (torch.float16, 4096, 30.0), (torch.bfloat16, None, 30.0), (torch.int8, None, None)],
    ids=str,
)
def test_contexts_up_to_16k(kernel, kv_dtype, window, softcap):
    batch = Batch(9, 3, 64, LONG, kv_dtype, seed=1)
    out = batch.run(kernel, window, softcap)
    assert max_error(out, batch.reference(window, softcap, *batch.stored())) < KERNEL_TOLERANCE
    exact = batch.reference(window, softcap, batch.keys.double(), batch.values.double())
    assert max_error(out, exact) < DTYPE_TOLERANCE[kv_dtype]


# At least 4 sequences per thread, none split along its context (at most 256 positions, or a window):
# the kernel reads each sequence's rows whole for every KV head at once.
SHORT_MANY = [1, 15, 16, 17, 256, 64, 33, 2, 300]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(("window", "softcap"), [(37, None), (None, 30.0)])
def test_whole_sequences_per_kv_dtype(kernel, kv_dtype, window, softcap):
    lens = SHORT_MANY if window else SHORT_MANY[:-1]
    batch = Batch(9, 3, 64, lens, kv_dtype, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # 4 sequences per thread or more: whole sequences
        whole = batch.run(kernel, window, softcap)
        torch.set_num_threads(8)  # fewer: one KV head per part
        per_head = batch.run(kernel, window, softcap)
    finally:
        torch.set_num_threads(threads)
    assert max_error(whole, batch.reference(window, softcap, *batch.stored())) < KERNEL_TOLERANCE
    assert torch.equal(whole, per_head)


def test_long_contexts_do_not_depend_on_the_number_of_threads(kernel):
    batch = Batch(9, 3, 64, [16384], torch.float16, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = batch.run(kernel)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, batch.run(kernel))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_native_write_stores_what_the_torch_conversion_stores(writer, kv_dtype):
    native = Batch(9, 3, 64, RAGGED, kv_dtype, writer=writer, seed=3)
    plain = Batch(9, 3, 64, RAGGED, kv_dtype, seed=3)
    for stored_native, stored_plain in zip(native.cache.layer(0), plain.cache.layer(0), strict=True):
        assert stored_native.dtype == kv_dtype
        if kv_dtype == torch.int8:  # the same codes up to a division's last bit
            assert (stored_native.int() - stored_plain.int()).abs().max().item() <= 1
        else:
            assert torch.equal(stored_native, stored_plain)
    if kv_dtype == torch.int8:
        native_scales, plain_scales = native.cache.scales(0), plain.cache.scales(0)
        assert native_scales is not None and plain_scales is not None
        for a, b in zip(native_scales, plain_scales, strict=True):
            torch.testing.assert_close(a, b)


def test_the_decode_step_writes_rows_of_a_wider_tensor(writer):
    """The decode step hands the writer k and v as column slices of the fused qkv rows."""
    cache = PagedKVCache([LayerShape(2, 8)], 4, 4, torch.float32, torch.device("cpu"), torch.int8, writer)
    qkv = torch.randn(3, 6 + 2 * 2, 8)
    slots = torch.tensor([5, 0, 11])
    cache.write(0, slots, qkv[:, 6:8], qkv[:, 8:])
    keys, values = cache.read(0, slots)
    torch.testing.assert_close(keys, qkv[:, 6:8], atol=qkv.abs().max().item() / 127, rtol=0)
    torch.testing.assert_close(values, qkv[:, 8:], atol=qkv.abs().max().item() / 127, rtol=0)


def test_int8_rows_of_zeros_and_of_extremes():
    rows = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1e-30, -2e-30, 0.0, 5e-31], [3e4, -3e4, 1.0, 0.0]])
    codes, scales = quantize_int8(rows)
    assert codes[0].tolist() == [0, 0, 0, 0] and scales[0].item() == 0
    assert codes[2, 0].item() == 127 and codes[2, 1].item() == -127
    restored = widen(codes, scales, torch.float32)
    assert ((restored - rows).abs() <= scales[:, None] / 2 * 1.0001).all()  # half a step of the row's scale
    assert torch.isfinite(restored).all()


def test_smaller_kv_dtypes_fit_more_tokens_in_the_same_bytes():
    shapes = [LayerShape(3, 64)] * 30
    per_token = {dtype: PagedKVCache.bytes_per_token(shapes, dtype) for dtype in KV_DTYPES}
    assert per_token[torch.float32] == 2 * 30 * 3 * 64 * 4
    assert per_token[torch.float16] == per_token[torch.bfloat16] == per_token[torch.float32] // 2
    assert per_token[torch.int8] == 2 * 30 * 3 * (64 + 4)  # codes and one fp32 scale per head


def test_kv_cache_dtype_names():
    assert resolve_kv_dtype(None, torch.float32) is torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("fp16", torch.float32) is torch.float16
    assert resolve_kv_dtype("int8", torch.float32) is torch.int8
    assert set(KV_CACHE_DTYPES) >= {"auto", "fp32", "fp16", "bf16", "int8"}
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        resolve_kv_dtype("fp8_e4m3fn", torch.float32)


def test_every_flag_value_names_a_dtype():
    assert set(config.KV_CACHE_DTYPES) == set(KV_CACHE_DTYPES)


def test_the_memory_budget_counts_the_smaller_entries():
    """The same --kv-cache-memory holds twice the blocks in fp16/bf16 and ~3.8x in int8."""
    shapes = [LayerShape(3, 64)] * 30  # the demo model's
    blocks = {
        name: kv_sizing.plan_num_blocks(
            config.CacheConfig(kv_cache_memory="256MiB", kv_cache_dtype=name),
            shapes,
            resolve_kv_dtype(name, torch.float32),
            torch.device("cpu"),
        )
        for name in ("auto", "fp16", "bf16", "int8")
    }
    assert blocks["fp16"] == blocks["bf16"] == 2 * blocks["auto"]
    assert blocks["int8"] == 256 * 2**20 // (16 * 2 * 30 * 3 * (64 + 4))
    assert blocks["int8"] > 3.7 * blocks["auto"]


@pytest.mark.parametrize(("heads", "kv_heads", "tile"), [(4, 4, 1024), (6, 2, 7), (8, 1, 16)])
@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_softcapped_attention_in_tiles_equals_the_whole_score_matrix(heads, kv_heads, tile, shape):
    """The softcap path (no SDPA) never holds a context-wide score matrix: tiles of keys with an online
    softmax give what the whole matrix gives, with a causal window mask crossing tile edges."""
    generator = torch.Generator().manual_seed(4)
    batch, n, length, dim = (1, 13, 50, 16) if shape == "prefill" else (3, 1, 50, 16)
    q = torch.randn(batch, heads, n, dim, generator=generator)
    keys = torch.randn(batch, kv_heads, length, dim, generator=generator) * 3
    values = torch.randn(batch, kv_heads, length, dim, generator=generator)
    if shape == "prefill":
        mask = prefill_mask(n, length - n, 20, torch.device("cpu"))  # [n, L]
    else:
        mask = attention._decode_mask(torch.tensor([50, 9, 31]), length, 20)  # [B, 1, 1, L]
    out = attend_softcapped(q, keys, values, mask, 0.25, 5.0, tile=tile)
    groups = heads // kv_heads
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (keys, values))
    scores = torch.tanh(q.double() @ k.transpose(-1, -2) * 0.25 / 5.0) * 5.0
    expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    assert out.shape == (batch, heads, n, dim)
    assert max_error(out, expected) < 1e-5
