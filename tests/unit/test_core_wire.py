"""The engine core's per-step message (engine/core_wire.py) crosses the pipe as plain values and
arrives equal: every field of a token's output, of the stats and of each step; a request's first
or last output (prompt tokens, timings, an error) as it is."""

from __future__ import annotations

import dataclasses
import pickle

from inference_service.engine import core_wire as wire
from inference_service.errors import GenerationError
from inference_service.outputs import (
    EngineStats,
    FinishReason,
    PrefillToken,
    RequestOutput,
    RequestTimings,
    StepStats,
    Token,
)


def _stats() -> EngineStats:
    return EngineStats(**{f.name: index + 1 for index, f in enumerate(dataclasses.fields(EngineStats))})


def _step() -> StepStats:
    return StepStats(1, 0, 2, 3, 4, 5, 6, num_draft_tokens=7, accepted_draft_tokens=[2, 0], forward_s=0.25, failed=True)


def test_a_steps_outputs_arrive_equal_and_tokens_travel_as_values():
    token_output = RequestOutput(
        "a",
        tokens=[Token(5, " the", -0.5, False), Token(2, "</s>", -1.25, True)],
        top_tokens=[[Token(5, " the", -0.5, False), Token(9, " a", -2.0, False)], []],
        finish_reason=FinishReason.LENGTH,
        generated_text="the",
        num_generated_tokens=3,
        num_prompt_tokens=9,
        seed=11,
    )
    message = wire.Outputs([token_output, RequestOutput("b", tokens=[Token(1, "x", 0.0, False)])], _stats(), [_step()])
    data = pickle.dumps(message)
    assert pickle.loads(data) == message
    assert b"RequestOutput" not in data and b"StepStats" not in data  # values, not pickled objects


def test_a_requests_first_and_last_outputs_arrive_as_they_are():
    first = RequestOutput("a", tokens=[Token(5, "x", -0.5, False)], prefill_tokens=[PrefillToken(1, "<s>", None)])
    last = RequestOutput("b", finish_reason=FinishReason.EOS_TOKEN, timings=RequestTimings(arrival=1.0, finished=2.0))
    failed = RequestOutput("c", error=GenerationError("the model step failed"))
    received = pickle.loads(pickle.dumps(wire.Outputs([first, last, failed], _stats(), [])))
    assert received.outputs[:2] == [first, last] and received.steps == []
    assert isinstance(received.outputs[2].error, GenerationError)
    assert str(received.outputs[2].error) == str(failed.error)
