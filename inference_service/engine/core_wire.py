"""The typed messages between a replica's API process and its engine-core process (core_process.py).

Each message is one pickled dataclass on a multiprocessing pipe. What cannot be pickled stays on its
side: a request's compiled grammar travels as its spec and is compiled again by the core (off its
engine loop); the tokenizer and processor come over once, in `Ready`, so both sides read text alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from inference_service.outputs import EngineInfo, EngineStats, RequestOutput, StepStats
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
