"""The native CPU decode attention computes the same as plain float64 math and the torch path.

Caches hold random data in shuffled blocks, so a kernel reading the wrong slot, head or block
can't pass; contexts of 1 token, exact block multiples and long ones, grouped-query ratios up to
the kernel's limit, sliding windows and softcap are all compared. Shapes the kernel does not take
must fall back to the torch path, and a machine without a compiler must still serve.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from inference_service.worker.attention import paged as attention
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache
from inference_service.worker.attention.step_metadata import StepMetadata
from inference_service.worker.kernels import bindings as cpu_kernels
from inference_service.worker.kernels import native_build
from inference_service.worker.kernels.bf16_glue import BF16DecodeGlue
from inference_service.worker.kernels.decode_glue import decode_glue_for

BLOCK_SIZE = 4
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.PagedDecodeKernel:
    built = cpu_kernels.load_paged_decode()
    assert built is not None, "the native decode kernel did not build (is a C++ compiler installed?)"
    return built


class Batch:
    """Random decode batch: q [S, H, D], a filled cache, shuffled block tables padded with block 0."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        context_lens: list[int],
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ):
        generator = torch.Generator().manual_seed(seed)
        blocks_needed = [-(-n // BLOCK_SIZE) for n in context_lens]
        num_blocks = sum(blocks_needed) + 3
        self.cache = PagedKVCache(
            [LayerShape(num_kv_heads, head_dim)], num_blocks, BLOCK_SIZE, dtype, torch.device("cpu")
        )
        for tensor in (*self.cache.layer(0),):
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
        order = torch.randperm(num_blocks, generator=generator).tolist()
        self.tables: list[list[int]] = []
        for count in blocks_needed:
            self.tables.append(order[:count])
            order = order[count:]
        width = max(blocks_needed)
        self.block_table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        self.context_lens = torch.tensor(context_lens)
        self.q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator).to(dtype)
        self.scale = head_dim**-0.5

    def reference(self, window: int | None, softcap: float | None) -> torch.Tensor:
        """Per sequence and head, in float64: softmax over the (windowed) prefix, weighted values."""
        keys, values = (t.double() for t in self.cache.layer(0))
        groups = self.q.shape[1] // keys.shape[1]
        out = torch.empty(self.q.shape, dtype=torch.float64)
        for s, (table, length) in enumerate(zip(self.tables, self.context_lens.tolist(), strict=True)):
            slots = torch.tensor([table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(length)])
            if window is not None:
                slots = slots[max(0, length - window) :]
            for h in range(self.q.shape[1]):
                k, v = keys[slots, h // groups], values[slots, h // groups]  # [n, D]
                scores = (k @ self.q[s, h].double()) * self.scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[s, h] = torch.softmax(scores, dim=0) @ v
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
        return attention.attend_decode(meta, self.q.transpose(0, 1), keys, values, self.scale, window, softcap)


# Context lengths: 1 token, exact block multiples, one longer than the rest (padding in the table).
FEW = [1, 8, 13]  # fewer parts than 2 per thread (2+ threads): the kernel splits work by KV head
MANY = [1, 4, 5, 8, 9, 13, 16, 17, 3, 40, 2, 7]  # whole sequences per work item


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (9, 3, 64), (8, 1, 32), (16, 2, 128), (6, 3, 8)]
)
@pytest.mark.parametrize("context_lens", [FEW, MANY], ids=["few", "many"])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 2.0), (6, 1.5)])
def test_kernel_equals_float64_math_and_the_torch_path(
    kernel, num_heads, num_kv_heads, head_dim, context_lens, window, softcap
):
    batch = Batch(num_heads, num_kv_heads, head_dim, context_lens)
    assert kernel.supports(batch.q, *batch.cache.layer(0))
    native = batch.run(kernel, window, softcap)
    expected = batch.reference(window, softcap)
    assert native.shape == batch.q.shape and native.dtype == torch.float32
    assert (native.double() - expected).abs().max().item() < TOLERANCE
    torch_path = batch.run(None, window, softcap)
    assert (native - torch_path).abs().max().item() < TOLERANCE


