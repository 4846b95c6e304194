"""Runs one step of the model over a packed, ragged batch and returns the logits to sample.

The runner makes no policy: it packs what the scheduler chose, runs the forward pass with our
paged attention, and returns logits for the rows that need them.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_service.outputs import ScheduledRequest, StepLogits
from inference_service.sampling_params import ImageInput
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache
from inference_service.worker.attention.step_metadata import PrefillChunk, StepMetadata, step_context
from inference_service.worker.kernels.bindings import PagedDecodeKernel
from inference_service.worker.lora.batch import LoraStep, group_rows, lora_context
from inference_service.worker.lora.weights import LoraTable
from inference_service.worker.runner.cuda_graphs import StaticDecode
from inference_service.worker.runner.decode_step import DecodeStep
from inference_service.worker.runner.image_encoder import ImageEncoder
from inference_service.worker.step_rows import RowsToKeep


class ModelRunner:
    """Owns the model and the KV cache tensors (and the decode kernel that reads the cache, if any)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache | None,
        device: torch.device,
        decode_kernel: PagedDecodeKernel | None = None,
        decode_step: DecodeStep | None = None,
        image_encoder: ImageEncoder | None = None,
        lora: LoraTable | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.decode_kernel = decode_kernel
        self.decode_step = decode_step  # decode-only steps of Llama-style models, in fewer calls
        self.image_encoder = image_encoder  # vision-language models: images → embedding rows
        self.lora = lora  # resident LoRA adapters (the model's projections are LoRA linears); None: off
        self.static_decode: StaticDecode | None = None  # decode steps as CUDA graphs (cuda_graphs.py)

    lost = None  # nothing it runs on can be lost (Runner.lost)

    # -- one step -------------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledRequest]) -> StepLogits:
        meta, input_ids, position_ids = self._prepare(scheduled)
        rows = RowsToKeep.of(scheduled)
        embeds = self._merged_embeddings(scheduled, input_ids)
        if self.lora is None:
            logits = self.forward(meta, input_ids, position_ids, rows.keep, embeds)  # [K, V]
        else:
            with lora_context(self._lora_step(scheduled, meta.num_tokens)):
                logits = self.forward(meta, input_ids, position_ids, rows.keep, embeds)  # [K, V]
        return rows.step_logits(scheduled, logits, num_attention_calls=meta.num_calls)

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's embedding rows [num_tokens, H] (the vision encoder, batched by shape)."""
        if self.image_encoder is None:
            raise RuntimeError("this model has no image encoder")
        return self.image_encoder.encode_images(images)

    def _merged_embeddings(self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings with image rows in place of their placeholders ([1, T, H]);
        None when no chunk holds an image token (the model embeds the ids itself)."""
        if not any(item.image_rows for item in scheduled):
            return None
        with torch.inference_mode():
            model: Any = self.model  # a transformers PreTrainedModel (torch types its methods as tensors)
            embeds = model.get_input_embeddings()(input_ids).clone()  # [1, T, H]
            token_start = 0
            for item in scheduled:
                for row, rows in item.image_rows:
                    start = token_start + row
                    embeds[0, start : start + rows.shape[0]] = rows.to(embeds.device, embeds.dtype)
                token_start += item.num_new_tokens
        return embeds

    def _lora_step(self, scheduled: list[ScheduledRequest], num_tokens: int) -> LoraStep | None:
        """The step's packed rows grouped by adapter (None: no row uses one)."""
        if self.lora is None or all(item.adapter_id is None for item in scheduled):
            return None
        spans, start = [], 0
        for item in scheduled:
            spans.append((item.adapter_id, start, item.num_new_tokens))
            start += item.num_new_tokens
        return group_rows(self.lora, spans, num_tokens, self.device)

    def release(self, request_id: str) -> None:
        """The request ended; the paged runner keeps nothing per request (its blocks are the
        scheduler's)."""

    def close(self) -> None:
        """Nothing outlives a step here."""

    def describe(self) -> str:
        attention = "native" if self.decode_kernel else "torch"
        steps = self.decode_step or "transformers' layers"
        graphs = f", CUDA graphs at batch sizes {self.static_decode.sizes}" if self.static_decode else ""
        return f"decode attention: {attention}, decode steps: {steps}{graphs}"

    def forward(
        self,
        meta: StepMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep_rows: list[int],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One packed forward pass; returns fp32 logits of `keep_rows` ([K, V]). `inputs_embeds`
        (images merged in) replaces the ids' embeddings."""
        graphs = self.static_decode
        if graphs is not None and inputs_embeds is None and self.lora is None and graphs.takes(meta, input_ids):
            with torch.inference_mode():
                return graphs.run(meta, input_ids, position_ids, keep_rows)
        return self.forward_eager(meta, input_ids, position_ids, keep_rows, inputs_embeds)

    def forward_eager(
        self,
        meta: StepMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep_rows: list[int],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` without CUDA graphs: what StaticDecode captures (or runs eagerly off CUDA)."""
        if self.decode_step is not None and self.decode_step.takes(meta, position_ids):
            with torch.inference_mode():
                return self.decode_step.forward(meta, input_ids, position_ids, keep_rows, inputs_embeds)
        keep = torch.tensor(keep_rows, dtype=torch.long, device=self.device)
        with torch.inference_mode(), step_context(meta):
            if inputs_embeds is not None:
                out = self.model(
                    inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False, logits_to_keep=keep
                )
            else:
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep)
        return out.logits[0].float()

    def _prepare(self, scheduled: list[ScheduledRequest]) -> tuple[StepMetadata, torch.Tensor, torch.Tensor]:
        if self.kv_cache is None:
            raise RuntimeError("steps need the paged KV cache; this runner was built without one")
        block_size = self.kv_cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for item in scheduled:
            start, count = item.num_computed_tokens, item.num_new_tokens
            token_start = len(input_ids)
            input_ids.extend(item.token_ids)
            positions.extend(range(start, start + count))
            table = item.block_ids
            if count == 1 or item.num_draft_tokens:
                # Verified guesses run as decode rows too, row j over the context up to itself: the
                # step writes every row's K/V before any row attends.
                for position in range(start, start + count):
                    slots.append(table[position // block_size] * block_size + position % block_size)
                    decode_rows.append(token_start + position - start)
                    decode_tables.append(table)
                    decode_lens.append(position + 1)
            else:
                context = _slots_of(table, start + count, block_size)  # [ctx]
                slots.extend(context[start:].tolist())
                chunk = PrefillChunk(token_start, count, start, context.to(self.device), item.both_way_spans)
                prefills.append(chunk)
        num_tokens = len(input_ids)
        meta = StepMetadata(
            kv_cache=self.kv_cache,
            num_tokens=num_tokens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            prefills=prefills,
            decode_only=not prefills,
            decode_kernel=self.decode_kernel,
        )
        if decode_rows:
            max_blocks = max(len(t) for t in decode_tables)
            padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
            meta.decode_token_index = torch.tensor(decode_rows, dtype=torch.long, device=self.device)
            meta.decode_block_table = torch.tensor(padded, dtype=torch.long, device=self.device)
            meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.long, device=self.device)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)  # [1, T]
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)  # [1, T]
        if any(item.rope_positions is not None for item in scheduled):
            pos = _with_rope_positions(scheduled, pos)
        return meta, ids, pos


def _with_rope_positions(scheduled: list[ScheduledRequest], pos: torch.Tensor) -> torch.Tensor:
    """Multimodal rotary positions ([4, 1, T]): the sequence positions (transformers' text row),
    then each token's three (a request without them has its sequence position in all three)."""
    three = pos.expand(3, -1).clone()  # [3, T]
    token_start = 0
    for item in scheduled:
        if item.rope_positions is not None:
            three[:, token_start : token_start + item.num_new_tokens] = item.rope_positions
        token_start += item.num_new_tokens
    return torch.cat([pos, three]).unsqueeze(1)


def _slots_of(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots of tokens [0, num_tokens) of a sequence: [num_tokens]."""
    blocks = torch.tensor(block_table[: -(-num_tokens // block_size)], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)
    return slots[:num_tokens]


def probe_layer_shapes(model: torch.nn.Module, device: torch.device) -> list[LayerShape]:
    """Run one token through the model to learn each layer's KV heads and head size."""
    shapes: dict[int, tuple[int, int, torch.dtype]] = {}  # filled by the attention function
    meta = StepMetadata(
        kv_cache=None, num_tokens=1, slot_mapping=torch.zeros(1, dtype=torch.long), recorded_shapes=shapes
    )
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.inference_mode(), step_context(meta):
        model(input_ids=ids, position_ids=ids, use_cache=False, logits_to_keep=1)
    if sorted(shapes) != list(range(len(shapes))):
        raise RuntimeError(f"attention layer indices are not 0..{len(shapes) - 1}: {sorted(shapes)}")
    return [LayerShape(num_kv_heads=shapes[i][0], head_dim=shapes[i][1]) for i in sorted(shapes)]
