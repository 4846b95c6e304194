"""Shared fixtures."""

from __future__ import annotations

import random

import pytest

# Markers whose tests run only when asked for (`pytest -m soak`, `pytest -m extended`).
_ON_REQUEST = ("soak", "extended")


def pytest_collection_modifyitems(config, items):
    """Soak tests take minutes each; extended tests are finer variants of what `make test` already
    checks (another family's edge cases, known gaps kept as strict xfails): both run only when asked."""
    asked = config.getoption("markexpr") or ""
    skipped = [name for name in _ON_REQUEST if name not in asked]
    kept = [item for item in items if not any(item.get_closest_marker(name) for name in skipped)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


_TEXT = (
    "the quick brown fox jumps over a lazy dog and then runs home again while birds sing "
    "café naïve résumé Grüße Ελληνικά Привет мир ¿Qué? 日本語 東京 こんにちは 世界 中文 "
    "😀 🎉 👍🏽 🇯🇵 ✨ <tag> 1234 3.14 , . ! ?"
)


@pytest.fixture(scope="session")
def byte_tokenizer():
    """A real byte-level BPE tokenizer (GPT-2 style) trained here on a few hundred lines.

    Special: <|startoftext|> (BOS, added to each encoding), <|endoftext|> (EOS), <|pad|>,
    <|im_start|>, <|im_end|>. <|tool|> is an added token that is NOT special.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    lines = [" ".join(rng.choices(_TEXT.split(), k=rng.randint(3, 12))) for _ in range(400)]
    specials = ["<|startoftext|>", "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=330,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A", special_tokens=[("<|startoftext|>", backend.token_to_id(specials[0]))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=specials[0],
        eos_token=specials[1],
        pad_token=specials[2],
        additional_special_tokens=specials[3:],
    )
    tokenizer.add_tokens(["<|tool|>"])
    return tokenizer


@pytest.fixture(scope="session")
def byte_grammar_compiler(byte_tokenizer):
    """A grammar compiler over the byte tokenizer, logits as wide as its vocabulary, EOS <|endoftext|>."""
    from inference_service.sample.grammar import GrammarCompiler

    return GrammarCompiler(byte_tokenizer, len(byte_tokenizer), [byte_tokenizer.eos_token_id])


TINY_MODEL_MAX_POSITIONS = 512


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, byte_tokenizer):
    """A folder holding a tiny random Llama (safetensors) and the byte tokenizer: a model the
    server loads like any local model. Weights are seeded and spread wide (initializer_range)
    so greedy choices are not near-ties that float noise could flip."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(byte_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MODEL_MAX_POSITIONS,
        initializer_range=0.1,
        bos_token_id=byte_tokenizer.bos_token_id,
        eos_token_id=byte_tokenizer.eos_token_id,
        pad_token_id=byte_tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    return folder


# -- the gRPC API on a loopback port ------------------------------------------------------------
class GrpcServerThread:
    """An `ApiServer` on its own event-loop thread, on 127.0.0.1 and a free port, so tests can use
    blocking stubs (as most callers do) while the server runs for real."""

    def __init__(self, engine_config, load: bool = True, **server_options):
        import asyncio
        import threading

        import grpc

        from inference_service.api.config import ServerConfig
        from inference_service.api.server import ApiServer
        from textgen.v1 import generate_pb2_grpc

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-test-server", daemon=True)
        self._thread.start()
        # Metrics port 0 too: parallel test runs must not race for the default 9000.
        config = ServerConfig(hostname="127.0.0.1", grpc_port=0, **{"prometheus_port": 0, **server_options})

        async def build():  # grpc.aio binds a server to the loop it is created on
            return ApiServer(config, engine_config)

        self.server = self.call(build())
        self.port = self.call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)
        if load:
            self.load()

    def call(self, coroutine, timeout: float = 120.0):
        """Run a coroutine on the server's loop (e.g. the engine's own methods) and wait for it."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def load(self) -> None:
        self.call(self.server.load_engine())

    @property
    def engine(self):
        return self.server.engine

    @property
    def front_end(self):
        return self.server.front_end

    def stats(self):
        from textgen.v1 import generate_pb2

        return self.stub.Info(generate_pb2.InfoRequest(), timeout=10).stats

    def wait_idle(self, timeout: float = 10.0):
        """Engine stats once no request runs or waits and every KV block is free again."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def start_shutdown(self, timeout_s: float):
        """Begin the graceful shutdown (SIGTERM's path) without waiting: a concurrent Future."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(self.server.shutdown(timeout_s), self._loop)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop.is_closed():
            return
        self.channel.close()
        self.call(self.server.shutdown(timeout_s))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture(scope="session")
def tiny_engine_config(tiny_model_dir):
    """The tiny model on CPU with small, fixed limits (no dependence on the machine's memory)."""
    from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig

    return EngineConfig(
        model=ModelConfig(model_id=str(tiny_model_dir), device="cpu", dtype="float32"),
        cache=CacheConfig(max_batch_total_tokens=4096),
        limits=LimitsConfig(max_total_tokens=TINY_MODEL_MAX_POSITIONS),
    )


# ChatML, as many instruct models (the demo model too) write it; the tiny model has no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat_engine_config(tiny_engine_config, tmp_path_factory):
    """The tiny model with a ChatML chat template given as a file (`--chat-template`)."""
    import dataclasses

    template = tmp_path_factory.mktemp("chat-template") / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    return dataclasses.replace(
        tiny_engine_config, model=dataclasses.replace(tiny_engine_config.model, chat_template=str(template))
    )


@pytest.fixture(scope="module")
def tiny_chat_grpc_server(tiny_chat_engine_config):
    """One loaded server on the tiny model with a chat template per test module."""
    server = GrpcServerThread(tiny_chat_engine_config)
    yield server
    server.stop(timeout_s=1.0)


@pytest.fixture
def start_grpc_server():
    """`start_grpc_server(engine_config, load=True, **ServerConfig fields)`; all stop at teardown."""
    servers: list[GrpcServerThread] = []

    def start(engine_config, load: bool = True, **server_options) -> GrpcServerThread:
        servers.append(GrpcServerThread(engine_config, load=load, **server_options))
        return servers[-1]

    yield start
    for server in servers:
        server.stop(timeout_s=1.0)


@pytest.fixture(scope="module")
def tiny_grpc_server(tiny_engine_config):
    """One loaded server on the tiny model per test module; tests leave it idle."""
    server = GrpcServerThread(tiny_engine_config)
    yield server
    server.stop(timeout_s=1.0)


@pytest.fixture(scope="module")
def demo_grpc_server():
    """A loaded server on the demo model (the default model id), with a small fixed KV cache."""
    from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig

    config = EngineConfig(
        model=ModelConfig(device="cpu"),
        cache=CacheConfig(max_batch_total_tokens=4096),
        limits=LimitsConfig(max_total_tokens=1024),
    )
    server = GrpcServerThread(config)
    yield server
    server.stop(timeout_s=1.0)


def copy_linear_weight(module, weight) -> None:
    """Overwrite a served linear's weight [N, K] in place, whichever layout the engine keeps it in."""
    from inference_service.worker.linears.panelled import PanelledLinear

    if isinstance(module, PanelledLinear):
        module.copy_weight_(weight)
    else:
        module.weight.copy_(weight)


def greedy_token_ids(engine, prompt: str = "the quick brown fox", max_new_tokens: int = 16) -> list[int]:
    """The tokens a built `LLMEngine` generates greedily for `prompt` (through an AsyncEngine, as served)."""
    import asyncio

    from inference_service.engine.async_engine import AsyncEngine
    from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
    from tests.engine_calls import validated

    async def run():
        async_engine = AsyncEngine(engine, max_concurrent_requests=4)
        async_engine.start()
        try:
            request = await validated(
                async_engine,
                GenerateRequest(prompt, GenerateParameters(max_new_tokens=max_new_tokens, details=True)),
                stream=False,
            )
            return await async_engine.generate(request)
        finally:
            await async_engine.shutdown(timeout_s=1)

    return [t.id for t in asyncio.run(run()).tokens]
