"""How a model runs over transformers' own caches: decoder-only models, and encoder-decoders.

The fallback runner (`runner.py`) keeps a `Sequence` per request and asks one of these for
what differs between the two kinds: what a new request starts with, the model call, and how
sequences stack into a batch and come back out of it.

An encoder-decoder's encoder runs once, when the request starts (again after a preemption); its
output stays with the request. The decoder's first forward fills the cross-attention cache from it,
and later steps read that cache. In a batch, encoder outputs and cross-attention K/V of different
lengths are zero-padded to the longest and masked, as `generate` pads a batch of prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.cache_utils import Cache

from inference_service.outputs import ScheduledRequest
from inference_service.worker.transformers_runner import cache_rows


@dataclass
class Batch:
    """Requests running one forward together, their caches stacked in `ids` order."""

    ids: tuple[str, ...]
    cache: Cache
    inputs: dict = field(default_factory=dict)  # model arguments fixed while the batch lasts ([B, ...])

    def subset(self, ids: tuple[str, ...], device: torch.device) -> Batch:
        """A batch of some of these requests (`ids`, in this batch's order): their rows, copied once."""
        rows = torch.tensor([self.ids.index(i) for i in ids], dtype=torch.long, device=device)
        inputs = {
            name: tuple(t.index_select(0, rows) for t in value)
            if isinstance(value, tuple)
            else value.index_select(0, rows)
            for name, value in self.inputs.items()
        }
        return Batch(ids, cache_rows.select(self.cache, rows), inputs)


@dataclass
class Sequence:
    """One request's cache: its own (`cache`), or row `row` of the batch it last ran in."""

    cache: Cache | None
    encoder_output: torch.Tensor | None = None  # [1, S, H]: encoder-decoders only
    batch: Batch | None = None
    row: int = 0


class DecoderOnlyForward:
    def __init__(self, model: Any, device: torch.device):
        # model: a transformers PreTrainedModel, whose attributes torch types as tensors
        self.model, self.device = model, device

    def start(self, item: ScheduledRequest) -> Sequence:
        return Sequence(DynamicCache(config=self.model.config))

    def start_batch(self, ids: tuple[str, ...], items: list[ScheduledRequest]) -> None:
        return None  # prompts of several lengths would need padding the positions can't take

    def batch(self, ids: tuple[str, ...], sequences: list[Sequence]) -> Batch:
        # a decoder-only sequence's cache is the DynamicCache `start` gave it, or a row of a stacked one
        return Batch(ids, cache_rows.stack([cast(DynamicCache, s.cache) for s in sequences]))

    def take(self, batch: Batch, index: int, sequence: Sequence) -> Cache:
        return cache_rows.row(cast(DynamicCache, batch.cache), index)  # stacked by `batch`

    def inputs(self, sequence: Sequence) -> dict:
        return {}

    def logits(self, ids: torch.Tensor, cache: Cache, inputs: dict, num_cached: int) -> torch.Tensor:
        """fp32 logits [B, n, V] of `ids` [B, n], each row continuing `num_cached` cached tokens."""
        mask = torch.ones(ids.shape[0], num_cached + ids.shape[1], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        return out.logits.float()


class EncoderDecoderForward:
    def __init__(self, model: Any, device: torch.device):
        # model: a transformers PreTrainedModel, whose attributes torch types as tensors
        self.model, self.device = model, device
        self.encoder = model.get_encoder()

    def start(self, item: ScheduledRequest) -> Sequence:
        if not item.encoder_token_ids:
            raise RuntimeError(f"request {item.request_id} starts with no encoder input")
        ids = torch.tensor([item.encoder_token_ids], dtype=torch.long, device=self.device)  # [1, S]
        encoder_output = self.encoder(input_ids=ids).last_hidden_state  # [1, S, H]
        return Sequence(EncoderDecoderCache(DynamicCache(), DynamicCache()), encoder_output)

    def start_batch(self, ids: tuple[str, ...], items: list[ScheduledRequest]) -> tuple[Batch, list[Sequence]]:
        """Requests starting together: one padded encoder pass, and a batch whose empty caches their
        first decoder step fills."""
        encoder_ids: list[list[int]] = []
        for item in items:
            if item.encoder_token_ids is None:
                raise RuntimeError(f"request {item.request_id} starts with no encoder input")
            encoder_ids.append(item.encoder_token_ids)
        lengths = [len(ids_) for ids_ in encoder_ids]
        longest = max(lengths)
        padded = [ids_ + [0] * (longest - n) for ids_, n in zip(encoder_ids, lengths, strict=True)]
        mask = torch.tensor([[1] * n + [0] * (longest - n) for n in lengths], dtype=torch.long, device=self.device)
        ids_tensor = torch.tensor(padded, dtype=torch.long, device=self.device)  # [B, S]
        encoder_output = self.encoder(input_ids=ids_tensor, attention_mask=mask).last_hidden_state  # [B, S, H]
        batch = Batch(
            ids,
            EncoderDecoderCache(DynamicCache(), DynamicCache()),
            {"encoder_outputs": (encoder_output,), "attention_mask": mask},
        )
        sequences = [Sequence(None, encoder_output[i : i + 1, :n], batch, i) for i, n in enumerate(lengths)]
        return batch, sequences

    def batch(self, ids: tuple[str, ...], sequences: list[Sequence]) -> Batch:
        # an encoder-decoder sequence holds its encoder output and an EncoderDecoderCache of DynamicCaches
        outputs = [cast(torch.Tensor, s.encoder_output) for s in sequences]
        caches = [cast(EncoderDecoderCache, s.cache) for s in sequences]
        lengths = [output.shape[1] for output in outputs]
        longest = max(lengths)
        cache = EncoderDecoderCache(
            cache_rows.stack([c.self_attention_cache for c in caches]),
            cache_rows.stack([c.cross_attention_cache for c in caches], pad_to=longest),
        )
        padded = [
            torch.nn.functional.pad(output, (0, 0, 0, longest - n)) for output, n in zip(outputs, lengths, strict=True)
        ]
        mask = torch.tensor([[1] * n + [0] * (longest - n) for n in lengths], dtype=torch.long, device=self.device)
        return Batch(ids, cache, {"encoder_outputs": (torch.cat(padded),), "attention_mask": mask})

    def take(self, batch: Batch, index: int, sequence: Sequence) -> Cache:
        length = cast(torch.Tensor, sequence.encoder_output).shape[1]
        cache = cast(EncoderDecoderCache, batch.cache)  # stacked by `batch` or `start_batch`
        return EncoderDecoderCache(
            cache_rows.row(cache.self_attention_cache, index),
            cache_rows.row(cache.cross_attention_cache, index, length),
        )

    def inputs(self, sequence: Sequence) -> dict:
        return {"encoder_outputs": (sequence.encoder_output,)}

    def logits(self, ids: torch.Tensor, cache: Cache, inputs: dict, num_cached: int) -> torch.Tensor:
        """fp32 logits [B, n, V] of decoder tokens `ids` [B, n] (the cache knows how many came before)."""
        out = self.model(decoder_input_ids=ids, past_key_values=cache, use_cache=True, **inputs)
        return out.logits.float()


def forward_for(model: torch.nn.Module, device: torch.device) -> DecoderOnlyForward | EncoderDecoderForward:
    if getattr(model.config, "is_encoder_decoder", False):
        return EncoderDecoderForward(model, device)
    return DecoderOnlyForward(model, device)
