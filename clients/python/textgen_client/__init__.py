"""Python client of the textgen gRPC server, in the spirit of TGI's `text-generation` client.

    from textgen_client import Client

    client = Client("localhost:50051")
    print(client.generate("Why is the sky blue?", max_new_tokens=20).generated_text)
    for response in client.generate_stream("Why is the sky blue?"):
        print(response.token.text, end="")

    reply = client.chat([{"role": "user", "content": "Why is the sky blue?"}], max_tokens=40)
    print(reply.choices[0].message.content)

`AsyncClient` has the same methods for asyncio. Responses are the dataclasses of
`textgen_client.types` (OpenAI-style calls: `textgen_client.openai_types`); failures raise the
`TextGenerationError` subclasses of `textgen_client.errors`.
"""

from textgen_client._async_client import DEFAULT_TARGET, AsyncClient
from textgen_client._client import Client, Stream
from textgen_client._retry import RetryPolicy
from textgen_client._version import __version__
from textgen_client.errors import (
    AuthenticationError,
    CancelledError,
    ConflictError,
    DeadlineExceededError,
    GenerationError,
    IncompleteGenerationError,
    NotFoundError,
    OverloadedError,
    TextGenerationError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
    ValidationError,
)
from textgen_client.openai_types import ChatCompletion, ChatCompletionChunk, Completion, ModelCard
from textgen_client.types import (
    BestOfSequence,
    Details,
    EngineStats,
    FinishReason,
    Grammar,
    InfoResponse,
    InputToken,
    LoraAdapter,
    PrefillToken,
    Response,
    SimpleToken,
    StreamDetails,
    StreamResponse,
    Token,
)

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "AuthenticationError",
    "BestOfSequence",
    "CancelledError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Client",
    "Completion",
    "ConflictError",
    "DeadlineExceededError",
    "Details",
    "EngineStats",
    "FinishReason",
    "GenerationError",
    "Grammar",
    "IncompleteGenerationError",
    "InfoResponse",
    "InputToken",
    "LoraAdapter",
    "ModelCard",
    "NotFoundError",
    "OverloadedError",
    "PrefillToken",
    "Response",
    "RetryPolicy",
    "SimpleToken",
    "Stream",
    "StreamDetails",
    "StreamResponse",
    "TextGenerationError",
    "Token",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
    "ValidationError",
    "__version__",
]
