"""GPTQ / AWQ / compressed-tensors readers against the writers, the formats' documented layouts and the
compressed-tensors library itself.

The round trips compare PackedWeight fields (codes, scales, offsets) exactly: a reader must return
the very grid the writer quantized to. For GPTQ and AWQ, whose maintained library can't be
installed here, a slow element-by-element decoder written from the libraries' own dequantize code
(GPTQModel `PackableQuantLinear.dequantize_weight`, AutoAWQ `dequantize_gemm`) checks the layout
independently of our byte-view unpacking.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from inference_service.errors import ModelLoadError
from inference_service.worker.kernels.packed import PackedWeight, quantize_rtn
from inference_service.worker.weights.compressed_tensors import (
    packed_from_compressed_tensors,
    scheme_for_module,
    validate_compressed_tensors_config,
)
from inference_service.worker.weights.gptq import AWQ_ORDER, packed_from_awq, packed_from_gptq
from tools.checkpoint_writers import (
    IntegerCode,
    awq_tensors,
    compressed_tensors_config,
    compressed_tensors_tensors,
    gptq_tensors,
    quantize_integer,
    write_checkpoint,
)


def assert_same(actual: PackedWeight, expected: PackedWeight) -> None:
    assert (actual.bits, actual.group_size, actual.in_features) == (
        expected.bits,
        expected.group_size,
        expected.in_features,
    )
    assert torch.equal(actual.codes, expected.codes)
    assert torch.equal(actual.scales, expected.scales)
    assert torch.equal(actual.offsets, expected.offsets)


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def natural_g_idx(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k) // (k if group_size == -1 else group_size)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_symmetric_fp32_grid_is_quantize_rtn(bits, group_size):
    w = weight(48, 256)
    expected = quantize_rtn(w, bits, 256 if group_size == -1 else group_size, symmetric=True)
    assert_same(quantize_integer(w, bits, group_size, sym=True, scale_dtype=torch.float32).packed(), expected)


# -- GPTQ ------------------------------------------------------------------------------------------
def gptq_reference(qweight, qzeros, scales, g_idx, bits, checkpoint_format):
    """Element by element, as GPTQModel's dequantize_weight: code k of column n in word k // pf at
    bit bits·(k % pf); zeros along N the same way; v1 adds 1 to every zero field of the word."""
    per_word, top = 32 // bits, 2**bits - 1
    words = qzeros.long() & 0xFFFFFFFF
    if checkpoint_format == "gptq":
        words = (words + sum(1 << s for s in range(0, 32, bits))) & 0xFFFFFFFF
    k_total, n_total = g_idx.numel(), scales.shape[1]
    out = torch.empty(n_total, k_total)
    for k in range(k_total):
        g = int(g_idx[k])
        for n in range(n_total):
            q = (int(qweight[k // per_word, n]) >> (bits * (k % per_word))) & top
            z = (int(words[g, n // per_word]) >> (bits * (n % per_word))) & top
            out[n, k] = float(scales[g, n]) * (q - z)
    return out


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_gptq_round_trip(bits, sym, group_size, checkpoint_format):
    code = quantize_integer(weight(67, 256), bits, group_size, sym)  # odd N: qzeros' last word is partial
    tensors = gptq_tensors(code, natural_g_idx(256, group_size), checkpoint_format)
    assert tensors["qweight"].shape == (256 * bits // 32, 67) and tensors["qweight"].dtype == torch.int32
    assert tensors["qzeros"].shape == (code.zeros.shape[1], -(-67 * bits // 32))
    assert tensors["scales"].dtype == torch.float16 and tensors["g_idx"].dtype == torch.int32
    packed, perm = packed_from_gptq(
        tensors["qweight"],
        tensors["qzeros"],
        tensors["scales"],
        tensors["g_idx"],
        bits=bits,
        group_size=group_size,
        sym=sym,
        checkpoint_format=checkpoint_format,
    )
    assert perm is None
    assert_same(packed, code.packed())


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_layout_matches_the_reference_decoder(bits, checkpoint_format):
    code = quantize_integer(weight(13, 72), bits, 32, sym=False)  # partial last group, odd N
    code.zeros[0, :] = 0  # v1 stores -1: the whole-word subtraction borrows from the next field
    code.zeros[1, :] = 2**bits - 1
    g_idx = natural_g_idx(72, 32)
    tensors = gptq_tensors(code, g_idx, checkpoint_format)
    expected = gptq_reference(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, bits, checkpoint_format)
    packed, _ = packed_from_gptq(
        tensors["qweight"],
        tensors["qzeros"],
        tensors["scales"],
        g_idx,
        bits=bits,
        group_size=32,
        checkpoint_format=checkpoint_format,
        sym=False,
    )
    assert torch.equal(packed.dequantize(), expected)
    assert torch.equal(packed.dequantize(), code.packed().dequantize())


def test_gptq_v1_zero_is_stored_minus_one():
    code = IntegerCode(
        codes=torch.zeros(8, 32, dtype=torch.uint8),
        zeros=torch.full((8, 1), 8, dtype=torch.uint8),
        scales=torch.ones(8, 1, dtype=torch.float16),
        bits=4,
        group_size=32,
    )
    assert int(gptq_tensors(code, natural_g_idx(32, 32), "gptq")["qzeros"][0, 0]) == 0x77777777
    assert int(gptq_tensors(code, natural_g_idx(32, 32), "gptq_v2")["qzeros"][0, 0]) == (0x88888888 - (1 << 32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_act_order(bits, sym, tmp_path):
    w = weight(40, 128, seed=3)
    order = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    code = quantize_integer(w[:, order], bits, 32, sym)  # groups formed over the act-order
    g_idx = torch.empty(128, dtype=torch.long).index_put_((order,), torch.arange(128) // 32)
    original = code.codes.clone()
    original[:, order] = code.codes  # qweight keeps the inputs' order
    tensors = gptq_tensors(IntegerCode(original, code.zeros, code.scales, bits, 32), g_idx)
    packed, perm = packed_from_gptq(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], bits=bits, group_size=32, sym=sym
    )
    assert perm is not None and perm.dtype == torch.int64
    reference = code.packed().dequantize()[:, torch.argsort(order)]  # fp32 [N, K] in the original order
    assert torch.equal(packed.dequantize()[:, torch.argsort(perm)], reference)
    x = torch.randn(3, 128)
    torch.testing.assert_close(x[..., perm] @ packed.dequantize().T, x @ reference.T, rtol=1e-5, atol=1e-5)


def test_gptq_errors():
    code = quantize_integer(weight(16, 64), 4, 32, sym=True)
    t = gptq_tensors(code, natural_g_idx(64, 32))
    args = (t["qweight"], t["qzeros"], t["scales"], t["g_idx"])
    for bits in (2, 3):
        with pytest.raises(ModelLoadError, match=f"GPTQ {bits}-bit weights are not supported"):
            packed_from_gptq(*args, bits=bits, group_size=32)
    with pytest.raises(ModelLoadError, match="checkpoint_format 'marlin' is not supported"):
        packed_from_gptq(*args, bits=4, group_size=32, checkpoint_format="marlin")
    with pytest.raises(ModelLoadError, match="int16; only int32 packing"):
        packed_from_gptq(t["qweight"].to(torch.int16), *args[1:], bits=4, group_size=32)
    with pytest.raises(ModelLoadError, match="exactly 32 inputs"):
        packed_from_gptq(
            *args[:3], torch.zeros(64, dtype=torch.int32).index_fill_(0, torch.tensor([5]), 1), bits=4, group_size=32
        )
    with pytest.raises(ModelLoadError, match="no qzeros"):
        packed_from_gptq(t["qweight"], None, t["scales"], t["g_idx"], bits=4, group_size=32, sym=False)
    with pytest.raises(ModelLoadError, match="GPTQ scales has shape"):
        packed_from_gptq(*args[:2], t["scales"][:1], t["g_idx"], bits=4, group_size=32)
    packed, _ = packed_from_gptq(t["qweight"], None, t["scales"], t["g_idx"], bits=4, group_size=32, sym=True)
    assert_same(packed, code.packed())  # symmetric without qzeros: the centre


# -- AWQ -------------------------------------------------------------------------------------------
def awq_gemm_reference(qweight, qzeros, scales, group_size):
    """As AutoAWQ's dequantize_gemm: nibble i of word c holds column 8c + AWQ_ORDER[i]."""
    k_total, n_total = qweight.shape[0], qweight.shape[1] * 8
    column_nibble = {AWQ_ORDER[i]: i for i in range(8)}
    out = torch.empty(n_total, k_total)
    for k in range(k_total):
        g = k // group_size
        for n in range(n_total):
            shift = 4 * column_nibble[n % 8]
            q = (int(qweight[k, n // 8]) >> shift) & 15
            z = (int(qzeros[g, n // 8]) >> shift) & 15
            out[n, k] = float(scales[g, n]) * (q - z)
    return out


@pytest.mark.parametrize("version", ["gemm", "gemv"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_round_trip(version, sym, group_size):
    code = quantize_integer(weight(48, 256), 4, group_size, sym)
    tensors = awq_tensors(code, version)
    if version == "gemm":
        assert tensors["qweight"].shape == (256, 6) and tensors["qzeros"].shape == (code.zeros.shape[1], 6)
    else:
        assert tensors["qweight"].shape == (48, 32) and tensors["scales"].shape[0] == 48
    packed = packed_from_awq(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], bits=4, group_size=group_size, version=version
    )
    assert_same(packed, code.packed())


def test_awq_gemm_layout_matches_the_reference_decoder():
    code = quantize_integer(weight(16, 64), 4, 32, sym=False)
    tensors = awq_tensors(code)
    expected = awq_gemm_reference(tensors["qweight"], tensors["qzeros"], tensors["scales"], 32)
    packed = packed_from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size=32)
    assert torch.equal(packed.dequantize(), expected)


def test_awq_errors():
    code = quantize_integer(weight(16, 64), 4, 32, sym=False)
    t = awq_tensors(code)
    with pytest.raises(ModelLoadError, match="AWQ 8-bit weights are not supported"):
        packed_from_awq(t["qweight"], t["qzeros"], t["scales"], bits=8, group_size=32)
    for version in ("gemv_fast", "marlin"):
        with pytest.raises(ModelLoadError, match=f"AWQ version '{version}' .* not supported"):
            packed_from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=32, version=version)
    with pytest.raises(ModelLoadError, match="AWQ qzeros has shape"):
        packed_from_awq(t["qweight"], t["qzeros"][:, :1], t["scales"], group_size=32)


# -- compressed-tensors ----------------------------------------------------------------------------
def ct_scheme(bits, group_size, sym, fmt="pack-quantized"):
    return compressed_tensors_config(bits, group_size, sym, fmt, [])["config_groups"]["group_0"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_compressed_tensors_pack_quantized_round_trip(bits, sym, group_size):
    from compressed_tensors.compressors import PackedQuantizationCompressor, pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationScheme

    n, k = 67, (100 if group_size == -1 else 256)  # odd N; channel: K not a multiple of the word
    code = quantize_integer(weight(n, k), bits, group_size, sym, scale_dtype=torch.float16)
    tensors = compressed_tensors_tensors(code, sym)
    scheme = ct_scheme(bits, group_size, sym)
    assert_same(packed_from_compressed_tensors(tensors, scheme), code.packed())

    centre = 2 ** (bits - 1)
    signed = (code.codes.to(torch.int16) - centre).to(torch.int8)
    # The writer packs as the library packs, and the library unpacks what we read.
    assert torch.equal(tensors["weight_packed"], pack_to_int32(signed, bits))
    assert torch.equal(unpack_from_int32(tensors["weight_packed"], bits, torch.Size((n, k))), signed)
    if not sym:
        zero_point = (code.zeros.to(torch.int16) - centre).to(torch.int8)
        assert torch.equal(tensors["weight_zero_point"], pack_to_int32(zero_point, bits, packed_dim=0))
    # The library's decompressor (fp32 scales: its (q - zp)·s is then exact, as ours).
    state = {**tensors, "weight_scale": tensors["weight_scale"].float()}
    dense = PackedQuantizationCompressor.decompress(state, QuantizationScheme.model_validate(scheme))["weight"]
    assert torch.equal(dense, code.packed().dequantize())


@pytest.mark.parametrize(
    ("fmt", "bits", "sym", "group_size"),
    [
        ("int-quantized", 8, True, -1),
        ("int-quantized", 8, False, -1),
        ("naive-quantized", 4, False, 32),
        ("naive-quantized", 8, True, 128),
    ],
)
def test_compressed_tensors_int_and_naive_quantized(fmt, bits, sym, group_size):
    from compressed_tensors.compressors import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    code = quantize_integer(weight(33, 256), bits, group_size, sym, scale_dtype=torch.float16)
    tensors = compressed_tensors_tensors(code, sym, fmt)
    assert tensors["weight"].dtype == torch.int8 and tensors["weight"].shape == (33, 256)
    scheme = ct_scheme(bits, group_size, sym, fmt)
    if fmt == "int-quantized":  # W8A8: the activations are quantized too
        with pytest.raises(ModelLoadError, match="activation quantization .*input_activations: int 8-bit, token"):
            packed_from_compressed_tensors(tensors, scheme)
    packed = packed_from_compressed_tensors(tensors, scheme, weights_only=True)
    assert_same(packed, code.packed())
    state = {**tensors, "weight_scale": tensors["weight_scale"].float()}
    dense = NaiveQuantizationCompressor.decompress(state, QuantizationScheme.model_validate(scheme))["weight"]
    assert torch.equal(dense, packed.dequantize())


def test_compressed_tensors_tensor_strategy_and_unpacked_zero_points():
    code = quantize_integer(weight(16, 64), 8, -1, sym=False, scale_dtype=torch.float16)
    code.scales[:] = code.scales[0, 0]  # one scale and zero point for the whole tensor
    code.zeros[:] = code.zeros[0, 0]
    tensors = compressed_tensors_tensors(code, sym=False)
    tensors["weight_scale"] = code.scales[:1, 0]  # [1]
    tensors["weight_zero_point"] = (code.zeros[:1, 0].to(torch.int16) - 128).to(torch.int8)  # [1], unpacked
    scheme = {
        "targets": ["Linear"],
        "format": "pack-quantized",
        "weights": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor"},
    }
    assert_same(packed_from_compressed_tensors(tensors, scheme), code.packed())


def test_compressed_tensors_errors():
    code = quantize_integer(weight(16, 64), 4, 32, sym=True)
    tensors = compressed_tensors_tensors(code, sym=True)
    scheme = ct_scheme(4, 32, True)

    def fails(match, scheme=scheme, tensors=tensors, **kwargs):
        with pytest.raises(ModelLoadError, match=match):
            packed_from_compressed_tensors(tensors, scheme, **kwargs)

    fails("fp8 weights \\(float-quantized\\) are not supported", {**scheme, "format": "float-quantized"})
    fails("2:4 sparse weights \\(marlin-24\\)", {**scheme, "format": "marlin-24"})
    fails(
        "float 8-bit weights are not supported",
        {**scheme, "format": "naive-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
    )
    fails("int2 weights are not supported", {**scheme, "weights": {**scheme["weights"], "num_bits": 2}})
    fails(
        "'block' weight strategy is not supported",
        {**scheme, "weights": {**scheme["weights"], "strategy": "block", "group_size": None}},
    )
    fails("act-order 'group'", {**scheme, "weights": {**scheme["weights"], "actorder": "group"}})
    fails("act-order 'group'", tensors={**tensors, "weight_g_idx": torch.arange(64).flip(0) // 32})
    fails(
        "activation quantization .*fp8|activation quantization .*float",
        {**scheme, "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
    )
    fails("no weight_packed", tensors={key: v for key, v in tensors.items() if key != "weight_packed"})
    fails(
        "asymmetric compressed-tensors weight has no weight_zero_point",
        {**scheme, "weights": {**scheme["weights"], "symmetric": False}},
    )
    fails("format 'mystery' is not supported", {**scheme, "format": "mystery"})


def test_compressed_tensors_config_checks_and_matching():
    config = compressed_tensors_config(4, 128, True, "pack-quantized", ["lm_head"])
    validate_compressed_tensors_config(config)
    for change, match in [
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity \\(sparse-24-bitmask"),
        ({"transform_config": {"config_groups": {"u": {}}}}, "transforms"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "KV-cache quantization"),
        ({"quantization_status": "initialized"}, "not finished"),
        ({"format": "float-quantized"}, "fp8 weights"),
    ]:
        with pytest.raises(ModelLoadError, match=match):
            validate_compressed_tensors_config({**config, **change})
    validate_compressed_tensors_config({**config, "kv_cache_scheme": {"num_bits": 8}}, weights_only=True)
    assert scheme_for_module(config, "lm_head") is None
    assert scheme_for_module(config, "model.layers.0.mlp.up_proj")["format"] == "pack-quantized"
    regex = {**config, "config_groups": {"g": {**config["config_groups"]["group_0"], "targets": ["re:.*mlp\\..*"]}}}
    assert scheme_for_module(regex, "model.layers.0.mlp.up_proj") is not None
    assert scheme_for_module(regex, "model.layers.0.self_attn.q_proj") is None


@pytest.mark.parametrize(
    ("bits", "group_size", "sym", "fmt"),
    [(4, 128, True, "pack-quantized"), (4, 32, False, "pack-quantized"), (8, -1, True, "int-quantized")],
)
def test_compressed_tensors_config_is_the_library_s(bits, group_size, sym, fmt):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    ours = compressed_tensors_config(bits, group_size, sym, fmt, ["lm_head"])
    weights = (
        QuantizationArgs(num_bits=bits, symmetric=sym, strategy="channel")
        if group_size == -1
        else QuantizationArgs(num_bits=bits, symmetric=sym, strategy="group", group_size=group_size)
    )
    activations = (
        QuantizationArgs(num_bits=8, symmetric=True, strategy="token", dynamic=True) if fmt == "int-quantized" else None
    )
    library = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(
                targets=["Linear"], weights=weights, input_activations=activations, format=fmt
            )
        },
        format=fmt,
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    expected = {
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **library.model_dump(exclude=["quant_method"]),
    }
    assert {key: v for key, v in ours.items() if key != "version"} == expected
    assert QuantizationConfig.model_validate(ours).model_dump() == library.model_dump()


# -- whole checkpoints -----------------------------------------------------------------------------
def module_tensors(tensors: dict, name: str) -> dict:
    return {key[len(name) + 1 :]: value for key, value in tensors.items() if key.startswith(name + ".")}


@pytest.mark.parametrize(
    ("options", "config_keys"),
    [
        (
            {"format": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq"},
            {
                "quant_method": "gptq",
                "bits": 4,
                "group_size": 32,
                "sym": True,
                "desc_act": False,
                "checkpoint_format": "gptq",
            },
        ),
        (
            {"format": "gptq", "bits": 8, "group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"},
            {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"},
        ),
        ({"format": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, {"quant_method": "gptq", "desc_act": True}),
        (
            {"format": "awq", "group_size": 32, "sym": False},
            {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        ),
        ({"format": "awq", "group_size": 64, "awq_version": "gemv"}, {"zero_point": False, "version": "gemv"}),
        (
            {"format": "compressed-tensors", "bits": 4, "group_size": 32, "sym": False},
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"]},
        ),
        (
            {"format": "compressed-tensors", "bits": 8, "group_size": -1, "ct_format": "int-quantized"},
            {"format": "int-quantized"},
        ),
    ],
)
def test_written_checkpoint_reads_back(tiny_model_dir, tmp_path, options, config_keys):
    written = write_checkpoint(tiny_model_dir, tmp_path, **options)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config_keys.items() <= config.items()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    tensors, source = load_file(tmp_path / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):  # left dense
        assert torch.equal(tensors[name], source[name])
    assert len(written) == 14  # 7 linears × 2 layers
    fmt = options["format"]
    for name, linear in written.items():
        parts = module_tensors(tensors, name)
        assert f"{name}.weight" not in tensors or tensors[f"{name}.weight"].dtype == torch.int8  # int-quantized
        if fmt == "gptq":
            packed, perm = packed_from_gptq(
                parts["qweight"],
                parts["qzeros"],
                parts["scales"],
                parts["g_idx"],
                bits=config["bits"],
                group_size=config["group_size"],
                sym=config["sym"],
                checkpoint_format=config["checkpoint_format"],
            )
            assert (perm is not None) == config["desc_act"]
        elif fmt == "awq":
            packed, perm = (
                packed_from_awq(
                    parts["qweight"],
                    parts["qzeros"],
                    parts["scales"],
                    bits=config["bits"],
                    group_size=config["group_size"],
                    version=config["version"],
                ),
                None,
            )
        else:
            validate_compressed_tensors_config(config)
            scheme = scheme_for_module(config, name)  # int-quantized is W8A8: served weights-only here
            packed, perm = packed_from_compressed_tensors(parts, scheme, weights_only=True), None
        dense = packed.dequantize() if perm is None else packed.dequantize()[:, torch.argsort(perm)]
        assert torch.equal(dense, linear.dequantize())
        if perm is None:
            assert_same(packed, linear.code.packed())


def test_transformers_loads_the_written_compressed_tensors_checkpoint(tiny_model_dir, tmp_path):
    """transformers' own compressed-tensors path (dequantize=True, on CPU) reads our checkpoint as we do."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    written = write_checkpoint(
        tiny_model_dir,
        tmp_path,
        format="compressed-tensors",
        bits=4,
        group_size=32,
        sym=False,
        scale_dtype=torch.float16,
    )
    with pytest.warns(UserWarning, match="already has a `quantization_config`"):
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
    state = model.state_dict()
    for name, linear in written.items():
        # It computes (q - zp)·s in the fp16 scales' dtype: our exact fp32 value, rounded once.
        assert torch.equal(state[f"{name}.weight"], linear.dequantize().half().float())
    assert torch.equal(state["lm_head.weight"], load_file(tiny_model_dir / "model.safetensors")["lm_head.weight"])
