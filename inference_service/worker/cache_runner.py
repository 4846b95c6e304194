"""The fallback runner: models the paged attention can't serve exactly (BLOOM's ALiBi, Falcon's and
GPT-J's own attention, MPT, or anything that fails the load-time probe) run through transformers'
own attention with one `DynamicCache` per request.

The engine around it is unchanged: the scheduler still batches continuously (requests join and
leave at every step, prompts are chunked, KV blocks are still the memory budget, preemption still
recomputes), and the sampler sees the same rows. Only the forward differs: each scheduled request
runs on its own with its cache, so the results are exactly transformers' own. A cache is cut back
to the request's computed tokens before each step (after a preemption, or guesses speculation did
not keep) and dropped when the request ends.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from inference_service.outputs import ScheduledRequest
from inference_service.worker.model_runner import RowsToKeep, StepLogits

ATTENTION_IMPL = "transformers"  # what /info and the startup log call this path


class CacheRunner:
    """`ModelRunner`'s contract (execute, release, device) over transformers' caches."""

    kv_cache = None  # no paged tensors: blocks are only the memory budget here
    decode_kernel = None

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self._caches: dict[str, DynamicCache] = {}

    def execute(self, scheduled: list[ScheduledRequest]) -> StepLogits:
        rows = RowsToKeep.of(scheduled)
        kept: list[torch.Tensor] = []
        token_start = 0
        for item in scheduled:
            logits = self._forward(item)  # [n, V]: every new token's, the cache grows by all of them
            wanted = [r - token_start for r in rows.keep if token_start <= r < token_start + item.num_new_tokens]
            if wanted:
                kept.append(logits[wanted])
            token_start += item.num_new_tokens
        logits = torch.cat(kept) if kept else torch.empty(0, device=self.device)  # [K, V]
        return rows.step_logits(scheduled, logits)

    def _forward(self, item: ScheduledRequest) -> torch.Tensor:
        """fp32 logits of the item's new tokens [n, V], its cache grown by them."""
        cache = self._caches.get(item.request_id)
        if cache is None or item.num_computed_tokens == 0:
            cache = self._caches[item.request_id] = DynamicCache(config=self.model.config)
        excess = cache.get_seq_length() - item.num_computed_tokens
        if excess > 0:
            cache.crop(-excess)  # negative: the form every cache layer type accepts
        if cache.get_seq_length() != item.num_computed_tokens:
            raise RuntimeError(f"request {item.request_id}: cache holds {cache.get_seq_length()} tokens, "
                               f"the step continues from {item.num_computed_tokens}")
        ids = torch.tensor([item.token_ids], dtype=torch.long, device=self.device)  # [1, n]
        mask = torch.ones(1, item.num_computed_tokens + item.num_new_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        return out.logits[0].float()

    def release(self, request_id: str) -> None:
        """The request ended: its cache goes."""
        self._caches.pop(request_id, None)

    @property
    def num_caches(self) -> int:
        return len(self._caches)
