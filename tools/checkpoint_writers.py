"""Write GPTQ, AWQ and compressed-tensors checkpoints from a full-precision transformers folder, offline.

    python -m tools.checkpoint_writers --format gptq --bits 4 --group-size 128 SRC DST

Every `nn.Linear` inside the decoder layers (a module path with a layer index; embeddings and
lm_head stay dense, as the real tools leave them) is quantized round-to-nearest and written in the
format's real on-disk layout (tensor names, dtypes, shapes) with `config.json`'s
`quantization_config` as the real tools write it; the other tensors and the tokenizer files are
copied. Round-to-nearest, not GPTQ/AWQ's calibrated search: these checkpoints test loading, they
are not meant to be good models.

Library choice: no maintained GPTQ/AWQ writer runs here (GPTQModel would replace our torch; see
`inference_service/worker/weights/gptq.py`), and compressed-tensors, though it installs, is only a dev
dependency, so the packing is ours, from the same sources the readers cite:
- GPTQ: GPTQModel `gptqmodel/nn_modules/qlinear/__init__.py` (`pack_block`: qweight/qzeros/scales/
  g_idx), `gptqmodel/utils/model.py` (`convert_gptq_v2_to_v1_format_module`: v1 stores zeros − 1 as a
  whole-word subtraction), `gptqmodel/quantization/config.py` (`to_dict`: the config keys);
  `desc_act` draws a random act-order permutation and writes its g_idx.
- AWQ: AutoAWQ `awq/modules/linear/gemm.py` / `gemv.py` (`from_linear`), `awq/models/_config.py`
  (`to_transformers_dict`).
- compressed-tensors: `compressed_tensors/compressors/pack_quantized/base.py` and `helpers.py`
  (`pack_to_int32`), `compressors/naive_quantized/base.py`, `compressors/model_compressors/
  model_compressor.py` (`update_config`); the tests check the result with the library itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from inference_service.worker.kernels.packed import PackedWeight, pack_codes, quantize_rtn
from inference_service.worker.weights.gptq import AWQ_ORDER
from inference_service.worker.weights.int32_words import add_words, pack_words

logger = logging.getLogger(__name__)

FORMATS = ("gptq", "awq", "compressed-tensors")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# The compressed-tensors release whose layout and config keys these checkpoints follow.
COMPRESSED_TENSORS_VERSION = "0.20.0"
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|.*\.safetensors\.index\.json$|^config\.json$")


@dataclass
class IntegerCode:
    """`w ≈ scales[n, g] · (codes[n, k] − zeros[n, g])`, `g = k // group_size`: what every format stores."""

    codes: Tensor  # uint8 [N, K], 0 .. 2**bits - 1
    zeros: Tensor  # uint8 [N, G]
    scales: Tensor  # [N, G] in the checkpoint's scale dtype
    bits: int
    group_size: int

    def packed(self) -> PackedWeight:
        """The canonical form; the readers must return exactly this."""
        scales = self.scales.float()
        return PackedWeight(
            bits=self.bits,
            codes=pack_codes(self.codes, self.bits),
            scales=scales,
            offsets=-(self.zeros.float() * scales),
            group_size=self.group_size,
            in_features=self.codes.shape[1],
        )


@dataclass
class WrittenLinear:
    """What the writer stored for one linear: its code, and the act-order input order it used."""

    code: IntegerCode  # over the inputs in `perm`'s order when perm is set
    perm: Tensor | None  # int64 [K]: column j of `code` is input perm[j]

    def dequantize(self) -> Tensor:
        """fp32 [N, K] in the original input order: the weight a correct reader serves."""
        weight = self.code.packed().dequantize()
        if self.perm is None:
            return weight
        original = torch.empty_like(weight)
        original[:, self.perm] = weight
        return original


def quantize_integer(
    weight: Tensor, bits: int, group_size: int, sym: bool, scale_dtype: torch.dtype = torch.float16
) -> IntegerCode:
    """Round-to-nearest on the grid a checkpoint can hold: `quantize_rtn`'s group scales rounded to
    `scale_dtype`, integer zeros (symmetric: 2**(bits-1), GPTQ's sym), codes recomputed against them.

    Symmetric with fp32 scales this *is* `quantize_rtn(weight, bits, group_size, True)`; otherwise
    it only differs where the stored grid must (fp16 scales, integer zero points)."""
    weight = weight.float()
    n, k = weight.shape
    group_size = k if group_size == -1 else group_size
    rtn = quantize_rtn(weight, bits, group_size, symmetric=sym)
    scales = rtn.scales.to(scale_dtype)
    scales = torch.where(scales == 0, torch.finfo(scale_dtype).tiny, scales)  # fp16 underflow
    s32 = scales.float()  # [N, G]
    top = 2**bits - 1
    # GPTQ's zero points: the centre (sym), or round(-min / scale) (asym).
    zeros = torch.full_like(s32, 2 ** (bits - 1)) if sym else torch.round(-rtn.offsets / s32).clamp(0, top)
    offsets = -(zeros * s32)
    groups = s32.shape[1]
    grouped = torch.nn.functional.pad(weight, (0, groups * group_size - k)).view(n, groups, group_size)
    codes = torch.round((grouped - offsets[..., None]) / s32[..., None]).clamp(0, top)  # as quantize_rtn
    codes = codes.view(n, groups * group_size)[:, :k].to(torch.uint8)
    return IntegerCode(codes=codes, zeros=zeros.to(torch.uint8), scales=scales, bits=bits, group_size=group_size)


# -- one linear's tensors per format ----------------------------------------------------------------
def gptq_tensors(code: IntegerCode, g_idx: Tensor, checkpoint_format: str = "gptq") -> dict[str, Tensor]:
    """qweight int32 [ceil(K·bits/32), N], qzeros int32 [G, ceil(N·bits/32)], scales [G, N], g_idx int32 [K].

    `code`'s columns are in the original input order here; `g_idx[k]` is input k's group."""
    qweight = pack_words(code.codes, code.bits).T.contiguous()  # packed along K, then [K/pf, N]
    qzeros = pack_words(code.zeros.T, code.bits)  # [G, N] packed along N
    if checkpoint_format == "gptq":  # v1: zero − 1, subtracted from the whole word as GPTQModel does
        qzeros = add_words(qzeros, -sum(1 << shift for shift in range(0, 32, code.bits)))
    elif checkpoint_format != "gptq_v2":
        raise ValueError(f"checkpoint_format {checkpoint_format!r}: gptq or gptq_v2")
    return {
        "qweight": qweight,
        "qzeros": qzeros.contiguous(),
        "scales": code.scales.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def awq_tensors(code: IntegerCode, version: str = "gemm") -> dict[str, Tensor]:
    """GEMM: qweight int32 [K, N/8] and qzeros [G, N/8] in AWQ's nibble order, scales [G, N].
    GEMV: qweight [N, K/8], qzeros [N, Z] and scales [N, 8·Z] padded as AutoAWQ's `calculate_zeros_width`."""
    if code.bits != 4:
        raise ValueError("AWQ checkpoints are 4-bit")
    n, k = code.codes.shape
    if n % 8:
        raise ValueError(f"AWQ packs 8 output features per word; {n} is not a multiple of 8")
    if version == "gemm":
        interleave = list(AWQ_ORDER)

        def pack_columns(codes: Tensor) -> Tensor:  # [R, N] → [R, N/8], nibble i = column AWQ_ORDER[i]
            return pack_words(codes.view(codes.shape[0], -1, 8)[..., interleave].flatten(1), 4)

        return {
            "qweight": pack_columns(code.codes.T),
            "qzeros": pack_columns(code.zeros.T),
            "scales": code.scales.T.contiguous(),
        }
    if version == "gemv":
        if k % code.group_size or k % 8:
            raise ValueError("AWQ GEMV needs K divisible by 8 and by the group size")
        groups = code.zeros.shape[1]
        multiple = {32: 4, 64: 2}.get(code.group_size, 1)  # AutoAWQ's calculate_zeros_width
        words = -(-groups // 8)
        width = -(-words // multiple) * multiple
        zeros = torch.nn.functional.pad(code.zeros, (0, width * 8 - groups))
        scales = torch.nn.functional.pad(code.scales, (0, width * 8 - groups))
        return {
            "qweight": pack_words(code.codes, 4),
            "qzeros": pack_words(zeros, 4)[:, :width].contiguous(),
            "scales": scales.contiguous(),
        }
    raise ValueError(f"AWQ version {version!r}: gemm or gemv")


def compressed_tensors_tensors(code: IntegerCode, sym: bool, fmt: str = "pack-quantized") -> dict[str, Tensor]:
    """pack-quantized: weight_packed int32 [N, ceil(K·bits/32)] (q + 2**(bits-1) along K), weight_scale
    [N, G], weight_zero_point int32 [ceil(N·bits/32), G] if asymmetric, weight_shape int64 [2].
    int-/naive-quantized: weight int8 [N, K] (q), weight_scale, weight_zero_point int8 [N, G]."""
    centre = 2 ** (code.bits - 1)
    tensors = {"weight_scale": code.scales.contiguous()}
    if fmt == "pack-quantized":
        tensors["weight_packed"] = pack_words(code.codes, code.bits)
        tensors["weight_shape"] = torch.tensor(code.codes.shape, dtype=torch.int64)
        if not sym:
            tensors["weight_zero_point"] = pack_words(code.zeros.T, code.bits).T.contiguous()
    elif fmt in ("int-quantized", "naive-quantized"):
        tensors["weight"] = (code.codes.to(torch.int16) - centre).to(torch.int8)
        if not sym:
            tensors["weight_zero_point"] = (code.zeros.to(torch.int16) - centre).to(torch.int8)
    else:
        raise ValueError(f"compressed-tensors format {fmt!r}: one of {', '.join(CT_FORMATS)}")
    return tensors


# -- quantization_config as the tools write it ------------------------------------------------------
def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, checkpoint_format: str) -> dict:
    """GPTQModel's `QuantizeConfig.to_dict()` keys (the `meta` block names this writer, not GPTQModel)."""
    return {
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "lm_head": False,
        "method": "gptq",
        "quant_method": "gptq",
        "format": checkpoint_format,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "meta": {"quantizer": ["tools.checkpoint_writers"], "rounding": "rtn"},
    }


def awq_config(group_size: int, sym: bool, version: str, modules_to_not_convert: list[str] | None) -> dict:
    """AutoAWQ's `AwqConfig.to_transformers_dict()`."""
    return {
        "quant_method": "awq",
        "zero_point": not sym,
        "group_size": group_size,
        "bits": 4,
        "version": version,
        "modules_to_not_convert": modules_to_not_convert,
    }


def compressed_tensors_config(bits: int, group_size: int, sym: bool, fmt: str, ignore: list[str]) -> dict:
    """compressed-tensors' `ModelCompressor.update_config` output for one config group over `Linear`."""
    strategy = "channel" if group_size == -1 else "group"
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": sym,
        "strategy": strategy,
        "dynamic": False,
        "group_size": None if group_size == -1 else group_size,
    }
    # int-quantized is llm-compressor's W8A8 format: its activations are quantized per token, dynamically.
    activations = (
        {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "token", "dynamic": True}
        if fmt == "int-quantized"
        else None
    )
    return {
        "version": COMPRESSED_TENSORS_VERSION,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
                "format": fmt,
            }
        },
        "kv_cache_scheme": None,
        "format": fmt,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ignore,
        "moe_sparsity_config": None,
    }


