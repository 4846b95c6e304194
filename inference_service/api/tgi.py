"""TGI's routes: `Generate`, `CompatGenerate` (`POST /`), `GenerateStream` and `Tokenize`.

Each method asks the front end for the engine's requests, runs them, and converts the results
(`convert`). TGI's `best_of` runs that many freshly seeded sequences together; the best mean
logprob wins and the others are its `best_of_sequences`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from inference_service.api import convert
from inference_service.api.backend import Backend
from inference_service.api.errors import unary_errors
from inference_service.api.streaming import engine_events, stream_errors
from inference_service.api.timing_headers import timing_headers
from inference_service.frontend.tgi import wants_details
from inference_service.outputs import GenerateResult
from textgen.v1 import generate_pb2 as pb

Context = grpc.aio.ServicerContext


def best_of(results: Sequence[GenerateResult]) -> GenerateResult:
    """The sequence with the best mean logprob, carrying the others."""
    ranked = sorted(results, key=_mean_logprob, reverse=True)
    best = ranked[0]
    best.best_of_sequences = ranked[1:]
    return best


def _mean_logprob(result: GenerateResult) -> float:
    if not result.tokens:
        return float("-inf")
    return sum(token.logprob for token in result.tokens) / len(result.tokens)


def _stream_error(message: str, error_type: str) -> pb.StreamResponse:
    return pb.StreamResponse(error=message, error_type=error_type)


class TgiRoutes:
    """TGI's generation routes over one `Backend`."""

    def __init__(self, backend: Backend):
        self._backend = backend

    async def _generate(
        self, request: pb.GenerateRequest, context: Context, method: str, compat_route: bool
    ) -> pb.GenerateResponse:
        with self._backend.observer.track(method, context) as call:
            engine, front_end = self._backend.engine(), self._backend.front_end()
            validated = await front_end.generate(request, stream=False, compat_route=compat_route)
            call.validated(validated.engine_request)
            result = call.finished(best_of(await engine.generate_all(front_end.best_of_variants(validated))))
            await context.send_initial_metadata(timing_headers(call.trace, result, len(request.inputs)))
            return convert.generate_response_to_pb(result, details=wants_details(request))

    @unary_errors
    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        return await self._generate(request, context, "Generate", compat_route=False)

    @unary_errors
    async def CompatGenerate(self, request: pb.GenerateRequest, context: Context) -> pb.CompatGenerateResponse:
        response = await self._generate(request, context, "CompatGenerate", compat_route=True)
        return pb.CompatGenerateResponse(responses=[response])

    @stream_errors(_stream_error)
    async def GenerateStream(self, request: pb.GenerateRequest, context: Context) -> AsyncIterator[pb.StreamResponse]:
        with self._backend.observer.track("GenerateStream", context) as call:
            engine, front_end = self._backend.engine(), self._backend.front_end()
            validated = await front_end.generate(request, stream=True)
            call.validated(validated.engine_request)
            details, num_sent = wants_details(request), 0
            async for event in engine_events(engine, [validated.engine_request], context):
                if event is None:
                    yield pb.StreamResponse(keep_alive=True)
                    continue
                _, output = event
                call.streamed(output)
                responses = convert.stream_responses_to_pb(output, first_index=num_sent + 1, details=details)
                for response in responses:
                    yield response
                num_sent += len(responses)

    @unary_errors
    async def Tokenize(self, request: pb.GenerateRequest, context: Context) -> pb.TokenizeResponse:
        return convert.tokenize_response_to_pb(await self._backend.front_end().tokenize(request.inputs))
