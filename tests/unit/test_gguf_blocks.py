"""GGUF blocks decoded into packed weights: the same floats as gguf-py, mapped onto the right linears.

The reference is `gguf.quants.dequantize` (what transformers' GGUF reader uses). Random blocks cover
every code and sub-scale pattern; the fp16 block scales are set to finite values, zeros, subnormals
and the largest fp16 included. A tiny llama written as a GGUF with mixed types checks the mapping
against the folder `convert_gguf` makes from the same file.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from test_gguf import add_tokenizer, digit_splitting_tokenizer, gguf_tensors
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, GGUFTensor, LlamaTensorProcessor

from inference_service.worker.weights.gguf.blocks import (
    SUPPORTED_TYPES,
    is_quantized_type,
    is_supported_type,
    packed_from_gguf,
)
from inference_service.worker.weights.gguf.convert import convert_gguf
from inference_service.worker.weights.gguf.weights import gguf_linear_weights

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of each type's fp16 fields (d, and m or dmin), the bytes random data could make inf/NaN.
FP16_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.Q2_K: (80, 82),
}
# gguf-py computes these as one product d·(q − c), which gives −0.0 where our exact sum gives +0.0.
SIGNED_ZERO_MAY_DIFFER = {Q.Q4_0, Q.Q8_0, Q.Q6_K}
LAYOUT = {Q.Q4_0: (4, 32), Q.Q4_1: (4, 32), Q.Q8_0: (8, 32), Q.Q4_K: (4, 32), Q.Q5_K: (8, 32), Q.Q6_K: (8, 16)}
# 0, −0, ±1, the largest fp16, the smallest subnormal and a negative one.
SPECIAL_FP16 = np.array([0x0000, 0x8000, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x0001, 0x8234], dtype=np.uint16)


def finite_fp16_bits(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` fp16 bit patterns: half uniformly random finite ones, half from SPECIAL_FP16."""
    bits = rng.integers(0, 1 << 16, size=count, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)  # an all-ones exponent is inf/NaN
    special = rng.random(count) < 0.5
    bits[special] = rng.choice(SPECIAL_FP16, size=int(special.sum()))
    return bits


