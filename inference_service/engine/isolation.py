"""Failure isolation: one request's failure inside a step ends that request alone.

A step samples all its requests' rows in one batched call. When that call raises, the step does not
fail as a whole: each row is sampled again on its own, and only the rows that fail again end their
requests, each with a typed error; the others take their tokens and go on. The retry is exact: a
row's token depends on its own logits and its request's state only (a sampling request's uniform is
drawn once per position, a grammar mask is filled again from the same position), so a request sampled
alone gets the token the batch would have given it.

What callers are told never carries internals: an `InferenceError` keeps its own message (it was
written for them); anything else becomes a `RequestStepError` naming the stage, and its traceback
goes to the log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from inference_service.errors import InferenceError, RequestStepError
from inference_service.sample.sampler import Sampler, SamplerOutput, SamplingState

logger = logging.getLogger(__name__)


def request_error(error: Exception, stage: str) -> InferenceError:
    """What the caller of a request that failed at `stage` is told."""
    return error if isinstance(error, InferenceError) else RequestStepError(stage)


@dataclass
class IsolatedSample:
    """One token per row; a row in `errors` failed (its token is a placeholder, never to be used)."""

    sampled: SamplerOutput
    errors: dict[int, InferenceError] = field(default_factory=dict)


def sample_rows(sampler: Sampler, logits: Tensor, states: Sequence[SamplingState]) -> IsolatedSample:
    """`sampler(logits, states)`, or row by row once the batch raised (see the module docstring)."""
    try:
        return IsolatedSample(sampler(logits, states))
    except Exception as error:  # noqa: BLE001 — find the rows that fail, let the others go on
        if len(states) == 1:
            return _failed(error)
        logger.warning("sampling a batch of %d rows failed; sampling them one by one", len(states), exc_info=True)
    rows = [_sample_one(sampler, logits[row : row + 1], state) for row, state in enumerate(states)]
    return IsolatedSample(
        SamplerOutput(
            token_ids=[r.sampled.token_ids[0] for r in rows],
            logprobs=[r.sampled.logprobs[0] for r in rows],
            top_ids=[r.sampled.top_ids[0] for r in rows],
            top_logprobs=[r.sampled.top_logprobs[0] for r in rows],
        ),
        {row: r.errors[0] for row, r in enumerate(rows) if r.errors},
    )


def _sample_one(sampler: Sampler, logits: Tensor, state: SamplingState) -> IsolatedSample:
    try:
        return IsolatedSample(sampler(logits, [state]))
    except Exception as error:  # noqa: BLE001 — this row's request fails, alone
        return _failed(error)


def _failed(error: Exception) -> IsolatedSample:
    """A one-row result whose row failed with `error`."""
    logger.error("sampling failed for a request", exc_info=error)
    return IsolatedSample(SamplerOutput([-1], [0.0], [[]], [[]]), {0: request_error(error, "sampling")})
