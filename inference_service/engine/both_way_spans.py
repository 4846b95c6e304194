"""Where a prefill chunk may end in a prompt whose image tokens attend both ways (PaliGemma's
prefix, Gemma 3's images): never inside such a span. A token's K/V depend on the tokens after it in
its span, so a span is prefilled in one chunk: a chunk that would end inside one ends before it, or,
when it starts there (nothing fits before), runs to the span's end past the step's budget.
"""

from __future__ import annotations

from inference_service.engine.request import Request


def fit_chunk(request: Request, start: int, num_new: int, may_grow: bool = True) -> int:
    """`num_new` tokens from `start`, moved so the chunk ends outside every both-way span; a chunk
    that cannot end earlier grows to the span's end if `may_grow`, else gets 0 tokens."""
    if num_new <= 0 or not request.images:
        return num_new
    end = start + num_new
    for span_start, span_end in request.both_way_spans:
        if span_start < end < span_end:
            if span_start > start:
                return span_start - start
            return span_end - start if may_grow else 0
    return num_new