def random_blocks(
    rng: np.random.Generator, quant_type: Q, shape: tuple[int, int], fp16: np.ndarray | None = None
) -> np.ndarray:
    """Random uint8 `[N, row bytes]` for an `[N, K]` tensor, its fp16 fields finite (or from `fp16`)."""
    n, k = shape
    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    raw = rng.integers(0, 256, size=(n, k // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for start in FP16_FIELDS[quant_type]:
        values = finite_fp16_bits(rng, len(blocks)) if fp16 is None else rng.choice(fp16, len(blocks)).view(np.uint16)
        blocks[:, start : start + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw


def assert_same_as_gguf(raw: np.ndarray, quant_type: Q, shape: tuple[int, int]) -> None:
    """`packed_from_gguf(...).dequantize()` holds gguf-py's floats, bit for bit (see SIGNED_ZERO_MAY_DIFFER)."""
    packed = packed_from_gguf(raw, quant_type, shape)
    assert (packed.bits, packed.group_size) == LAYOUT[quant_type]
    ours = packed.dequantize().numpy()
    expected = gguf.quants.dequantize(raw, quant_type).reshape(shape)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(ours, expected)  # −0.0 == +0.0 here
    if quant_type in SIGNED_ZERO_MAY_DIFFER:  # adding +0.0 turns −0.0 into +0.0 and changes nothing else
        ours, expected = ours + np.float32(0), expected + np.float32(0)
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("quant_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, blocks_per_row", [(1, 1), (3, 3), (17, 4), (2, 32)])
def test_random_blocks_decode_to_gguf_pys_floats(quant_type, rows, blocks_per_row):
    rng = np.random.default_rng([int(quant_type), rows, blocks_per_row])
    shape = (rows, GGML_QUANT_SIZES[quant_type][0] * blocks_per_row)
    assert_same_as_gguf(random_blocks(rng, quant_type, shape), quant_type, shape)


@pytest.mark.parametrize("quant_type", TYPES, ids=lambda t: t.name)
def test_degenerate_scales(quant_type):
    """All-zero, all-largest and all-negative block scales, where signs of zeros and overflow would show."""
    rng = np.random.default_rng(int(quant_type))
    shape = (4, 2 * GGML_QUANT_SIZES[quant_type][0])
    for value in (0.0, -0.0, 65504.0, -65504.0, -3.5e-3):
        raw = random_blocks(rng, quant_type, shape, fp16=np.array([value], dtype=np.float16))
        assert_same_as_gguf(raw, quant_type, shape)


@pytest.mark.parametrize("quant_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_round_trip_of_real_data_quantized_by_gguf_py(quant_type):
    """gguf-py quantizes these types itself: its blocks of a real weight decode to its floats."""
    weight = np.random.default_rng(0).standard_normal((48, 320)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(weight, quant_type)
    assert_same_as_gguf(raw, quant_type, weight.shape)
    decoded = packed_from_gguf(raw, quant_type, weight.shape).dequantize().numpy()
    step = np.abs(weight).max() / (127 if quant_type == Q.Q8_0 else 7)
    np.testing.assert_allclose(decoded, weight, rtol=0, atol=step)


@pytest.mark.parametrize("quant_type", TYPES, ids=lambda t: t.name)
def test_codes_fit_their_bits(quant_type):
    rng = np.random.default_rng(1)
    shape = (8, 512)
    packed = packed_from_gguf(random_blocks(rng, quant_type, shape), quant_type, shape)
    top = {Q.Q5_K: 31, Q.Q6_K: 63}.get(quant_type, 2**packed.bits - 1)
    codes = packed.unpacked_codes()
    assert int(codes.max()) == top and int(codes.min()) == 0  # random blocks use every code


def test_raw_of_any_shape_and_read_only():
    """A GGUFReader memmap is read-only and `[N, row bytes]`; a flat buffer works too."""
    rng = np.random.default_rng(2)
    raw = random_blocks(rng, Q.Q4_K, (3, 512))
    raw.flags.writeable = False
    packed = packed_from_gguf(raw, Q.Q4_K, (3, 512))
    assert torch.equal(packed.codes, packed_from_gguf(raw.ravel(), Q.Q4_K, (3, 512)).codes)


def test_type_checks_and_refusals():
    assert not any(is_quantized_type(t) for t in (Q.F32, Q.F16, Q.BF16))
    assert all(is_quantized_type(t) for t in (*TYPES, Q.Q2_K, Q.IQ4_XS))
    assert set(TYPES) == SUPPORTED_TYPES and not is_supported_type(Q.Q2_K) and not is_supported_type(Q.F16)
    raw = np.zeros((2, 18), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q2_K is not supported"):
        packed_from_gguf(np.zeros((1, 84), dtype=np.uint8), Q.Q2_K, (1, 256))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        packed_from_gguf(raw, Q.Q4_0, (2, 16))
    with pytest.raises(ValueError, match="36 uint8 bytes, got 18"):
        packed_from_gguf(raw[:1], Q.Q4_0, (2, 32))


# -- the mapping onto a transformers model ------------------------------------------------------------
HIDDEN, INTERMEDIATE = 256, 512  # K-quant rows are multiples of 256
# Layer 0 covers every supported type (q and k are K-quants: rows llama.cpp permutes); layer 1 keeps
# an F16, an F32 and an unsupported quantized type (Q2_K) that must stay dense.
TENSOR_TYPES = {
    "blk.0.attn_q.weight": Q.Q4_K,
    "blk.0.attn_k.weight": Q.Q6_K,
    "blk.0.attn_v.weight": Q.Q8_0,
    "blk.0.attn_output.weight": Q.Q4_0,
    "blk.0.ffn_gate.weight": Q.Q5_K,
    "blk.0.ffn_up.weight": Q.Q4_1,
    "blk.0.ffn_down.weight": Q.Q4_K,
    "blk.1.attn_q.weight": Q.Q4_0,
    "blk.1.attn_k.weight": Q.Q8_0,
    "blk.1.attn_v.weight": Q.F16,
    "blk.1.attn_output.weight": Q.Q6_K,
    "blk.1.ffn_gate.weight": Q.Q2_K,
    "blk.1.ffn_up.weight": Q.Q5_K,
    "blk.1.ffn_down.weight": Q.F32,
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q6_K,
}
DENSE_LINEARS = {"model.layers.1.self_attn.v_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj"}


def tiny_llama(vocab_size: int, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def write_quantized_gguf(path: Path, model: LlamaForCausalLM, types: dict[str, Q]) -> Path:
    """`model` as llama.cpp writes it, each tensor in `types[name]` (F32 if absent).

    gguf-py quantizes Q4_0/Q4_1/Q8_0 itself; the other types get random blocks with scales near
    0.01, which exercise the decoders just as well (the test compares against what transformers reads).
    """
    config, rng = model.config, np.random.default_rng(4)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny quantized llama")
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
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    add_tokenizer(writer, digit_splitting_tokenizer())
    small_scales = (rng.standard_normal(64) * 0.01).astype(np.float16)
    for name, weights in gguf_tensors(model).items():
        quant_type = types.get(name, Q.F32)
        if quant_type in (Q.F32, Q.F16):
            writer.add_tensor(name, weights.astype(np.float32 if quant_type == Q.F32 else np.float16))
        elif quant_type in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            writer.add_tensor(name, gguf.quants.quantize(weights, quant_type), raw_dtype=quant_type)
        else:
            writer.add_tensor(name, random_blocks(rng, quant_type, weights.shape, small_scales), raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def meta_model(folder: Path) -> torch.nn.Module:
    """The converted folder's model without weights: the mapping needs only its structure."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """`(tiny mixed-type GGUF, the folder convert_gguf makes of it)`."""
    root = tmp_path_factory.mktemp("gguf-packed")
    vocab_size = digit_splitting_tokenizer().get_vocab_size()
    path = write_quantized_gguf(root / "tiny-mixed.gguf", tiny_llama(vocab_size, tied=False), TENSOR_TYPES)
    return path, convert_gguf(path, root / "converted")


def test_every_packed_linear_is_the_weight_transformers_loads(quantized_gguf, caplog):
    path, folder = quantized_gguf
    model = meta_model(folder)
    with caplog.at_level(logging.INFO, logger="inference_service.worker.weights.gguf.weights"):
        packed = gguf_linear_weights(path, model)

    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert set(packed) == linears - DENSE_LINEARS  # lm_head (output.weight, Q6_K) included
    expected = load_file(folder / "model.safetensors")
    for name, weight in packed.items():
        assert torch.equal(weight.dequantize(), expected[f"{name}.weight"]), name
    assert (packed["lm_head"].bits, packed["lm_head"].group_size) == LAYOUT[Q.Q6_K]
    assert (packed["model.layers.0.self_attn.q_proj"].bits, packed["model.layers.0.mlp.up_proj"].bits) == (4, 4)
    assert "type Q2_K has no packed decoder: blk.1.ffn_gate.weight" in caplog.text
    assert "12 of 15 linears kept packed" in caplog.text


def test_q_and_k_rows_follow_transformers_reverse_permutation(quantized_gguf):
    """The raw GGUF rows of attn_q/attn_k are in llama.cpp's order; the packed ones in HF's."""
    path, folder = quantized_gguf
    packed = gguf_linear_weights(path, meta_model(folder))
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    in_file_order = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    hf_order = packed["model.layers.0.self_attn.q_proj"].dequantize().numpy()
    assert not np.array_equal(hf_order, in_file_order)
    heads, half = 4, HIDDEN // 4 // 2  # HF row (h, j·half + i) is llama.cpp row (h, 2i + j)
    np.testing.assert_array_equal(
        hf_order.reshape(heads, 2, half, -1), in_file_order.reshape(heads, half, 2, -1).swapaxes(1, 2)
    )


class UnusualProcessor(LlamaTensorProcessor):
    """Llama's processor plus transforms of the kinds other architectures use."""

    def process(self, weights, name, **kwargs):
        if "blk.0.ffn_up." in name:
            return GGUFTensor(weights[::-1], name, {})  # a row permutation: replayed on packed rows
        if "blk.0.ffn_gate." in name:
            return GGUFTensor(weights * 2, name, {})
        if "blk.0.attn_output." in name:
            return GGUFTensor(weights.T, name, {})  # square, so only the values tell
        if "blk.0.ffn_down." in name:
            return GGUFTensor(np.abs(weights), name, {})
        if "blk.0.attn_v." in name:
            kwargs["parsed_parameters"]["tensors"]["model.layers.0.self_attn.v_proj.weight"] = weights
            return GGUFTensor(weights, None, {})  # stored by the processor itself
        return super().process(weights, name, **kwargs)


def test_only_row_permutations_are_replayed(quantized_gguf, monkeypatch, caplog):
    path, folder = quantized_gguf
    monkeypatch.setitem(TENSOR_PROCESSORS, "llama", UnusualProcessor)
    with caplog.at_level(logging.INFO, logger="inference_service.worker.weights.gguf.weights"):
        packed = gguf_linear_weights(path, meta_model(folder))

    dropped = {
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.v_proj",
    }
    assert not dropped & set(packed)
    assert "does more than reorder rows: blk.0.attn_output.weight, blk.0.ffn_gate.weight, blk.0.ffn_down" in caplog.text
    assert "processor stores it itself: blk.0.attn_v.weight" in caplog.text
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    reversed_rows = gguf.quants.dequantize(tensor.data, tensor.tensor_type)[::-1]
    np.testing.assert_array_equal(packed["model.layers.0.mlp.up_proj"].dequantize().numpy(), reversed_rows)


def test_tied_lm_head_stays_with_the_dense_embedding(tmp_path, caplog):
    vocab_size = digit_splitting_tokenizer().get_vocab_size()
    types = {name: Q.Q8_0 for name in TENSOR_TYPES}
    path = write_quantized_gguf(tmp_path / "tied.gguf", tiny_llama(vocab_size, tied=True), types)
    folder = convert_gguf(path, tmp_path / "converted")
    with caplog.at_level(logging.INFO, logger="inference_service.worker.weights.gguf.weights"):
        packed = gguf_linear_weights(path, meta_model(folder))
    assert len(packed) == 14 and "lm_head" not in packed
    assert "lm_head tied to the embedding" in caplog.text
    expected = load_file(folder / "model.safetensors")
    assert all(torch.equal(weight.dequantize(), expected[f"{name}.weight"]) for name, weight in packed.items())
