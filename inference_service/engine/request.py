"""A request's state inside the engine: counters, not phases."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from inference_service.outputs import FinishReason, RequestTimings
from inference_service.sampling_params import ImageInput, SamplingParams, StoppingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything above PREEMPTED is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISHED_STATUS = {
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.EOS_TOKEN: RequestStatus.FINISHED_STOPPED,
    FinishReason.STOP_SEQUENCE: RequestStatus.FINISHED_STOPPED,
}


@dataclass
class Request:
    """One generation. Tokens [0, num_computed_tokens) have their K/V in the cache.

    Only the scheduler changes `status` and `num_computed_tokens`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    timings: RequestTimings = field(default_factory=lambda: RequestTimings(arrival=time.perf_counter()))
    prompt_logprobs_done: bool = False  # recomputation after preemption must not resend them
    # Speculation: guesses of the tokens after the known ones, set before a step, verified in it.
    draft_token_ids: list[int] = field(default_factory=list)
    # Hash chain of the full blocks of prompt + output (prefix caching), grown as needed.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Encoder-decoders: the caller's prompt, read by the encoder; `prompt_token_ids` is then the
    # decoder's start (its K/V is what the blocks budget).
    encoder_token_ids: list[int] | None = None
    adapter_id: str | None = None  # the LoRA adapter computing it; None: the base model
    # Images: their placeholders' positions and pixels; the encoder's rows for each, computed once
    # when a chunk first needs them (None: not yet, or never: all its tokens came from the prefix
    # cache) and kept across preemptions; the prompt ids the block hashes read, each image token
    # standing for its image's content (None: the prompt ids themselves).
    images: tuple[ImageInput, ...] = ()
    image_embeds: list[Any] | None = None
    rope_positions: Any = None  # multimodal rotary models: `mrope.PromptPositions`, made at admission
    hash_token_ids: list[int] | None = field(default=None, repr=False)

    def with_images(self, images: tuple[ImageInput, ...]) -> None:
        self.images = images
        if images:
            ids = list(self.prompt_token_ids)
            for image in images:
                content_id = int.from_bytes(image.content_hash[:8], "little", signed=True)
                for position in image.positions:
                    ids[position] = content_id
            self.hash_token_ids = span_keyed(ids, self.both_way_spans)

    @property
    def both_way_spans(self) -> tuple[tuple[int, int], ...]:
        """Prompt spans whose tokens attend to each other both ways (a chunk never ends inside one)."""
        return tuple(sorted({image.span for image in self.images if image.span is not None}))

    def block_key(self, start: int, end: int) -> list[int]:
        """What the prefix cache hashes for tokens [start, end): the tokens, an image's by content."""
        if self.hash_token_ids is None or start >= len(self.hash_token_ids):
            return self.token_ids(start, end)
        if end <= len(self.hash_token_ids):
            return self.hash_token_ids[start:end]
        return self.hash_token_ids[start:] + self.token_ids(len(self.hash_token_ids), end)

    @property
    def num_input_tokens(self) -> int:
        """The caller's prompt length (the encoder's input for encoder-decoders)."""
        return len(self.encoder_token_ids) if self.encoder_token_ids is not None else len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


def span_keyed(ids: list[int], spans: tuple[tuple[int, int], ...]) -> list[int]:
    """Block-hash ids where a token of a both-ways span stands for the whole span's content: its K/V
    depend on the tokens after it in the span (PaliGemma's image reads the prompt's text)."""
    for start, end in spans:
        digest = hashlib.blake2b(repr(ids[start:end]).encode(), digest_size=8).digest()
        span_id = int.from_bytes(digest, "little", signed=True)
        ids[start:end] = [span_id] * (end - start)
    return ids