@contextlib.contextmanager
def num_threads(count: int):
    """torch's thread count, which the kernel's OpenMP region follows, set to `count` for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# The kernel's parts take every KV head (cache rows read whole) when there are at least 2 parts per
# thread, and one KV head otherwise; each head's arithmetic is the same in both, so thread counts
# that pick either agree.
MANY_WITH_A_LONG_ONE = [*MANY, 300]  # 300 positions split in two: 14 parts, every KV head up to 7 threads, one at 8
SIXTEEN_LONG = [256, 255, 250, 241, 240, 200, 193, 180, 177, 160, 150, 129, 128, 100, 99, 64]  # rows enough for threads


@pytest.mark.parametrize(
    "context_lens", [MANY, MANY_WITH_A_LONG_ONE, SIXTEEN_LONG], ids=["many", "one-long", "sixteen"]
)
@pytest.mark.parametrize("window", [None, 37])
def test_results_do_not_depend_on_the_number_of_threads(kernel, context_lens, window):
    batch = Batch(9, 3, 64, context_lens)
    with num_threads(1):
        one = batch.run(kernel, window)
    assert (one.double() - batch.reference(window, None)).abs().max().item() < TOLERANCE
    for count in (2, 3, 8):
        with num_threads(count):
            assert torch.equal(batch.run(kernel, window), one)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (9, 1, 16, torch.float32),  # 9 query heads per KV head: beyond the instantiated groups
        (4, 2, 12, torch.float32),  # head size not a multiple of 8
        (4, 2, 16, torch.bfloat16),  # not fp32
    ],
)
def test_shapes_the_kernel_refuses_take_the_torch_path(kernel, num_heads, num_kv_heads, head_dim, dtype):
    batch = Batch(num_heads, num_kv_heads, head_dim, FEW, dtype=dtype)
    assert not kernel.supports(batch.q, *batch.cache.layer(0))
    out = batch.run(kernel)
    tolerance = TOLERANCE if dtype == torch.float32 else 5e-2
    assert (out.double() - batch.reference(None, None)).abs().max().item() < tolerance


def test_the_kernel_is_built_once_and_reused(kernel):
    first = cpu_kernels._build(cpu_kernels.SOURCES)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels._build(cpu_kernels.SOURCES) == first
    assert first.stat().st_mtime_ns == stamp


@contextlib.contextmanager
def fresh_build():
    """`load_library` forgets the library it loaded, builds under the patched settings, then forgets again."""
    cpu_kernels.load_library.cache_clear()
    try:
        yield
    finally:
        cpu_kernels.load_library.cache_clear()


def test_without_a_compiler_the_engine_keeps_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with fresh_build(), caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load_paged_decode() is None
        assert cpu_kernels.load_small_batch_linear() is None
    assert "using the torch path" in caplog.text


def test_a_compile_error_is_reported_not_raised(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native_build, "SOURCES", (*native_build.SOURCES, broken))  # what load_library builds
    with fresh_build(), caplog.at_level(logging.WARNING, logger=native_build.__name__):
        assert cpu_kernels.load_paged_decode() is None
    assert "broken.cpp" in caplog.text


@pytest.mark.parametrize(
    ("kernel_for", "kind", "bf16_kind"),
    [
        # bf16 models' decode attention: q widened to fp32, the cache read in place
        (cpu_kernels.decode_kernel_for, cpu_kernels.PagedDecodeKernel, cpu_kernels.PagedDecodeKernel),
        (cpu_kernels.linear_kernel_for, cpu_kernels.SmallBatchLinear, None),
        (decode_glue_for, cpu_kernels.DecodeGlue, BF16DecodeGlue),
    ],
)
def test_the_kernels_apply_to_fp32_cpu_only_and_can_be_switched_off(kernel, monkeypatch, kernel_for, kind, bf16_kind):
    cpu = torch.device("cpu")
    assert isinstance(kernel_for(cpu, torch.float32), kind)
    if bf16_kind is None:
        assert kernel_for(cpu, torch.bfloat16) is None
    else:
        assert isinstance(kernel_for(cpu, torch.bfloat16), bf16_kind)
    assert kernel_for(cpu, torch.float16) is None
    assert kernel_for(torch.device("cuda"), torch.float32) is None
    assert kernel_for(torch.device("cuda"), torch.bfloat16) is None
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "off")
    assert kernel_for(cpu, torch.float32) is None
    assert kernel_for(cpu, torch.bfloat16) is None
