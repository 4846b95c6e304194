"""GGUF files of the decoder architectures transformers' GGUF reader handles load and serve.

Each tiny random model is written as llama.cpp's converter writes it: llama.cpp's tensor names
(gguf-py's own name map), its metadata keys, and its tensor layouts (Llama's permuted Q/K rows, the
transposed GPT-2 Conv1D weights, BLOOM's Q/K/V regrouped from per-head interleaving, Gemma's norm
weights stored as 1 + w). Loaded back through the ordinary `.gguf` model id, the model computes the
original's logits, and the engine's greedy output equals the original's `generate`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from tiny_models import tiny_config, tiny_model
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig
from inference_service.engine.builder import build_engine
from inference_service.models.loader import load_model, resolve_model
from inference_service.sampling_params import EngineRequest, SamplingParams, StoppingParams
from tests.unit.test_gguf import add_tokenizer, digit_splitting_tokenizer

# HF model type → (the GGUF architecture llama.cpp writes, config overrides). Mistral files are
# written as "llama" by llama.cpp; Falcon in its multi-query (7B) layout; StableLM without per-head
# Q/K norms; Gemma2 with its 2B/9B attention scale and softcap (transformers' reader takes neither
# from the file).
ARCHITECTURES = {
    "llama": ("llama", {}),
    "mistral": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0}),
    "stablelm": ("stablelm", {"qk_layernorm": False}),
    "gpt2": ("gpt2", {"n_inner": None}),  # llama.cpp writes 4 × width, as every GPT-2 checkpoint has
    "bloom": ("bloom", {}),
    "falcon": ("falcon", {"multi_query": True, "new_decoder_architecture": False}),
}


BLOOM_CONTEXT = 256


def llama_cpp_layout(arch: str, gguf_name: str, weights: np.ndarray, config) -> np.ndarray:
    """The tensor as llama.cpp's convert_hf_to_gguf.py stores it (what transformers' reader undoes)."""
    if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
        return (
            weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape)
        )
    if arch == "gpt2" and gguf_name.endswith(
        ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")
    ):
        return weights.T.copy()
    if arch == "bloom" and "attn_qkv" in gguf_name:
        heads, width = config.n_head, config.hidden_size
        grouped = weights.reshape(heads, 3, width // heads, *weights.shape[1:])
        return np.concatenate([grouped[:, i].reshape(width, *weights.shape[1:]) for i in range(3)])
    if arch == "gemma2" and gguf_name.endswith("norm.weight"):
        return weights + 1
    return weights


def write_gguf(path, model, tokenizer, arch: str):
    config = model.config
    writer = GGUFWriter(path, arch)
    for key, attribute in GGUF_CONFIG_MAPPING[arch].items():
        value = getattr(config, attribute, None) if attribute else None
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
    if arch == "bloom":  # llama.cpp writes one (`seq_length`, else the width); BLOOM's config has no field for it
        writer.add_context_length(BLOOM_CONTEXT)
    if arch == "gpt2":  # as llama.cpp: these two from fixed fields, not the mapping's names
        writer.add_context_length(config.n_positions)
        writer.add_feed_forward_length(4 * config.n_embd)
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int):  # llama.cpp writes it for every model whose config has one
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in rope and "rope.freq_base" in GGUF_CONFIG_MAPPING[arch]:
        writer.add_float32(f"{arch}.rope.freq_base", float(rope["rope_theta"]))
    add_tokenizer(writer, tokenizer)
    names = get_gguf_hf_weights_map(model, TensorProcessor(), model_type=arch)
    state = model.state_dict()
    written, storages = set(), set()
    for gguf_name, hf_name in names.items():
        if hf_name not in state or gguf_name in written or state[hf_name].data_ptr() in storages:
            continue  # a tied output matrix is not written again, as llama.cpp leaves it out
        storages.add(state[hf_name].data_ptr())
        weights = state[hf_name].float().numpy()
        writer.add_tensor(gguf_name, llama_cpp_layout(arch, gguf_name, weights, config))
        written.add(gguf_name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return digit_splitting_tokenizer()


@pytest.fixture(params=list(ARCHITECTURES))
def written(request, tmp_path, tokenizer, monkeypatch):
    """(original model, path of its GGUF file); conversions go to a temporary cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    arch, overrides = ARCHITECTURES[request.param]
    vocab = tokenizer.get_vocab()
    config = tiny_config(
        request.param,
        vocab_size=len(vocab),
        bos_token_id=vocab["<|im_start|>"],
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|im_end|>"],
        **overrides,
    )
    model = tiny_model(config)
    return model, write_gguf(tmp_path / f"tiny-{request.param}.gguf", model, tokenizer, arch)


def greedy(prompt: list[int], max_new_tokens: int) -> EngineRequest:
    """A greedy request for exactly `max_new_tokens` tokens (EOS ignored)."""
    return EngineRequest(
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


def served_greedy(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The tokens an engine serving the file at `path` generates greedily for `prompt`."""
    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model_id=str(path)),
            cache=CacheConfig(max_batch_total_tokens=512),
            limits=LimitsConfig(max_total_tokens=64),
        )
    )
    engine.add_request("r", greedy(prompt, max_new_tokens))
    tokens = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += [t.id for t in output.tokens]
    return tokens


def test_a_gguf_file_loads_with_the_original_logits_and_serves_what_it_generates(written):
    original, path = written
    resolved = resolve_model(ModelConfig(model_id=str(path)))
    loaded = load_model(resolved.path, dtype=torch.float32, device="cpu", attn_implementation="eager")
    ids = torch.tensor([[5, 17, 3, 42, 8, 99, 23]])
    with torch.inference_mode():
        expected, got = original(ids).logits, loaded(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    tokens = served_greedy(path, ids[0].tolist(), 10)
    with torch.inference_mode():
        reference = original.generate(
            ids, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=original.config.eos_token_id
        )
    assert tokens == reference[0, ids.shape[1] :].tolist()


def test_a_bloom_gguf_keeps_the_context_length_it_states(tmp_path, tokenizer, monkeypatch):
    """transformers' reader drops `bloom.context_length`; the conversion keeps it, and it is the
    default --max-total-tokens as for any model stating one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    vocab = tokenizer.get_vocab()
    model = tiny_model(tiny_config("bloom", vocab_size=len(vocab), eos_token_id=vocab["<|im_end|>"]))
    path = write_gguf(tmp_path / "tiny-bloom.gguf", model, tokenizer, "bloom")
    engine = build_engine(
        EngineConfig(model=ModelConfig(model_id=str(path)), cache=CacheConfig(max_batch_total_tokens=4096))
    )
    assert (engine.info.max_total_tokens, engine.info.max_input_tokens) == (BLOOM_CONTEXT, BLOOM_CONTEXT - 1)
