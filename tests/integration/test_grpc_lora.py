"""LoRA adapters over the real gRPC API: picked by `adapter_id` (TGI) and `model` (OpenAI), listed by
Info, ListModels and GetModel (with their parent), an unknown one NOT_FOUND naming the loaded ones,
and loaded and unloaded while serving: a bad adapter changes nothing, an unload waits for the
requests running on it (or gives up and says why), and no KV block is left behind."""

from __future__ import annotations

import dataclasses
import threading

import grpc
import pytest

from tests.conftest import GrpcServerThread
from tests.lora_adapters import make_adapter
from textgen.v1 import generate_pb2 as pb

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "alpha": make_adapter(tiny_model_dir, root / "alpha", seed=1),
        "beta": make_adapter(tiny_model_dir, root / "beta", seed=2, rank=4, targets=["q_proj", "v_proj"]),
        "big": make_adapter(tiny_model_dir, root / "big", seed=3, rank=32, targets=["o_proj"]),
    }


def _config(tiny_engine_config, lora_adapters: str | None, max_loras: int | None = None, max_lora_rank: int = 16):
    model = dataclasses.replace(
        tiny_engine_config.model, lora_adapters=lora_adapters, max_loras=max_loras, max_lora_rank=max_lora_rank
    )
    return dataclasses.replace(tiny_engine_config, model=model)


@pytest.fixture(scope="module")
def server(tiny_engine_config, adapter_dirs):
    running = GrpcServerThread(_config(tiny_engine_config, f"alpha={adapter_dirs['alpha']}", max_loras=2))
    yield running
    running.stop(timeout_s=1.0)


def _generate(stub, adapter_id: str | None = None, max_new_tokens: int = 10) -> list[int]:
    parameters = pb.GenerateParameters(max_new_tokens=max_new_tokens, details=True)
    if adapter_id is not None:
        parameters.adapter_id = adapter_id
    response = stub.Generate(pb.GenerateRequest(inputs=PROMPT, parameters=parameters), timeout=60)
    return [token.id for token in response.details.tokens]


def _code_and_message(call) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error = caught.value
    return error.code(), error.details(), dict(error.trailing_metadata())["x-error-type"]


def test_adapters_are_listed_with_their_parent(server, adapter_dirs):
    base = server.engine.info.model_id
    info = server.stub.Info(pb.InfoRequest(), timeout=10)
    assert [(a.id, a.source, a.rank) for a in info.lora_adapters] == [("alpha", str(adapter_dirs["alpha"]), 8)]
    cards = server.stub.ListModels(pb.ListModelsRequest(), timeout=10).data
    assert [(c.id, c.HasField("parent")) for c in cards] == [(base, False), ("alpha", True)]
    assert (cards[1].parent, cards[1].root, cards[1].owned_by) == (base, str(adapter_dirs["alpha"]), base)
    assert server.stub.GetModel(pb.GetModelRequest(id="alpha"), timeout=10) == cards[1]


def test_adapter_id_picks_the_adapter(server):
    base, adapted = _generate(server.stub), _generate(server.stub, "alpha")
    assert adapted != base
    assert _generate(server.stub, server.engine.info.model_id) == base  # the base's own name is the base


def test_openai_model_names_the_adapter(server):
    def completion(model: str) -> pb.CompletionResponse:
        request = pb.CompletionRequest(model=model, prompt=pb_value(PROMPT), max_tokens=10, temperature=0)
        return server.stub.Completion(request, timeout=60)

    adapted = completion("alpha")
    assert adapted.model == "alpha"
    assert completion("tgi").model == server.engine.info.model_id
    assert adapted.choices[0].text != completion(server.engine.info.model_id).choices[0].text
    code, message, kind = _code_and_message(lambda: completion("gamma"))
    assert (code, kind) == (grpc.StatusCode.NOT_FOUND, "not_found")
    assert "'gamma' does not exist" in message and "'alpha'" in message


def pb_value(text: str):
    from google.protobuf import struct_pb2

    return struct_pb2.Value(string_value=text)


def test_an_unknown_adapter_is_not_found_naming_the_loaded_ones(server):
    code, message, kind = _code_and_message(lambda: _generate(server.stub, "nope"))
    assert (code, kind) == (grpc.StatusCode.NOT_FOUND, "not_found")
    assert message == (
        "The model or LoRA adapter 'nope' does not exist: this server serves the base model "
        f"{server.engine.info.model_id!r} and the LoRA adapters 'alpha'"
    )