# -- the checkpoint ---------------------------------------------------------------------------------
def decoder_linear_names(src: str | Path) -> tuple[list[str], list[str]]:
    """(linears inside indexed layers, other linears) of the model `src`'s config builds (on meta)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    inside, outside = [], []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            (inside if any(part.isdigit() for part in name.split(".")) else outside).append(name)
    return inside, outside


def write_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    format: str,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
    awq_version: str = "gemm",
    ct_format: str = "pack-quantized",
    scale_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> dict[str, WrittenLinear]:
    """Quantize `src`'s decoder-layer linears into a `format` checkpoint at `dst`; what was written, by module.

    scale_dtype: fp16 for GPTQ/AWQ (what their tools store), the weight's own dtype for
    compressed-tensors (as llm-compressor stores it). desc_act (GPTQ only): a seeded random
    act-order permutation per linear, written as g_idx."""
    if format not in FORMATS:
        raise ValueError(f"format {format!r}: one of {', '.join(FORMATS)}")
    if desc_act and format != "gptq":
        raise ValueError("desc_act (act-order g_idx) is a GPTQ option")
    if format == "awq" and bits != 4:
        raise ValueError("AWQ checkpoints are 4-bit")
    if format == "compressed-tensors" and ct_format == "int-quantized" and bits != 8:
        raise ValueError("int-quantized (W8A8) checkpoints are 8-bit")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _read_tensors(src)
    inside, outside = decoder_linear_names(src)
    generator = torch.Generator().manual_seed(seed)
    written: dict[str, WrittenLinear] = {}
    for name in inside:
        weight = tensors.pop(f"{name}.weight", None)
        if weight is None:
            logger.warning("%s.weight is not in the checkpoint under that name; left as it is", name)
            continue
        dtype = scale_dtype or (weight.dtype if format == "compressed-tensors" else torch.float16)
        perm = torch.randperm(weight.shape[1], generator=generator) if desc_act else None
        code = quantize_integer(weight if perm is None else weight[:, perm], bits, group_size, sym, dtype)
        written[name] = WrittenLinear(code=code, perm=perm)
        if format == "gptq":
            g_idx = torch.arange(weight.shape[1]) // code.group_size
            original = code
            if perm is not None:  # the checkpoint keeps the inputs' order; g_idx says each input's group
                g_idx = torch.empty_like(g_idx).index_put_((perm,), g_idx)
                codes = torch.empty_like(code.codes)
                codes[:, perm] = code.codes
                original = IntegerCode(codes, code.zeros, code.scales, code.bits, code.group_size)
            parts = gptq_tensors(original, g_idx, checkpoint_format)
        elif format == "awq":
            parts = awq_tensors(code, awq_version)
        else:
            parts = compressed_tensors_tensors(code, sym, ct_format)
        if format in ("gptq", "awq") and f"{name}.bias" in tensors:  # both tools store the bias with the scales
            tensors[f"{name}.bias"] = tensors[f"{name}.bias"].to(dtype)
        tensors.update({f"{name}.{key}": value for key, value in parts.items()})

    save_file(
        {key: value.contiguous() for key, value in tensors.items()},
        dst / "model.safetensors",
        metadata={"format": "pt"},
    )
    if format == "gptq":
        quantization_config = gptq_config(bits, group_size, sym, desc_act, checkpoint_format)
        (dst / "quantize_config.json").write_text(json.dumps(quantization_config, indent=2) + "\n")
    elif format == "awq":
        skipped = [name for name in outside if name != "lm_head"]
        quantization_config = awq_config(group_size, sym, awq_version, skipped or None)
    else:
        quantization_config = compressed_tensors_config(bits, group_size, sym, ct_format, outside)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in src.iterdir():  # tokenizer, generation config, chat template, ...
        if path.is_file() and not _WEIGHT_FILES.match(path.name):
            shutil.copy2(path, dst / path.name)
    return written


def _read_tensors(src: Path) -> dict[str, Tensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no .safetensors weights")
    tensors: dict[str, Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118 (not a dict)
    return tensors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a full-precision transformers folder (safetensors)")
    parser.add_argument("dst", help="the folder to write")
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=128, help="-1: one group per row")
    parser.add_argument("--asym", action="store_true", help="asymmetric (zero points) instead of symmetric")
    parser.add_argument("--desc-act", action="store_true", help="GPTQ: a random act-order g_idx")
    parser.add_argument("--checkpoint-format", choices=("gptq", "gptq_v2"), default="gptq")
    parser.add_argument("--awq-version", choices=("gemm", "gemv"), default="gemm")
    parser.add_argument("--ct-format", choices=CT_FORMATS, default="pack-quantized")
    parser.add_argument("--scale-dtype", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    written = write_checkpoint(
        args.src,
        args.dst,
        format=args.format,
        bits=args.bits,
        group_size=args.group_size,
        sym=not args.asym,
        desc_act=args.desc_act,
        checkpoint_format=args.checkpoint_format,
        awq_version=args.awq_version,
        ct_format=args.ct_format,
        scale_dtype=getattr(torch, args.scale_dtype) if args.scale_dtype else None,
        seed=args.seed,
    )
    logger.info("wrote %d quantized linears (%s) to %s", len(written), args.format, args.dst)


if __name__ == "__main__":
    main()
