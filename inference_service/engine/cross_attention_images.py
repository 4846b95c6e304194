"""Images of cross-attention models (Mllama): the language model reads an image's encoder output
through its own cross-attention layers instead of embedding rows in the prompt, so the runner
(transformers' model code on the fallback path) encodes the images itself, in the request's first
chunk. This stage hands each first chunk (again after a preemption, which recomputes) its images."""

from __future__ import annotations

from inference_service.engine.request import Request
from inference_service.outputs import ScheduledRequest


class CrossAttentionImages:
    """`VisionStage`'s place for models whose runner encodes the images."""

    def __init__(self) -> None:
        self.num_encoded_images = 0  # handed to the runner, which encodes each in that chunk

    def prepare(self, scheduled: list[ScheduledRequest], requests: dict[str, Request]) -> None:
        for item in scheduled:
            if item.num_computed_tokens == 0:
                item.images = requests[item.request_id].images
                self.num_encoded_images += len(item.images)
