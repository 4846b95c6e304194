"""The fallback runner: models the paged attention can't serve exactly (BLOOM's ALiBi, Falcon's and
GPT-J's own attention, MPT, encoder-decoders, Mllama's cross-attention to images, or anything that
fails the load-time probe) run through transformers' own attention, with one cache per request in
transformers' format.

The engine around it is unchanged: the scheduler still batches continuously (requests join and
leave at every step, prompts are chunked, KV blocks are still the memory budget, preemption still
recomputes), and the sampler sees the same rows. Only the forward differs:
- decode rows whose caches hold the same number of tokens run as one batch, their caches stacked
  (encoder-decoders admitted in the same step stay in step: their decoders grow alike). While the
  same requests keep running together, the stacked cache is reused as it is, and when some of them
  leave, the others' rows are taken from it;
- encoder-decoder requests starting in the same step run their encoders as one padded batch, and
  their first decoder step as one batch;
- everything else (prompt chunks, rows with guesses, a row alone at its length) runs on its own.
A cache is cut back to the request's computed tokens before it runs (after a preemption, or guesses
speculation did not keep) and dropped when the request ends.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from inference_service.outputs import ScheduledRequest, StepLogits
from inference_service.worker.step_rows import RowsToKeep
from inference_service.worker.transformers_runner import cache_rows
from inference_service.worker.transformers_runner.cross_attention import cross_attention_forward
from inference_service.worker.transformers_runner.forward import Batch, Sequence, forward_for

ATTENTION_IMPL = "transformers"  # what /info and the startup log call this path


class TransformersRunner:
    """`ModelRunner`'s contract (execute, release, device) over transformers' caches."""

    kv_cache = None  # no paged tensors: blocks are only the memory budget here
    decode_kernel = None
    lost = None  # nothing it runs on can be lost (Runner.lost)

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.forward = cross_attention_forward(model, device) or forward_for(model, device)
        self._sequences: dict[str, Sequence] = {}
        self._batches: dict[tuple[str, ...], Batch] = {}  # the last step's, reused while unchanged
        self.num_batched_rows = 0  # rows that ran in a batch of several requests, since start

    def execute(self, scheduled: list[ScheduledRequest]) -> StepLogits:
        rows = RowsToKeep.of(scheduled)
        new_logits: dict[str, torch.Tensor] = {}  # request id → [n, V]: every new token's
        with torch.inference_mode():
            singles, groups = self._plan(scheduled)
            batches = {}
            for starting, group in groups:
                batch = self._start_batch(group) if starting else self._batch_of(group)
                if batch is None:
                    singles += group
                    continue
                new_logits.update(self._run_batch(batch, group))
                batches[batch.ids] = batch
            for item in singles:
                new_logits[item.request_id] = self._run_one(item)
            self._batches = batches
        kept: list[torch.Tensor] = []
        token_start = 0
        for item in scheduled:
            wanted = [r - token_start for r in rows.keep if token_start <= r < token_start + item.num_new_tokens]
            if wanted:
                kept.append(new_logits[item.request_id][wanted])
            token_start += item.num_new_tokens
        logits = torch.cat(kept) if kept else torch.empty(0, device=self.device)  # [K, V]
        return rows.step_logits(scheduled, logits)

    def _plan(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[ScheduledRequest], list[tuple[bool, list[ScheduledRequest]]]]:
        """Items that run alone, and groups (starting?, items) that can run as one batch: one-token
        rows continuing caches of equal length, and requests starting with decoder inputs of equal
        length (an encoder-decoder's start token)."""
        groups: dict[tuple[bool, int], list[ScheduledRequest]] = defaultdict(list)
        singles = []
        for item in scheduled:
            if item.num_draft_tokens:
                singles.append(item)
            elif item.num_computed_tokens == 0 and item.encoder_token_ids:
                groups[True, item.num_new_tokens].append(item)
            elif item.num_new_tokens == 1 and item.num_computed_tokens > 0 and item.request_id in self._sequences:
                groups[False, item.num_computed_tokens].append(item)
            else:
                singles.append(item)
        batched = []
        for (starting, _length), group in groups.items():
            if len(group) == 1:
                singles += group
            else:
                batched.append((starting, group))
        return singles, batched

    def _run_one(self, item: ScheduledRequest) -> torch.Tensor:
        """fp32 logits of the item's new tokens [n, V], its cache grown by them."""
        sequence = self._sequences.get(item.request_id)
        if sequence is None or item.num_computed_tokens == 0:
            sequence = self._sequences[item.request_id] = self.forward.start(item)
        cache = self._own_cache(item, sequence)
        ids = torch.tensor([item.token_ids], dtype=torch.long, device=self.device)  # [1, n]
        return self.forward.logits(ids, cache, self.forward.inputs(sequence), item.num_computed_tokens)[0]

    def _start_batch(self, group: list[ScheduledRequest]) -> Batch | None:
        """A batch of requests starting now (None where the model can't start them together)."""
        ids = tuple(item.request_id for item in group)
        started = self.forward.start_batch(ids, group)
        if started is None:
            return None
        batch, sequences = started
        self._sequences.update(zip(ids, sequences, strict=True))
        return batch

    def _batch_of(self, group: list[ScheduledRequest]) -> Batch | None:
        """The stacked caches of `group`: the last step's batch when it ran exactly these requests,
        its rows when it ran them and others (who finished or wait), else stacked anew; None when
        their caches don't stack (layers a concatenation would not carry)."""
        ids = tuple(item.request_id for item in group)
        length = group[0].num_computed_tokens
        for batch in self._batches.values():
            if batch.cache.get_seq_length() == length and set(ids) <= set(batch.ids):
                ids = tuple(i for i in batch.ids if i in set(ids))  # the batch's order; rows follow it
                return batch if ids == batch.ids else batch.subset(ids, self.device)
        sequences = [self._sequences[i] for i in ids]
        caches = [self._own_cache(item, s) for item, s in zip(group, sequences, strict=True)]
        if not all(cache_rows.stackable(cache) for cache in caches):
            return None
        return self.forward.batch(ids, sequences)

    def _run_batch(self, batch: Batch, group: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
        by_id = {item.request_id: item for item in group}
        ids = torch.tensor([by_id[i].token_ids for i in batch.ids], dtype=torch.long, device=self.device)  # [B, n]
        logits = self.forward.logits(ids, batch.cache, batch.inputs, group[0].num_computed_tokens)  # [B, n, V]
        self.num_batched_rows += len(group)
        for index, request_id in enumerate(batch.ids):
            sequence = self._sequences[request_id]
            sequence.cache, sequence.batch, sequence.row = None, batch, index
        return {request_id: logits[index] for index, request_id in enumerate(batch.ids)}

    def _own_cache(self, item: ScheduledRequest, sequence: Sequence):
        """The request's batch-1 cache, taken out of its last batch if it ran in one, holding exactly
        the item's computed tokens."""
        if sequence.batch is not None:
            sequence.cache = self.forward.take(sequence.batch, sequence.row, sequence)
            sequence.batch = None
        cache = sequence.cache
        if cache is None:
            raise RuntimeError(f"request {item.request_id} has no cache")
        excess = cache.get_seq_length() - item.num_computed_tokens
        if excess > 0:
            cache.crop(-excess)  # negative: the form every cache layer type accepts
        if cache.get_seq_length() != item.num_computed_tokens:
            raise RuntimeError(
                f"request {item.request_id}: cache holds {cache.get_seq_length()} tokens, "
                f"the step continues from {item.num_computed_tokens}"
            )
        return cache

    def release(self, request_id: str) -> None:
        """The request ended: its cache goes (a batch it was in stays with the others in it)."""
        self._sequences.pop(request_id, None)

    def close(self) -> None:
        """The engine stops: the per-request caches go."""
        self._sequences.clear()

    def describe(self) -> str:
        return "decode steps: transformers' layers, one cache per request"

    @property
    def num_caches(self) -> int:
        return len(self._sequences)
