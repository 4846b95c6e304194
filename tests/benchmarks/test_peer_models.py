"""The llama.cpp peer's benchmark plumbing, without llama.cpp: the random-model writer at a tiny
shape (safetensors and GGUF F32/Q8_0/Q4_1 read back by transformers, gguf and the server's own GGUF
converter) and the build script's arguments and cache paths. Building llama.cpp is benchmark-only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from benchmarks import llama_cpp, peer_models

TINY = peer_models.Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=384, context=1024)


def write_tokenizer_gguf(path: Path, tokenizer) -> Path:
    """A GGUF holding only a GPT-2-style tokenizer, as the demo GGUF holds SmolLM2's."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = set(tokenizer.all_special_tokens)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    merges = backend["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_model_dir, byte_tokenizer):
    """The tiny shape in every format: {"hf": folder, "f32" | "q8_0" | "q4_1": GGUF file}."""
    out = tmp_path_factory.mktemp("peer-model")
    tokenizer_gguf = write_tokenizer_gguf(out / "tokenizer.gguf", byte_tokenizer)
    (out / "hf").mkdir()
    peer_models.write_hf(TINY, out / "hf", tiny_model_dir)
    paths = {"hf": out / "hf"}
    for fmt in ("f32", "q8_0", "q4_1"):
        paths[fmt] = out / f"tiny.{fmt}.gguf"
        peer_models.write_gguf(TINY, "tiny", out / "hf", paths[fmt], fmt, tokenizer_gguf)
    return paths


def test_the_shapes_are_the_sizes_they_are_named_for():
    assert round(peer_models.SHAPES["llama-0.5b"].parameters / 1e9, 2) == 0.49  # Qwen2.5-0.5B: 0.49B
    assert round(peer_models.SHAPES["llama-1.5b"].parameters / 1e9, 2) == 1.54  # Qwen2.5-1.5B: 1.54B
    demo = peer_models.SHAPES["demo"]
    assert round(demo.parameters / 1e6) == 135 and demo.head_dim == 64