def test_load_serve_and_unload_while_serving(server, adapter_dirs, tmp_path):
    stub, base = server.stub, _generate(server.stub)
    before = _generate(stub, "alpha")
    # bad adapters: refused with the reason, nothing else changes
    bad = [
        (pb.LoadLoraAdapterRequest(lora_name="gone", lora_path=str(tmp_path / "none")), "does not exist"),
        (pb.LoadLoraAdapterRequest(lora_name="big", lora_path=str(adapter_dirs["big"])), "more than --max-lora-rank"),
        (pb.LoadLoraAdapterRequest(lora_name="alpha", lora_path=str(adapter_dirs["beta"])), "already loaded"),
    ]
    for request, reason in bad:
        code, message, kind = _code_and_message(lambda request=request: stub.LoadLoraAdapter(request))
        assert (code, kind) == (grpc.StatusCode.INVALID_ARGUMENT, "validation") and reason in message
    assert _generate(stub, "alpha") == before and [a.id for a in stub.Info(pb.InfoRequest()).lora_adapters] == ["alpha"]
    card = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="beta", lora_path=str(adapter_dirs["beta"])))
    assert (card.id, card.parent) == ("beta", server.engine.info.model_id)
    beta = _generate(stub, "beta")
    assert beta != base and beta != before and _generate(stub, "alpha") == before
    # --max-loras 2: no room for a third
    code, message, _ = _code_and_message(
        lambda: stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="third", lora_path=str(adapter_dirs["beta"])))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-loras" in message
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="beta"), timeout=30)
    code, message, _ = _code_and_message(lambda: _generate(stub, "beta"))
    assert code == grpc.StatusCode.NOT_FOUND and "'alpha'" in message
    code, _, _ = _code_and_message(lambda: stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="beta")))
    assert code == grpc.StatusCode.NOT_FOUND
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_unload_waits_for_running_requests_or_says_why(tiny_engine_config, adapter_dirs, monkeypatch):
    monkeypatch.setenv("INFERENCE_SERVICE_TEST_STEP_DELAY_MS", "30")  # a request lasts seconds
    slow = GrpcServerThread(_config(tiny_engine_config, f"alpha={adapter_dirs['alpha']}"))
    try:
        parameters = pb.GenerateParameters(max_new_tokens=60, adapter_id="alpha", details=True)
        stream = slow.stub.GenerateStream(pb.GenerateRequest(inputs=PROMPT, parameters=parameters), timeout=120)
        first = next(stream)
        code, message, kind = _code_and_message(
            lambda: slow.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="alpha", timeout_s=0.2))
        )
        assert (code, kind) == (grpc.StatusCode.ABORTED, "conflict") and "keeps serving" in message
        unloaded = threading.Event()

        def unload():
            slow.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="alpha"), timeout=60)
            unloaded.set()

        waiter = threading.Thread(target=unload)
        waiter.start()
        rest = list(stream)  # the running request finishes on its adapter
        waiter.join(60)
        assert unloaded.is_set()
        assert rest[-1].details.finish_reason in ("length", "eos_token")
        assert 1 + len(rest) == rest[-1].details.generated_tokens and first.token.id >= 0
        assert not slow.stub.Info(pb.InfoRequest(), timeout=10).lora_adapters
        stats = slow.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        slow.stop(timeout_s=1.0)


def test_load_and_unload_need_the_api_key(tiny_engine_config, adapter_dirs):
    guarded = GrpcServerThread(_config(tiny_engine_config, None, max_loras=1), api_key="s3cret")
    try:
        request = pb.LoadLoraAdapterRequest(lora_name="alpha", lora_path=str(adapter_dirs["alpha"]))
        code, _, _ = _code_and_message(lambda: guarded.stub.LoadLoraAdapter(request, timeout=30))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        key = (("authorization", "Bearer s3cret"),)
        assert guarded.stub.LoadLoraAdapter(request, timeout=30, metadata=key).id == "alpha"
        code, _, _ = _code_and_message(
            lambda: guarded.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="alpha"), timeout=30)
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
        guarded.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="alpha"), timeout=30, metadata=key)
    finally:
        guarded.stop(timeout_s=1.0)


def test_adapters_off_refuse_loading(tiny_grpc_server, adapter_dirs):
    request = pb.LoadLoraAdapterRequest(lora_name="alpha", lora_path=str(adapter_dirs["alpha"]))
    code, message, _ = _code_and_message(lambda: tiny_grpc_server.stub.LoadLoraAdapter(request, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--lora-adapters or --max-loras" in message


def _lora_requests(server, adapter: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = server.stub.Metrics(pb.MetricsRequest(), timeout=30).data.decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tgi_lora_request_count_total" and sample.labels == {"adapter": adapter}:
                return sample.value
    return 0.0


def test_each_adapter_has_a_request_counter(server):
    before = _lora_requests(server, "alpha")
    for _ in range(3):
        _generate(server.stub, "alpha", max_new_tokens=2)
    _generate(server.stub, None, max_new_tokens=2)  # the base's requests are not counted per adapter
    assert _lora_requests(server, "alpha") == before + 3


def test_the_typed_client_picks_lists_and_refuses_adapters(server, adapter_dirs):
    from textgen_client import Client, LoraAdapter, NotFoundError

    with Client(server.target) as client:
        base = client.generate(PROMPT, max_new_tokens=8, details=True)
        adapted = client.generate(PROMPT, max_new_tokens=8, details=True, adapter_id="alpha")
        assert [t.id for t in adapted.details.tokens] == _generate(server.stub, "alpha", max_new_tokens=8)
        assert adapted.generated_text != base.generated_text
        assert LoraAdapter("alpha", str(adapter_dirs["alpha"]), 8) in client.info().lora_adapters
        card = client.model("alpha")
        assert (card.parent, card.root) == (server.engine.info.model_id, str(adapter_dirs["alpha"]))
        assert client.model().parent is None
        with pytest.raises(NotFoundError, match="'alpha'"):
            client.generate(PROMPT, max_new_tokens=2, adapter_id="nope")
