"""Which rows of a step's packed tokens need logits, and the step's `StepLogits` from them: shared by both runners."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_service.outputs import ScheduledRequest, StepLogits


@dataclass
class RowsToKeep:
    """Which packed rows of a step need logits, and where sampling and prompt logprobs find theirs
    among them (shared by both runners, so the engine reads their logits alike)."""

    keep: list[int]  # packed token rows
    sample: list[int]  # indices into `keep`: each sampling request's rows, consecutive
    prompt: dict[str, tuple[int, int]]  # request id → [start, end) into `keep`

    @classmethod
    def of(cls, scheduled: list[ScheduledRequest]) -> RowsToKeep:
        rows = cls([], [], {})
        token_start = 0
        for item in scheduled:
            end = token_start + item.num_new_tokens
            num_sampled = 1 + item.num_draft_tokens  # the last known token's row and each guess's
            if item.prompt_logprobs:
                rows.prompt[item.request_id] = (len(rows.keep), len(rows.keep) + item.num_new_tokens)
                rows.keep.extend(range(token_start, end))
                if item.sample:
                    rows.sample.extend(range(len(rows.keep) - num_sampled, len(rows.keep)))
            elif item.sample:
                rows.sample.extend(range(len(rows.keep), len(rows.keep) + num_sampled))
                rows.keep.extend(range(end - num_sampled, end))
            token_start = end
        return rows

    def step_logits(
        self, scheduled: list[ScheduledRequest], logits: torch.Tensor, num_attention_calls: int = 0
    ) -> StepLogits:
        """The step's `StepLogits` from the kept rows' logits [K, V]."""
        speculating = any(s.num_draft_tokens for s in scheduled)
        return StepLogits(
            sample_ids=[s.request_id for s in scheduled if s.sample],
            sample_logits=logits[self.sample] if len(self.sample) != len(self.keep) else logits,
            prompt_logits={request_id: logits[start:end] for request_id, (start, end) in self.prompt.items()},
            num_attention_calls=num_attention_calls,
            num_sample_rows=[1 + s.num_draft_tokens for s in scheduled if s.sample] if speculating else None,
        )
