"""Where a prefill chunk may end when image tokens attend both ways, and the mask they get."""

from __future__ import annotations

import torch

from inference_service.engine.both_way_spans import fit_chunk
from inference_service.engine.request import Request
from inference_service.sampling_params import ImageInput, SamplingParams, StoppingParams
from inference_service.worker.attention.prefill import prefill_mask


def request_with_spans(*spans: tuple[int, int], image_tokens: int | None = None) -> Request:
    """Images filling their spans (Gemma 3), or each its first `image_tokens` (PaliGemma's prefix)."""
    request = Request("r", list(range(40)), SamplingParams(), StoppingParams(max_new_tokens=4))
    images = tuple(
        ImageInput(
            positions=tuple(range(a, a + image_tokens if image_tokens else b)),
            content_hash=bytes([i]) * 8,
            pixel_values=None,
            span=(a, b),
        )
        for i, (a, b) in enumerate(spans)
    )
    request.with_images(images)
    return request


def test_a_chunk_never_ends_inside_a_span():
    request = request_with_spans((10, 20), (25, 30))
    assert fit_chunk(request, 0, 8) == 8  # ends before the first span
    assert fit_chunk(request, 0, 15) == 10  # would cut it: stops before it
    assert fit_chunk(request, 10, 4) == 10  # starts at it, nothing fits before: runs it whole
    assert fit_chunk(request, 12, 4) == 8  # starts inside (a prefix-cache hit): runs to its end
    assert fit_chunk(request, 10, 4, may_grow=False) == 0  # a top-up never grows past the budget
    assert fit_chunk(request, 20, 7) == 5  # the second span
    assert fit_chunk(request, 0, 40) == 40
    assert fit_chunk(request, 0, 0) == 0


def test_a_request_without_spans_is_left_alone():
    request = Request("r", list(range(40)), SamplingParams(), StoppingParams(max_new_tokens=4))
    assert fit_chunk(request, 0, 15) == 15


def test_span_tokens_are_keyed_by_the_whole_span():
    """PaliGemma's image blocks depend on the text after them: other text, other keys."""
    one, other = request_with_spans((0, 30), image_tokens=16), request_with_spans((0, 30), image_tokens=16)
    other.prompt_token_ids[25] = 99  # a text token of the prefix
    other.with_images(other.images)
    assert one.block_key(0, 8) != other.block_key(0, 8)
    assert one.block_key(32, 40) == other.block_key(32, 40)


def test_the_mask_is_causal_or_within_a_span_then_windowed():
    mask = prefill_mask(6, 2, None, torch.device("cpu"), ((3, 6),))  # queries 2..7 over keys 0..7
    expected = torch.tensor([[k <= q or (3 <= q < 6 and 3 <= k < 6) for k in range(8)] for q in range(2, 8)])
    assert torch.equal(mask, expected)
    windowed = prefill_mask(6, 2, 2, torch.device("cpu"), ((3, 6),))
    assert torch.equal(windowed, expected & torch.tensor([[k > q - 2 for k in range(8)] for q in range(2, 8)]))
