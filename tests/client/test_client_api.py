"""The public surface: the blocking client mirrors the async one, and every public name is documented."""

from __future__ import annotations

import inspect

import pytest

import textgen_client
from textgen_client import AsyncClient, Client

_LIFECYCLE = {"close"}


def _public_methods(cls) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, callable) if not name.startswith("_")}


def test_client_mirrors_async_client():
    assert inspect.signature(Client.__init__) == inspect.signature(AsyncClient.__init__)
    assert _public_methods(Client) == _public_methods(AsyncClient)
    for name in _public_methods(AsyncClient) - _LIFECYCLE:
        blocking, coroutine = getattr(Client, name), getattr(AsyncClient, name)
        assert inspect.signature(blocking).parameters == inspect.signature(coroutine).parameters, name
        assert blocking.__doc__ == coroutine.__doc__, name


def test_generate_takes_the_text_generation_clients_parameters():
    expected = {
        "do_sample",
        "max_new_tokens",
        "best_of",
        "repetition_penalty",
        "frequency_penalty",
        "return_full_text",
        "seed",
        "stop_sequences",
        "temperature",
        "top_k",
        "top_p",
        "truncate",
        "typical_p",
        "watermark",
        "decoder_input_details",
        "top_n_tokens",
        "grammar",
        "details",
    }
    parameters = inspect.signature(AsyncClient.generate).parameters
    assert expected <= set(parameters)
    assert parameters["max_new_tokens"].default == 20 and parameters["do_sample"].default is False
    stream_parameters = set(inspect.signature(AsyncClient.generate_stream).parameters)
    assert expected - {"best_of", "decoder_input_details"} <= stream_parameters


def test_every_public_name_has_a_docstring():
    for name in textgen_client.__all__:
        value = getattr(textgen_client, name)
        if isinstance(value, str):
            continue
        assert (value.__doc__ or "").strip(), name
        if inspect.isclass(value):
            for member, attribute in vars(value).items():
                if not member.startswith("_") and callable(attribute):
                    assert (attribute.__doc__ or "").strip(), f"{name}.{member}"


async def test_a_closed_client_refuses_calls():
    client = Client("localhost:1")
    client.close()
    client.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        client.info()
    async_client = AsyncClient("localhost:1")
    await async_client.close()
    with pytest.raises(RuntimeError, match="closed"):
        await async_client.info()
