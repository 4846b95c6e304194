"""Llama-shaped models with random weights at real sizes (~0.5B and ~1.5B parameters), for the
benchmarks that compare the server with llama.cpp where users live, not only on the 135M demo.

The shapes are Qwen2.5-0.5B's and Qwen2.5-1.5B's (width, depth, heads, GQA groups, MLP width,
vocabulary, tied head, rope base, 32k positions) as plain Llama (no q/k/v bias), so both servers run
them on their Llama paths. Weights are random normal (std 0.02; norms 1) from a fixed seed: the
timings depend on shapes and formats, not on values. The tokenizer is the demo model's (SmolLM2,
49,152 tokens; the rest of the 151,936-row vocabulary padded as llama.cpp's converter pads).

Each model is written once, in every format the benchmarks use, and cached:

    <cache>/peer-models/<name>/hf/                  config.json, sharded safetensors, the tokenizer
    <cache>/peer-models/<name>/<name>.F32.gguf      every tensor float32
    <cache>/peer-models/<name>/<name>.Q8_0.gguf     2-D weights Q8_0, norms float32
    <cache>/peer-models/<name>/<name>.Q4_1.gguf     2-D weights Q4_1, the (tied) embedding Q8_0, as
                                                    llama.cpp's quantizer writes a tied Q4_1 model

GGUF files follow llama.cpp's converter (tensor names, q/k rows permuted for its rotary layout),
so llama.cpp and the server's own GGUF loader read the same file.

    python benchmarks/peer_models.py [--models llama-0.5b llama-1.5b] [--formats hf f32 q8_0 q4_1]

Disk: ~2 GB (0.5B) and ~6 GB (1.5B) per float32 copy; a few minutes per model on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_service.config import default_cache_dir  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float = 1_000_000.0
    context: int = 32768
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def parameters(self) -> int:
        """Parameters with the head tied to the embedding (as the shapes' originals are)."""
        kv_width = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv_width
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden + self.layers * layer + self.hidden


SHAPES = {
    "llama-0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    "llama-1.5b": Shape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936),
    # The demo model (SmolLM2-135M) itself, its weights as served, stating 32k positions (it is
    # trained for 8k) so that the benchmarks' 16k contexts run on it as on the others.
    "demo": Shape(
        hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152, rope_theta=1e5, rms_eps=1e-5
    ),
}
FORMATS = ("hf", "f32", "q8_0", "q4_1")
GGUF_TYPES = {"f32": "F32", "q8_0": "Q8_0", "q4_1": "Q4_1"}
SHARD_BYTES = 2 << 30
SEED = 0
# Quantize at most this many weights at once: numpy's quantizer makes several copies of its input.
QUANTIZE_CHUNK_ELEMENTS = 1 << 24


def model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "peer-models" / name


def path_of(name: str, fmt: str, cache_dir: str | Path | None = None) -> Path:
    """Where format `fmt` of model `name` lives (the folder for `hf`, the file for a GGUF type)."""
    folder = model_dir(name, cache_dir)
    return folder / "hf" if fmt == "hf" else folder / f"{name}.{GGUF_TYPES[fmt]}.gguf"


def hf_tensor_names(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The transformers Llama's tensors (tied head: no lm_head) and their shapes, in file order."""
    kv_width = shape.kv_heads * shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab, shape.hidden)
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", (shape.hidden,)
        yield f"{prefix}.self_attn.q_proj.weight", (shape.hidden, shape.hidden)
        yield f"{prefix}.self_attn.k_proj.weight", (kv_width, shape.hidden)
        yield f"{prefix}.self_attn.v_proj.weight", (kv_width, shape.hidden)
        yield f"{prefix}.self_attn.o_proj.weight", (shape.hidden, shape.hidden)
        yield f"{prefix}.post_attention_layernorm.weight", (shape.hidden,)
        yield f"{prefix}.mlp.gate_proj.weight", (shape.intermediate, shape.hidden)
        yield f"{prefix}.mlp.up_proj.weight", (shape.intermediate, shape.hidden)
        yield f"{prefix}.mlp.down_proj.weight", (shape.hidden, shape.intermediate)
    yield "model.norm.weight", (shape.hidden,)


GGUF_NAMES = {
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


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a transformers Llama tensor."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the two rotary halves interleaved)."""
    halves = weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
    return halves.swapaxes(1, 2).reshape(weights.shape)


def random_tensor(index: int, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) == 1:  # norms
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([SEED, index])
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)


# -- the transformers folder ----------------------------------------------------------------------
def hf_config(shape: Shape, tokenizer_config: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.context,
        "rms_norm_eps": shape.rms_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_theta": shape.rope_theta, "rope_type": "default"},
        "vocab_size": shape.vocab,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": tokenizer_config.get("bos_token_id", 1),
        "eos_token_id": tokenizer_config.get("eos_token_id", 2),
    }


def write_hf(shape: Shape, folder: Path, tokenizer_dir: Path) -> None:
    """config.json, random weights in safetensors shards (with their index), the demo's tokenizer."""
    from safetensors.numpy import save_file

    demo_config = json.loads((tokenizer_dir / "config.json").read_text())
    weight_map: dict[str, str] = {}
    shards: list[dict[str, np.ndarray]] = [{}]
    names = list(hf_tensor_names(shape))
    for index, (name, tensor_shape) in enumerate(names):
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) >= SHARD_BYTES:
            _save_shard(shards, len(shards), folder, weight_map, save_file)
            shards.append({})
        shards[-1][name] = random_tensor(index, tensor_shape)
    _save_shard(shards, len(shards), folder, weight_map, save_file)
    total = sum(int(np.prod(s)) * 4 for _, s in names)
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
    (folder / "config.json").write_text(json.dumps(hf_config(shape, demo_config), indent=2))
    copy_tokenizer_files(tokenizer_dir, folder)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_tokenizer_files(source: Path, folder: Path) -> None:
    for file_name in (*TOKENIZER_FILES, "generation_config.json"):
        if (source / file_name).exists():
            shutil.copy(source / file_name, folder / file_name)


