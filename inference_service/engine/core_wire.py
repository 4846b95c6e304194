"""The typed messages between a replica's API process and its engine-core process (core_process.py).

Each message is one pickled dataclass on a multiprocessing pipe. What cannot be pickled stays on its
side: a request's compiled grammar travels as its spec and is compiled again by the core (off its
engine loop); the tokenizer and processor come over once, in `Ready`, so both sides read text alike.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

from inference_service.outputs import EngineInfo, EngineStats, RequestOutput, StepStats, Token
from inference_service.sample.grammar import GrammarSpec
from inference_service.sampling_params import EngineRequest


# -- API process → core ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    request: EngineRequest  # its `grammar` is a GrammarSpec here (see `for_wire`)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: str


@dataclass(frozen=True)
class Stop:
    """Abort what still runs, close the engine and exit 0."""


ToCore = AddRequest | AbortRequest | Stop


# -- core → API process ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The engine is loaded and warmed up: what the API process serves it with."""

    info: EngineInfo
    tokenizer: Any
    processor: Any  # a vision-language model's processor; None: text only
    stats: EngineStats


@dataclass(frozen=True)
class LoadFailed:
    """The model could not be loaded (a ModelLoadError's one line); the core exits after it."""

    message: str


@dataclass(frozen=True)
class Outputs:
    """One step's (or one command batch's) outputs, the stats after it and the steps it ran."""

    outputs: list[RequestOutput]
    stats: EngineStats
    steps: list[StepStats]

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickled as plain values: one per token and step, where pickling the dataclasses as objects
        took both processes several times the CPU (out of the step's on a machine the step fills)."""
        outputs = [_output_values(output) for output in self.outputs]
        return _outputs_from, (outputs, _values(self.stats), [_values(step) for step in self.steps])


@dataclass(frozen=True)
class Failed:
    """The engine can no longer generate (every request in flight was ended in the same Outputs)."""

    reason: str


FromCore = Ready | LoadFailed | Outputs | Failed


def for_wire(request: EngineRequest) -> EngineRequest:
    """`request` with its compiled grammar (an llguidance matcher, not picklable) replaced by its spec."""
    grammar = request.grammar
    if grammar is None or isinstance(grammar, GrammarSpec):
        return request
    return dataclasses.replace(request, grammar=grammar.spec)  # type: ignore[attr-defined]


def _values(item: EngineStats | StepStats) -> tuple:
    return _FIELDS[type(item)](item)


# The fields' values in the order the constructor takes them (attrgetter: one C call).
_FIELDS = {kind: operator.attrgetter(*(f.name for f in dataclasses.fields(kind))) for kind in (EngineStats, StepStats)}
_TokenValues = tuple[int, str, float, bool]


def _output_values(output: RequestOutput) -> RequestOutput | tuple:
    """A token's output as values; one with an error, timings or prompt tokens (a request's first or
    last) as it is."""
    if output.error is not None or output.timings is not None or output.prefill_tokens is not None:
        return output
    tokens = [_token_values(token) for token in output.tokens]
    top_tokens = [[_token_values(token) for token in top] for top in output.top_tokens]
    counts = (output.num_generated_tokens, output.num_prompt_tokens, output.seed)
    return (output.request_id, tokens, top_tokens, output.finish_reason, output.generated_text, *counts)


def _token_values(token: Token) -> _TokenValues:
    return token.id, token.text, token.logprob, token.special


def _outputs_from(outputs: list[RequestOutput | tuple], stats: tuple, steps: list[tuple]) -> Outputs:
    return Outputs([_output_from(output) for output in outputs], EngineStats(*stats), [StepStats(*s) for s in steps])


def _output_from(values: RequestOutput | tuple) -> RequestOutput:
    if isinstance(values, RequestOutput):
        return values
    request_id, tokens, top_tokens, finish_reason, generated_text, num_generated, num_prompt, seed = values
    return RequestOutput(
        request_id,
        tokens=[Token(*token) for token in tokens],
        top_tokens=[[Token(*token) for token in top] for top in top_tokens],
        finish_reason=finish_reason,
        generated_text=generated_text,
        num_generated_tokens=num_generated,
        num_prompt_tokens=num_prompt,
        seed=seed,
    )
