"""Run by test_triton_paged.py in a process of its own (triton must be imported with
TRITON_INTERPRET=1 set, before anything else imports it): the Triton paged attention (the CUDA
backend) matches the reference attention on random paged
layouts: ragged lengths, decode rows and prefill chunks over a cached prefix in one launch, shuffled
block tables, sliding windows, softcap and GQA, within 1e-3 in fp32. Run on CPU under Triton's
interpreter (TRITON_INTERPRET=1), which executes the same kernel code with numpy."""

from __future__ import annotations

import os
import random

import pytest
import torch

# Read when triton is imported: its language functions are then interpreted on CPU tensors.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from inference_service.worker.attention import triton_paged  # noqa: E402

TOLERANCE = 1e-3


@pytest.fixture(scope="module", autouse=True)
def interpreted():
    if type(triton_paged.paged_attention_kernel).__name__ != "InterpretedFunction":
        pytest.fail("triton was imported before this module set TRITON_INTERPRET=1: run it in its own process")


def random_layout(rng: random.Random, seqs: list[tuple[int, int]], block_size: int, num_blocks: int):
    """(layout, per-sequence block lists) for sequences of (context length, query tokens), their
    blocks drawn shuffled from the pool and their query rows packed in shuffled order."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, starts, row = [], [], 0
    order = list(range(len(seqs)))
    rng.shuffle(order)
    start_of = {}
    for index in order:
        start_of[index] = row
        row += seqs[index][1]
    for context, _ in seqs:
        count = -(-context // block_size)
        tables.append([pool.pop() for _ in range(count)])
        starts.append(0)
    width = max(len(t) for t in tables)
    layout = triton_paged.PagedLayout(
        q_start=torch.tensor([start_of[i] for i in range(len(seqs))], dtype=torch.int32),
        q_len=torch.tensor([q for _, q in seqs], dtype=torch.int32),
        seq_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_q_len=max(q for _, q in seqs),
    )
    return layout, tables, row


def reference(q, key_cache, value_cache, layout, tables, block_size, scale, window, softcap):
    """Each query row over its sequence's keys, gathered slot by slot, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // key_cache.shape[1]
    for s, table in enumerate(tables):
        context, num_q, start = int(layout.seq_lens[s]), int(layout.q_len[s]), int(layout.q_start[s])
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(context)])
        keys = key_cache[slots].double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        values = value_cache[slots].double().repeat_interleave(group, dim=1)
        for i in range(num_q):
            position = context - num_q + i
            scores = torch.einsum("hd,khd->hk", q[start + i].double(), keys) * scale  # [H, ctx]
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            keys_pos = torch.arange(context)
            allowed = keys_pos <= position
            if window:
                allowed &= keys_pos > position - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start + i] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), values)
    return out


CASES = [
    # (seqs as (context, query tokens), heads, kv heads, head dim, block size, window, softcap)
    ([(1, 1), (37, 1), (16, 1), (70, 1)], 4, 4, 16, 16, None, None),  # decode rows only, MHA
    ([(23, 23), (40, 9), (5, 1), (33, 1)], 8, 2, 32, 8, None, None),  # fresh prefill, chunk over a prefix, GQA
    ([(40, 40), (64, 1), (31, 7)], 6, 2, 24, 16, 12, None),  # sliding window, head dim not a power of 2
    ([(29, 29), (45, 3), (12, 1)], 4, 1, 16, 4, None, 5.0),  # softcap, one KV head (MQA)
    ([(17, 1), (50, 20)], 4, 2, 32, 16, 9, 30.0),  # window and softcap together
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference_attention(case):
    seqs, heads, kv_heads, head_dim, block_size, window, softcap = CASES[case]
    rng = random.Random(case)
    torch.manual_seed(case)
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 5
    layout, tables, rows = random_layout(rng, seqs, block_size, num_blocks)
    key_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    value_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    q = torch.randn(rows, heads, head_dim)
    scale = head_dim**-0.5 * 2  # peaked attention: a wrong mask moves the output by far more than 1e-3
    out = triton_paged.paged_attention(q, key_cache, value_cache, layout, block_size, scale, window, softcap)
    expected = reference(q, key_cache, value_cache, layout, tables, block_size, scale, window, softcap)
    assert out.dtype == torch.float32
    assert (out.double() - expected).abs().max().item() < TOLERANCE


def test_a_wrong_window_is_caught():
    """The check can fail: the same layout without the window is far from the windowed reference."""
    seqs, heads, kv_heads, head_dim, block_size, window = [(40, 40)], 2, 1, 16, 16, 12
    rng = random.Random(2)
    torch.manual_seed(2)
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 5
    layout, tables, rows = random_layout(rng, seqs, block_size, num_blocks)
    key_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    value_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    q = torch.randn(rows, heads, head_dim)
    out = triton_paged.paged_attention(q, key_cache, value_cache, layout, block_size, 1.0, None, None)
    expected = reference(q, key_cache, value_cache, layout, tables, block_size, 1.0, window, None)
    assert (out.double() - expected).abs().max().item() > 0.1


def test_engine_serves_through_the_kernel_as_through_the_torch_path(tiny_engine_config, monkeypatch):
    """Wired as on CUDA (here forced on CPU tensors): prefill chunks over a cached prefix, then decode
    steps, through the kernel give the torch path's greedy tokens."""
    import dataclasses

    from inference_service.engine.builder import build_engine
    from inference_service.worker.attention import paged
    from tests.conftest import greedy_token_ids

    config = dataclasses.replace(
        tiny_engine_config,
        scheduler=dataclasses.replace(tiny_engine_config.scheduler, max_batch_prefill_tokens=8),  # 3 chunks
        # no prefix cache: the second run would reuse all but the prompt's last token
        cache=dataclasses.replace(tiny_engine_config.cache, prefix_caching=False),
    )
    engine = build_engine(config)
    prompt = "the quick brown fox jumps over a lazy dog"
    expected = greedy_token_ids(engine, prompt, 6)
    calls = []
    original = triton_paged.paged_attention
    monkeypatch.setattr(paged, "_use_triton", lambda query, value: True)
    monkeypatch.setattr(engine.runner, "decode_kernel", None)  # as on CUDA: no CPU kernel is wired
    monkeypatch.setattr(engine.runner, "decode_step", None)  # nor the CPU plan for prompt steps
    monkeypatch.setattr(triton_paged, "paged_attention", lambda *args: calls.append(args[3]) or original(*args))
    assert greedy_token_ids(engine, prompt, 6) == expected
    assert any(layout.max_q_len > 1 for layout in calls) and any(layout.max_q_len == 1 for layout in calls)
