"""Model resolution and loading: local folders, the hub cache and its errors, dtype and device."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from inference_service.config import ModelConfig
from inference_service.errors import ModelLoadError
from inference_service.models.loader import (
    ResolvedModel,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
    served_name,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2018 there were 12345 cats.",
    "Hello world! Hello tokenizer, hello model.",
] * 20


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE of a few hundred tokens, trained in milliseconds."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    wrapped.save_pretrained(folder)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def reference(tokenizer) -> LlamaForCausalLM:
    return tiny_llama(tokenizer.get_vocab_size())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, reference, tokenizer) -> Path:
    """A safetensors checkpoint with its tokenizer, as `save_pretrained` writes it."""
    folder = tmp_path_factory.mktemp("tiny-safetensors")
    reference.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory, reference, tokenizer) -> Path:
    """The same model with `pytorch_model.bin` only, as older hub repos have it."""
    folder = tmp_path_factory.mktemp("tiny-bin")
    reference.config.save_pretrained(folder)
    torch.save(reference.state_dict(), folder / "pytorch_model.bin")
    save_tokenizer(tokenizer, folder)
    return folder


class Payload:
    """Not a tensor: a `.bin` holding it must be refused by `weights_only=True` unpickling."""


def input_ids(tokenizer: Tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.encode("Hello world! The quick brown fox.").ids])


def assert_same_logits(model, reference, ids):
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-6)


# --- local folders ---------------------------------------------------------------------------


def test_local_folder_resolves_as_is(model_dir):
    resolved = resolve_model(ModelConfig(model_id=str(model_dir)))
    assert (resolved.path, resolved.model_sha, resolved.source) == (model_dir.resolve(), None, "local")


def test_safetensors_model_gives_the_original_logits(model_dir, reference, tokenizer):
    model = load_model(model_dir, dtype=torch.float32, device="cpu", attn_implementation="eager")
    assert not model.training
    assert model.dtype == torch.float32
    assert_same_logits(model, reference, input_ids(tokenizer))


def test_tokenizer_is_fast_and_encodes_like_the_original(model_dir, tokenizer):
    loaded = load_tokenizer(model_dir)
    assert loaded.is_fast
    text = "In 2018 there were 12345 cats. Hello world!"
    assert loaded(text)["input_ids"] == tokenizer.encode(text).ids
    assert loaded.eos_token == "<|im_end|>"


def test_bin_only_model_gives_the_original_logits(bin_dir, reference, tokenizer):
    model = load_model(bin_dir, dtype=torch.float32, device="cpu", attn_implementation="eager")
    assert_same_logits(model, reference, input_ids(tokenizer))


def test_bin_with_more_than_tensors_is_refused(tmp_path, reference):
    reference.config.save_pretrained(tmp_path)
    torch.save({"model.embed_tokens.weight": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="weights_only=True"):
        load_model(tmp_path, dtype=torch.float32, device="cpu", attn_implementation="eager")


def test_safetensors_win_over_bin(tmp_path, model_dir, reference, tokenizer):
    """The unreadable `.bin` next to the safetensors is never opened."""
    for name in os.listdir(model_dir):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    torch.save({"model.embed_tokens.weight": Payload()}, tmp_path / "pytorch_model.bin")
    model = load_model(tmp_path, dtype=torch.float32, device="cpu", attn_implementation="eager")
    assert_same_logits(model, reference, input_ids(tokenizer))


def test_load_in_bfloat16(model_dir):
    model = load_model(model_dir, dtype=torch.bfloat16, device="cpu", attn_implementation="sdpa")
    assert model.dtype == torch.bfloat16


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "made_up_arch"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'made_up_arch'"):
        load_model(tmp_path, dtype=torch.float32, device="cpu", attn_implementation="eager")


def test_remote_code_is_off_by_default(tmp_path):
    config = {"model_type": "custom_arch", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="--trust-remote-code"):
        load_model(tmp_path, dtype=torch.float32, device="cpu", attn_implementation="eager")


def test_missing_files_are_one_clear_line(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as missing_folder:
        load_model(tmp_path / "nope", dtype=torch.float32, device="cpu", attn_implementation="eager")
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        load_model(tmp_path, dtype=torch.float32, device="cpu", attn_implementation="eager")
    with pytest.raises(ModelLoadError, match="holds no tokenizer_config.json"):
        load_tokenizer(tmp_path)
    assert "\n" not in str(missing_folder.value)


def test_path_like_ids_that_do_not_exist_are_not_sent_to_the_hub(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(ModelConfig(model_id=str(tmp_path / "missing" / "model")))
    with pytest.raises(ModelLoadError, match="GGUF file"):
        resolve_model(ModelConfig(model_id=str(tmp_path / "missing.gguf")))


# --- dtype and device ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_id", "source", "served", "expected"),
    [
        ("org/name", "hub", None, "org/name"),  # TGI's: the id as given
        ("/models/my-llama", "local", None, "/models/my-llama"),
        ("/models/gguf/tiny.Q4_0.gguf", "gguf", None, "tiny.Q4_0.gguf"),  # not this machine's path
        ("/models/gguf/tiny.Q4_0.gguf", "gguf", "acme/tiny", "acme/tiny"),
        ("org/name", "hub", "served", "served"),
    ],
)
def test_served_name(model_id, source, served, expected):
    resolved = ResolvedModel(Path("/cache/folder"), None, source)
    assert served_name(ModelConfig(model_id=model_id, served_model_name=served), resolved) == expected


def test_auto_device_is_cuda_only_when_available():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


def test_missing_cuda_device_is_refused():
    name = f"cuda:{torch.cuda.device_count() + 1}"
    with pytest.raises(ModelLoadError, match="cuda"):
        resolve_device(name)


def test_dtype_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("float32", cpu) == torch.float32
    with pytest.raises(ModelLoadError):
        resolve_dtype("int8", cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dtype_resolution_on_cuda():
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    assert resolve_dtype("auto", torch.device("cuda")) == expected


# --- the hub: a real huggingface_hub in a fresh process, so its environment variables apply ------


def resolve_in_subprocess(env: dict[str, str], **config) -> dict:
    """`resolve_model` in a child process; returns the result or the error message as a dict."""
    return resolve_many_in_subprocess(env, config)[0]


def resolve_many_in_subprocess(env: dict[str, str], *configs: dict) -> list[dict]:
    """`resolve_model` for each config in one child process (one import of torch)."""
    script = (
        "import json, sys\n"
        "from inference_service.config import ModelConfig\n"
        "from inference_service.errors import ModelLoadError\n"
        "from inference_service.models.loader import resolve_model\n"
        "for config in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        r = resolve_model(ModelConfig(**config))\n"
        "        print(json.dumps({'path': str(r.path), 'model_sha': r.model_sha, 'source': r.source}))\n"
        "    except ModelLoadError as error:\n"
        "        print(json.dumps({'error': str(error)}))\n"
    )
    hub_prefixes = ("HF_", "HUGGINGFACE")
    child_env = {name: value for name, value in os.environ.items() if not name.startswith(hub_prefixes)}
    child_env.update(
        {
            "HF_HUB_ETAG_TIMEOUT": "3",
            "HF_HUB_DOWNLOAD_TIMEOUT": "3",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONPATH": str(REPO_ROOT),
        },
        **env,
    )
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(configs)],
        env=child_env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.strip().splitlines()[-len(configs) :]]


def write_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Lay out `source` the way huggingface_hub caches a download: blobs, snapshot symlinks, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.timeout(60)
def test_offline_mode_without_cache_is_one_clear_line(tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    message = resolve_in_subprocess(offline, model_id="org/tiny")["error"]
    assert message.startswith("could not fetch 'org/tiny' from the Hugging Face hub: offline mode")
    assert str(tmp_path) in message and "\n" not in message


@pytest.mark.timeout(60)
def test_unreachable_hub_is_one_clear_line(tmp_path):
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path)}
    message = resolve_in_subprocess(env, model_id="org/tiny")["error"]
    assert message.startswith("could not fetch 'org/tiny' from the Hugging Face hub: the hub at http://127.0.0.1:9")
    assert "can't be reached" in message and "\n" not in message


@pytest.mark.timeout(60)
def test_offline_mode_reads_a_populated_hub_cache(tmp_path, model_dir, reference, tokenizer):
    snapshot = write_hub_cache(tmp_path, "org/tiny", model_dir)
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    result = resolve_in_subprocess(offline, model_id="org/tiny")
    assert result == {"path": str(snapshot), "model_sha": COMMIT, "source": "hub"}
    model = load_model(result["path"], dtype=torch.float32, device="cpu", attn_implementation="eager")
    assert_same_logits(model, reference, input_ids(tokenizer))


@pytest.mark.timeout(60)
def test_configured_hub_cache_wins_over_the_environment(tmp_path, bin_dir):
    """`huggingface_hub_cache` is used, and a repo without safetensors falls back to its `.bin`."""
    snapshot = write_hub_cache(tmp_path / "configured", "org/tiny-bin", bin_dir)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty")}
    configured = str(tmp_path / "configured")
    result = resolve_in_subprocess(env, model_id="org/tiny-bin", huggingface_hub_cache=configured)
    assert result == {"path": str(snapshot), "model_sha": COMMIT, "source": "hub"}
    assert (snapshot / "pytorch_model.bin").is_file()


class _HubErrors(BaseHTTPRequestHandler):
    """Answers every API call the way the hub does for a missing repository or revision."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        code = "RevisionNotFound" if "/revision/v9" in self.path else "RepoNotFound"
        body = json.dumps({"error": f"{code} for {self.path}"}).encode()
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub_errors_endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubErrors)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(60)
def test_missing_repo_and_revision_are_named(tmp_path, hub_errors_endpoint):
    env = {"HF_ENDPOINT": hub_errors_endpoint, "HF_HUB_CACHE": str(tmp_path)}
    missing_repo, missing_revision = resolve_many_in_subprocess(
        env, {"model_id": "org/missing"}, {"model_id": "org/tiny", "revision": "v9"}
    )
    assert missing_repo["error"].startswith("could not fetch 'org/missing' from the Hugging Face hub: ")
    assert "repository not found" in missing_repo["error"]
    assert "revision 'v9' not found" in missing_revision["error"]
