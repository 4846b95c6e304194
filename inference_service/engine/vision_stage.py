"""The vision encoder's stage: images become embedding rows once, at admission, and each step's
prompt chunks carry the rows that replace their image placeholders.

- Requests admitted in the same step have their images encoded in one call (the runner batches
  images of one shape); a request keeps its rows until it ends, so a preemption recomputes only
  the language model's K/V, not the encoder.
- Tokens reused from the prefix cache are never run, so an image whose every token is reused (the
  same image in a follow-up turn) is never encoded: a request's images are encoded when the first
  chunk that runs past their start is scheduled, each once.
- A chunk may cut through an image (chunked prefill): it gets the slice of the image's rows that
  falls inside it.
- Models with multimodal rotary positions (`mrope`) also get each chunk's three positions per token.
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol, runtime_checkable

from inference_service.engine.mrope import prompt_positions
from inference_service.engine.request import Request
from inference_service.outputs import ScheduledRequest
from inference_service.sampling_params import ImageInput


@runtime_checkable
class ImageEncoder(Protocol):
    def encode_images(self, images: list[ImageInput]) -> list[Any]:
        """One tensor [num_tokens, H] per image, in order."""
        ...


class VisionStage:
    """Runs the encoder for newly admitted requests and hands each chunk its image rows."""

    def __init__(self, encoder: ImageEncoder, mrope: bool = False):
        self.encoder = encoder
        self.mrope = mrope  # the language model reads three positions per token (Qwen2-VL)
        self.num_encoded_images = 0

    def prepare(self, scheduled: list[ScheduledRequest], requests: dict[str, Request]) -> None:
        """Encode the images that this step's requests still have to run and that are not encoded
        yet (all of them in one call), then attach each chunk's rows."""
        pending: list[tuple[Request, list[Any], int]] = []  # (request, its rows, index of its image)
        for item in scheduled:
            request = requests[item.request_id]
            if not request.images:
                continue
            if request.image_embeds is None:
                request.image_embeds = [None] * len(request.images)
            for index, image in enumerate(request.images):
                if request.image_embeds[index] is None and image.positions[-1] >= item.num_computed_tokens:
                    pending.append((request, request.image_embeds, index))
        if pending:
            rows = self.encoder.encode_images([request.images[index] for request, _, index in pending])
            self.num_encoded_images += len(pending)
            for (_, embeds_of_request, index), embeds in zip(pending, rows, strict=True):
                embeds_of_request[index] = embeds
        for item in scheduled:
            request = requests[item.request_id]
            if request.images:
                item.image_rows = chunk_rows(request, item.num_computed_tokens, item.num_known_tokens)
                if self.mrope:
                    if request.rope_positions is None:
                        request.rope_positions = prompt_positions(len(request.prompt_token_ids), request.images)
                    item.rope_positions = request.rope_positions.of(item.num_computed_tokens, item.num_new_tokens)
                item.both_way_spans = chunk_spans(request, item.num_computed_tokens, item.num_known_tokens)


def chunk_rows(request: Request, start: int, count: int) -> list[tuple[int, Any]]:
    """(row in the chunk, embedding rows) for the image tokens among tokens [start, start + count):
    one entry per run of an image's placeholders inside the chunk (Idefics3's tiles are several
    runs with text tags between them; most images are one run)."""
    end = start + count
    rows = []
    for image, embeds in zip(request.images, request.image_embeds or (), strict=True):
        positions = image.positions
        first, last = positions[0], positions[-1] + 1
        if last <= start or first >= end:
            continue  # not in this chunk (perhaps reused from the prefix cache, never encoded)
        if embeds is None:
            raise RuntimeError(f"request {request.request_id}: an image in this chunk was not encoded")
        if last - first == len(positions):  # one run of placeholders
            low, high = max(first, start), min(last, end)
            if low < high:
                rows.append((low - start, embeds[low - first : high - first]))
            continue
        index, stop = bisect.bisect_left(positions, start), bisect.bisect_left(positions, end)
        while index < stop:
            run_end = index + 1
            while run_end < stop and positions[run_end] == positions[run_end - 1] + 1:
                run_end += 1
            rows.append((positions[index] - start, embeds[index:run_end]))
            index = run_end
    return rows


def chunk_spans(request: Request, start: int, count: int) -> tuple[tuple[int, int], ...]:
    """The both-way spans holding some of tokens [start, start + count) (the attention's mask)."""
    return tuple((low, high) for low, high in request.both_way_spans if low < start + count and start < high)
