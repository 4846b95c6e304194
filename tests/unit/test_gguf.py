"""GGUF conversion: a tiny llama written as llama.cpp writes it comes back with the same logits."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from inference_service.config import ModelConfig
from inference_service.errors import ModelLoadError
from inference_service.models.loader import load_model, load_tokenizer, resolve_model
from inference_service.worker.weights.gguf.convert import CONVERSION_MARKER, conversion_name, convert_gguf, is_converted

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2018 there were 12345 cats.",
    "Hello world! Hello tokenizer, hello model, 42 times.",
    "2019 2020 12 123 1234 2018 42",
] * 20
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXTS = ["In 2018 there were 12345 cats.", "Hello world!  The quick brown fox, 42 times.", "<|im_start|>hi"]


def digit_splitting_tokenizer() -> Tokenizer:
    """A tiny byte-level BPE that splits digits first, like SmolLM2's (GGUF pre-tokenizer `smollm`).

    It is trained without the digit split, so it has digit merges ("Ġ1", "20"): a converted
    tokenizer that lost the split encodes numbers differently, and the test sees it.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return tokenizer


def tiny_llama(vocab_size: int, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row order (interleaved rotary halves)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's tensor names, q/k permuted as llama.cpp does."""
    config, state = model.config, {name: t.detach().numpy() for name, t in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            weights = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weights = llama_cpp_permute(weights, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weights = llama_cpp_permute(weights, config.num_key_value_heads)
            tensors[f"blk.{layer}.{gguf_name}.weight"] = weights
    return tensors


def write_gguf(path: Path, model: LlamaForCausalLM, tokenizer: Tokenizer, float_type: str) -> Path:
    """Write `model` and `tokenizer` as a llama-architecture GGUF; 2-D weights in `float_type`."""
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if float_type == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    add_tokenizer(writer, tokenizer)
    for name, weights in gguf_tensors(model).items():
        as_half = float_type == "f16" and weights.ndim == 2  # llama.cpp keeps norms in f32
        writer.add_tensor(name, weights.astype(np.float16) if as_half else weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Tokenizer) -> None:
    """The tokenizer as llama.cpp stores a GPT-2-style BPE: tokens, types, merges, special ids."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in merges])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_unk_token_id(vocab["<|endoftext|>"])
    writer.add_pad_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return digit_splitting_tokenizer()


def rounded_to(model: LlamaForCausalLM, float_type: str) -> dict[str, torch.Tensor]:
    """The state the GGUF holds: 2-D weights rounded through float16 for an f16 file."""
    state = model.state_dict()
    if float_type == "f32":
        return state
    return {name: t.half().float() if t.ndim == 2 else t for name, t in state.items()}


@pytest.mark.parametrize(("float_type", "tied"), [("f32", True), ("f16", False)])
def test_converted_model_has_the_original_weights_and_logits(tmp_path, tokenizer, float_type, tied):
    original = tiny_llama(tokenizer.get_vocab_size(), tied)
    gguf_path = write_gguf(tmp_path / f"tiny-{float_type}.gguf", original, tokenizer, float_type)
    folder = convert_gguf(gguf_path, tmp_path / "converted")

    expected = rounded_to(original, float_type)
    converted = load_model(folder, dtype=torch.float32, device="cpu", attn_implementation="eager")
    assert converted.config.tie_word_embeddings == tied
    actual = converted.state_dict()
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name  # dequantizing f32/f16 is exact

    reference = tiny_llama(tokenizer.get_vocab_size(), tied)
    reference.load_state_dict(expected)
    reference.set_attn_implementation("eager")
    ids = torch.tensor([tokenizer.encode(TEXTS[0]).ids])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory, tokenizer) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    gguf_path = write_gguf(root / "tiny.gguf", tiny_llama(tokenizer.get_vocab_size(), True), tokenizer, "f32")
    return convert_gguf(gguf_path, root / "converted")


def test_tokenizer_splits_digits_and_matches_the_original(converted_dir, tokenizer):
    plain_byte_level = [
        piece for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(" 2018")
    ]
    assert len(tokenizer.model.tokenize(plain_byte_level[0])) < 5  # digits merge without the split
    loaded = load_tokenizer(converted_dir)
    pieces = loaded.convert_ids_to_tokens(loaded("In 2018 there were 12345 cats.")["input_ids"])
    assert [piece.replace("Ġ", " ") for piece in pieces][1:6] == [" ", "2", "0", "1", "8"]
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tokenizer.encode(text).ids, text
    assert loaded.eos_token == "<|im_end|>" and loaded.bos_token == "<|im_start|>"


def test_chat_template_is_kept(converted_dir):
    loaded = load_tokenizer(converted_dir)
    text = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_folder_is_portable_float32_safetensors(converted_dir):
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert "quantization_config" not in config
    tokenizer_config = json.loads((converted_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    with safe_open(converted_dir / "model.safetensors", framework="pt") as weights:
        names = weights.keys()
        assert {weights.get_slice(name).get_dtype() for name in names} == {"F32"}
    assert is_converted(converted_dir)


def test_finished_conversion_is_reused(converted_dir):
    marker = converted_dir / CONVERSION_MARKER
    before = marker.stat().st_mtime_ns
    source = converted_dir.parent / "tiny.gguf"
    assert convert_gguf(source, converted_dir) == converted_dir
    assert marker.stat().st_mtime_ns == before
    assert json.loads(marker.read_text())["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()


def test_broken_file_leaves_no_folder(tmp_path, converted_dir):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes((converted_dir.parent / "tiny.gguf").read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="could not convert GGUF file 'broken.gguf'"):
        convert_gguf(broken, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]


def test_leftovers_of_killed_conversions_are_removed(tmp_path, converted_dir):
    old, recent = tmp_path / ".out.partial-old", tmp_path / ".out.partial-recent"
    old.mkdir()
    recent.mkdir()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    convert_gguf(converted_dir.parent / "tiny.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial-recent", "out"]


def test_resolve_model_converts_a_gguf_once_into_the_cache(tmp_path, monkeypatch, converted_dir):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = converted_dir.parent / "tiny.gguf"
    sha256 = hashlib.sha256(source.read_bytes()).hexdigest()
    resolved = resolve_model(ModelConfig(model_id=str(source)))
    assert resolved.path == tmp_path / "inference-service" / "gguf" / conversion_name(sha256)
    assert (resolved.model_sha, resolved.source) == (sha256, "gguf")
    marker_time = (resolved.path / CONVERSION_MARKER).stat().st_mtime_ns
    assert resolve_model(ModelConfig(model_id=str(source))) == resolved
    assert (resolved.path / CONVERSION_MARKER).stat().st_mtime_ns == marker_time