def test_safetensors_hold_every_tensor_at_its_shape_and_transformers_loads_them(written):
    from transformers import AutoModelForCausalLM

    folder = written["hf"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    expected = dict(peer_models.hf_tensor_names(TINY))
    assert set(index) == set(expected)
    for name, shape in expected.items():
        with safe_open(str(folder / index[name]), framework="numpy") as handle:
            assert handle.get_tensor(name).shape == shape, name
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == TINY.vocab and model.config.max_position_embeddings == TINY.context
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert sum(p.numel() for p in model.parameters()) == TINY.parameters


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_1"])
def test_gguf_tensors_are_the_safetensors_in_llama_cpp_layout(written, fmt):
    reader = gguf.GGUFReader(written[fmt])
    tensors = {t.name: t for t in reader.tensors}
    names = dict(peer_models.hf_tensor_names(TINY))
    assert set(tensors) == {peer_models.gguf_name(name) for name in names}
    tolerance = {"f32": 0.0, "q8_0": 0.02 * 0.02, "q4_1": 0.1 * 0.1}[fmt]  # of the weights' std 0.02 (and 1 for norms)
    index = json.loads((written["hf"] / "model.safetensors.index.json").read_text())["weight_map"]
    for hf_name, shape in names.items():
        tensor = tensors[peer_models.gguf_name(hf_name)]
        assert tensor.tensor_type == peer_models.gguf_type(fmt, hf_name, len(shape)), hf_name
        with safe_open(str(written["hf"] / index[hf_name]), framework="numpy") as handle:
            weights = handle.get_tensor(hf_name)
        if ".q_proj." in hf_name:
            weights = peer_models.llama_cpp_permute(weights, TINY.heads)
        elif ".k_proj." in hf_name:
            weights = peer_models.llama_cpp_permute(weights, TINY.kv_heads)
        stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        assert np.abs(stored - weights).max() <= tolerance * 4, hf_name
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == TINY.vocab  # padded to the embedding's rows
    assert tokens[-1] == f"[PAD{TINY.vocab - 1}]" and types[-1] == gguf.TokenType.UNUSED


def test_the_servers_gguf_converter_reads_the_f32_file_as_the_safetensors(written, tmp_path):
    """The server and llama.cpp are compared on these files: the converter must see the same model."""
    from transformers import AutoModelForCausalLM

    from inference_service.worker.weights.gguf.convert import convert_gguf

    reference = AutoModelForCausalLM.from_pretrained(written["hf"]).eval()
    converted = AutoModelForCausalLM.from_pretrained(convert_gguf(written["f32"], tmp_path / "converted")).eval()
    ids = torch.tensor([[5, 17, 200, 300, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_llama_cpp_script_arguments_and_cache_paths(tmp_path):
    args = llama_cpp.parse_args(["build", "--jobs", "3", "--cache-dir", str(tmp_path)])
    assert (args.command, args.jobs, args.version) == ("build", 3, llama_cpp.VERSION)
    args = llama_cpp.parse_args(["path", "llama-bench"])
    assert args.name == "llama-bench"
    with pytest.raises(SystemExit):
        llama_cpp.parse_args(["path", "llama-cli"])  # only the two binaries the benchmarks use
    assert not llama_cpp.is_built(cache_dir=tmp_path)
    with pytest.raises(llama_cpp.NotBuilt, match="benchmarks/llama_cpp.py build"):
        llama_cpp.binary("llama-server", cache_dir=tmp_path)
    assert llama_cpp.main(["path", "llama-server", "--cache-dir", str(tmp_path)]) == 1
    binary = llama_cpp.install_dir(cache_dir=tmp_path) / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert llama_cpp.binary("llama-server", cache_dir=tmp_path) == binary


def test_llama_cpp_builds_native_unless_the_cpu_reports_amx():
    assert llama_cpp.isa_options({"avx2", "fma", "avx512f"}) == ("-DGGML_NATIVE=ON",)
    assert llama_cpp.build_tag({"avx2"}) == ""
    sapphire = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
    sapphire |= {"avx512_vnni", "amx_tile", "amx_int8"}
    options = llama_cpp.isa_options(sapphire)
    assert options[0] == "-DGGML_NATIVE=OFF"
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX_VNNI=OFF"} <= set(
        options
    )
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(options)
    assert llama_cpp.build_tag(sapphire) == "-noamx"


def test_peer_bench_arguments():
    from benchmarks import peer_bench

    quick = peer_bench.parse_args(["--quick"])
    assert (quick.models, quick.kv_dtypes, quick.contexts) == (["demo"], ["fp16"], peer_bench.QUICK_CONTEXTS)
    assert quick.sections == ["decode", "batch"] and quick.formats == ["f32", "q4_1"]
    full = peer_bench.parse_args(["--contexts", "4096", "128"])
    assert full.models == ["demo", "llama-1.5b"] and full.contexts == [128, 4096]
    assert full.sections == list(peer_bench.SECTIONS) and full.kv_dtypes == ["fp16", "auto"]
    assert full.decode_rounds == 3 and peer_bench.parse_args(["--decode-rounds", "5"]).decode_rounds == 5
    with pytest.raises(SystemExit):
        peer_bench.parse_args(["--formats", "q4_k"])
    with pytest.raises(SystemExit):
        peer_bench.parse_args(["--decode-rounds", "0"])


def test_a_streams_decode_time_counts_the_tokens_after_the_first_arrival():
    from benchmarks.peer_bench import Stream

    stream = Stream(start=10.0, arrivals=[(10.5, 1), (10.6, 1), (10.8, 2), (11.0, 1)])
    assert stream.tokens == 5 and stream.ttft_s == pytest.approx(0.5)
    assert stream.decode_ms == pytest.approx(1000 * 0.5 / 4)
    assert math.isnan(Stream(start=0.0, arrivals=[(1.0, 1)]).decode_ms)  # one token: no gap to time
    assert math.isnan(Stream(start=0.0).ttft_s)


def test_the_decode_row_is_the_median_round_and_a_failed_round_ranks_last():
    from benchmarks.peer_bench import Stream, median_stream

    def stream(ms: float | None) -> Stream:  # 3 tokens: two gaps of `ms`, or one token (failed: nan)
        if ms is None:
            return Stream(start=0.0, arrivals=[(1.0, 1)], error="cut")
        return Stream(start=0.0, arrivals=[(1.0, 1), (1.0 + ms / 1000, 1), (1.0 + 2 * ms / 1000, 1)])

    rounds = [stream(30.0), stream(10.0), stream(20.0)]
    assert median_stream(rounds).decode_ms == pytest.approx(20.0)
    assert median_stream([stream(None), stream(12.0), stream(14.0)]).decode_ms == pytest.approx(14.0)
    assert median_stream([stream(12.0), stream(14.0)]).decode_ms == pytest.approx(12.0)  # the lower middle
