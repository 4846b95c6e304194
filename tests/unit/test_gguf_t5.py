"""T5-family GGUF files load as the model they were written from, and serve what it generates.

llama.cpp writes FLAN-T5/T5 v1.1 (gated GELU feed-forward, its own output matrix), original T5
(ReLU, output tied to the embeddings, stored or not) and umT5 under the one `t5` architecture, and
tells them apart by the tensors present. transformers' reader makes every one of them gated and tied;
the converter reads them as llama.cpp does. The tiny models also give the decoder more layers than
the encoder, which the reader's name map alone would drop.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, DynamicCache, EncoderDecoderCache, T5Tokenizer
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

from inference_service.config import ModelConfig
from inference_service.models.loader import load_model, resolve_model
from tests.unit.test_gguf_architectures import served_greedy

TOKENS = ["<pad>", "</s>", "<unk>"] + [f"\u2581w{i}" for i in range(120)] + [chr(97 + i) for i in range(26)]
SCORES = [0.0, 0.0, 0.0] + [-float(i) for i in range(1, len(TOKENS) - 2)]
TOKEN_TYPES = [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3)

# case → (model type, feed-forward, output matrix: "own", "copy" of the embeddings, or "none" written)
CASES = {
    "flan-t5": ("t5", "gated-gelu", "own"),
    "t5-tied": ("t5", "relu", "none"),
    "t5-tied-stored": ("t5", "relu", "copy"),
    "t5-relu-untied": ("t5", "relu", "own"),
    "umt5": ("umt5", "gated-gelu", "own"),
}


def tiny_t5(model_type: str, feed_forward: str, output: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(TOKENS),
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        feed_forward_proj=feed_forward,
        tie_word_embeddings=output != "own",
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = AutoModelForSeq2SeqLM.from_config(config, dtype=torch.float32).eval()
    if output == "own":  # transformers 5 ties every T5 it builds; checkpoints like FLAN-T5's are not
        model.lm_head.weight = torch.nn.Parameter(torch.randn(len(TOKENS), 64))
    return model


def write_gguf(path, model, output: str) -> None:
    """The model as llama.cpp's convert_hf_to_gguf.py writes a T5: its keys, names and tokenizer."""
    config = model.config
    writer = gguf.GGUFWriter(path, "t5")
    writer.add_name(f"tiny {config.model_type}")  # transformers' reader tells umT5 by the name
    writer.add_context_length(512)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_block_count(config.num_layers)
    writer.add_decoder_block_count(config.num_decoder_layers)
    writer.add_head_count(config.num_heads)
    writer.add_key_length(config.d_kv)
    writer.add_value_length(config.d_kv)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    writer.add_relative_attn_buckets_count(config.relative_attention_num_buckets)
    writer.add_decoder_start_token_id(config.decoder_start_token_id)
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores(SCORES)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(True)
    depth = max(config.num_layers, config.num_decoder_layers)
    names = get_gguf_hf_weights_map(model, TensorProcessor(), model_type="t5", num_layers=depth)
    state = model.state_dict()
    for gguf_name, hf_name in names.items():
        if hf_name.endswith("embed_tokens.weight") or (gguf_name == "output.weight" and output == "none"):
            continue  # llama.cpp keeps one embedding matrix, and writes lm_head only where there is one
        writer.add_tensor(gguf_name, state[hf_name].float().numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(params=list(CASES))
def written(request, tmp_path, monkeypatch):
    """(original model, path of its GGUF file); conversions go to a temporary cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model_type, feed_forward, output = CASES[request.param]
    model = tiny_t5(model_type, feed_forward, output)
    path = tmp_path / f"tiny-{request.param}.gguf"
    write_gguf(path, model, output)
    return model, path


def test_a_t5_gguf_loads_with_the_original_logits_and_serves_what_it_generates(written):
    original, path = written
    resolved = resolve_model(ModelConfig(model_id=str(path)))
    loaded = load_model(resolved.path, dtype=torch.float32, device="cpu", attn_implementation="eager")
    assert type(loaded.config) is type(original.config)
    encoder_ids, decoder_ids = torch.tensor([[5, 17, 3, 42, 8, 99, 23, 1]]), torch.tensor([[0, 7, 9, 31]])
    with torch.inference_mode():
        expected = original(input_ids=encoder_ids, decoder_input_ids=decoder_ids).logits
        got = loaded(input_ids=encoder_ids, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    tokenizer = T5Tokenizer.from_pretrained(resolved.path)
    assert tokenizer.convert_ids_to_tokens([5, 130]) == [TOKENS[5], TOKENS[130]]

    tokens = served_greedy(path, encoder_ids[0].tolist(), 10)
    # An explicit cache: generate's own is sized by the encoder's depth, too shallow for this decoder.
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.inference_mode():
        reference = original.generate(
            encoder_ids, do_sample=False, max_new_tokens=10, eos_token_id=None, past_key_values=cache
        )
    assert tokens == reference[0, 1:].tolist()