def write_demo_hf(shape: Shape, folder: Path, demo_dir: Path) -> None:
    """The demo's own weights (linked, not copied), its config stating `shape.context` positions."""
    from safetensors import safe_open

    config = json.loads((demo_dir / "config.json").read_text())
    expected = hf_config(shape, config)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if config[key] != expected[key]:
            raise ValueError(f"the demo model's {key} is {config[key]}, the demo shape says {expected[key]}")
    config["max_position_embeddings"] = shape.context
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = demo_dir / "model.safetensors"
    try:
        os.link(weights, folder / weights.name)
    except OSError:
        shutil.copy(weights, folder / weights.name)
    with safe_open(str(weights), framework="numpy") as handle:
        weight_map = dict.fromkeys(handle.keys(), weights.name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    copy_tokenizer_files(demo_dir, folder)


def _save_shard(shards: list[dict], number: int, folder: Path, weight_map: dict[str, str], save_file) -> None:
    file_name = f"model-{number:05d}.safetensors"
    save_file(shards[-1], str(folder / file_name), metadata={"format": "pt"})
    os.chmod(folder / file_name, 0o644)  # shared like the rest of the cache
    weight_map.update(dict.fromkeys(shards[-1], file_name))
    shards[-1].clear()


# -- GGUF -----------------------------------------------------------------------------------------
def gguf_type(fmt: str, hf_name: str, ndim: int):
    """A tensor's GGML type in format `fmt`: norms stay float32; a tied Q4_1 embedding is Q8_0."""
    from gguf import GGMLQuantizationType as T

    if fmt == "f32" or ndim == 1:
        return T.F32
    if fmt == "q4_1" and hf_name == "model.embed_tokens.weight":
        return T.Q8_0
    return T[GGUF_TYPES[fmt]]


def gguf_tensor(hf_name: str, weights: np.ndarray, shape: Shape, fmt: str) -> np.ndarray:
    """The tensor as llama.cpp stores it: q/k permuted, quantized to its type (raw bytes)."""
    import gguf

    if ".q_proj." in hf_name:
        weights = llama_cpp_permute(weights, shape.heads)
    elif ".k_proj." in hf_name:
        weights = llama_cpp_permute(weights, shape.kv_heads)
    qtype = gguf_type(fmt, hf_name, weights.ndim)
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(weights, dtype=np.float32)
    rows = max(1, QUANTIZE_CHUNK_ELEMENTS // weights.shape[1])  # blocks run along rows: chunks join
    chunks = [
        gguf.quants.quantize(np.ascontiguousarray(weights[i : i + rows]), qtype) for i in range(0, len(weights), rows)
    ]
    return np.concatenate(chunks)


def write_gguf(shape: Shape, name: str, hf_folder: Path, path: Path, fmt: str, tokenizer_gguf: Path) -> None:
    """The transformers folder's weights as a llama-architecture GGUF of type `fmt`, one tensor in
    memory at a time (the 1.5B model is 6 GB in float32)."""
    import gguf
    from safetensors import safe_open

    index = json.loads((hf_folder / "model.safetensors.index.json").read_text())["weight_map"]
    names = list(hf_tensor_names(shape))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"{name} (random weights)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.vocab)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types.get(fmt, gguf.LlamaFileType.MOSTLY_Q4_1))
    if fmt != "f32":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy_tokenizer(writer, tokenizer_gguf, shape.vocab)
    for hf_name, tensor_shape in names:
        qtype = gguf_type(fmt, hf_name, len(tensor_shape))
        if qtype == gguf.GGMLQuantizationType.F32:
            nbytes = int(np.prod(tensor_shape)) * 4
            writer.add_tensor_info(gguf_name(hf_name), tensor_shape, np.dtype(np.float32), nbytes)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(tensor_shape, qtype)
            writer.add_tensor_info(gguf_name(hf_name), byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    handles: dict[str, object] = {}
    for hf_name, _ in names:
        file_name = index[hf_name]
        if file_name not in handles:
            handles[file_name] = safe_open(str(hf_folder / file_name), framework="numpy")
        writer.write_tensor_data(gguf_tensor(hf_name, handles[file_name].get_tensor(hf_name), shape, fmt))
    writer.close()


def copy_tokenizer(writer, tokenizer_gguf: Path, vocab: int) -> None:
    """The demo GGUF's tokenizer fields, its token list padded to `vocab` with unused `[PAD<i>]`
    tokens, as llama.cpp's converter pads a vocabulary smaller than the embedding."""
    import gguf

    for key, value, value_type, sub_type in tokenizer_fields(str(tokenizer_gguf)):
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        writer.add_key_value(key, value, value_type, sub_type)


@functools.cache
def tokenizer_fields(path: str) -> list[tuple]:
    """(key, value, type, item type) of a GGUF file's tokenizer fields, read once (a slow read)."""
    import gguf

    fields = []
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub_type))
    return fields


# -- making them ----------------------------------------------------------------------------------
def ensure(name: str, formats=FORMATS, cache_dir: str | Path | None = None, log=print) -> dict[str, Path]:
    """Model `name` in `formats` (`hf` always, the GGUF files are written from it), written on first
    use; returns each format's path. Each file is renamed into place only once complete."""
    from inference_service.models import demo

    shape = SHAPES[name]
    folder = model_dir(name, cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    hf_folder = path_of(name, "hf", cache_dir)
    if not (hf_folder / "config.json").exists():
        log(f"{name}: writing {shape.parameters / 1e9:.2f}B parameters as safetensors")
        with tempfile.TemporaryDirectory(prefix=".hf-", dir=folder) as scratch:
            write = write_demo_hf if name == "demo" else write_hf
            write(shape, Path(scratch), demo.ensure_demo_model(progress=False))
            os.chmod(scratch, 0o755)
            if hf_folder.exists():
                shutil.rmtree(hf_folder)
            os.replace(scratch, hf_folder)
    paths = {"hf": hf_folder}
    for fmt in formats:
        if fmt == "hf":
            continue
        path = path_of(name, fmt, cache_dir)
        if not path.exists():
            log(f"{name}: writing {path.name}")
            partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
            try:
                write_gguf(shape, name, hf_folder, partial, fmt, demo.ensure_demo_gguf(progress=False))
                os.replace(partial, path)
            finally:
                partial.unlink(missing_ok=True)
        paths[fmt] = path
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=["llama-0.5b", "llama-1.5b"])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--cache-dir", help="cache folder (default: the project's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in args.models:
        for fmt, path in ensure(name, args.formats, args.cache_dir).items():
            print(f"{name} {fmt}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
