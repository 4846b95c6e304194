"""Finding a model's files (local folder, hub, GGUF file, the demo) and loading them with transformers.

Every failure a user can cause (no network, wrong id, missing files, unknown architecture) becomes
a `ModelLoadError` with one line that says what to do; the original error is logged at DEBUG.
transformers is imported inside the loading functions: it takes seconds to import, and resolving
a model needs none of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import errors as hub_errors
from huggingface_hub import snapshot_download

from inference_service import progress
from inference_service.config import DEMO_MODEL_ID, ModelConfig, default_cache_dir
from inference_service.errors import ModelLoadError
from inference_service.models import demo, rope
from inference_service.models.qwen_vl_processor import QWEN_VL_FAMILIES, load_qwen_vl_processor
from inference_service.models.smolvlm_processor import SMOLVLM_FAMILIES, load_smolvlm_processor
from inference_service.worker.weights.gguf.convert import conversion_name, convert_gguf, file_sha256, is_converted

logger = logging.getLogger(__name__)

# What a transformers checkpoint needs besides its weights: config, tokenizer, generation defaults.
_HUB_META_PATTERNS = ["*.json", "tokenizer.model", "merges.txt", "vocab.txt", "*.tiktoken", "*.jinja"]
_HUB_SAFETENSORS_PATTERNS = ["*.safetensors"]
_HUB_BIN_PATTERNS = ["pytorch_model*.bin"]
# Files in subfolders (onnx/, original/) and Mistral's duplicate consolidated weights are never loaded.
_HUB_IGNORE_PATTERNS = ["*/*", "consolidated*"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ResolvedModel:
    """A local folder holding a transformers checkpoint, and where it came from.

    `model_sha` is the hub commit for `hub`, the GGUF file's sha256 for `gguf` and `demo`,
    and None for a local folder.
    """

    path: Path
    model_sha: str | None
    source: str  # local | hub | gguf | demo


def resolve_model(config: ModelConfig) -> ResolvedModel:
    """Turn `config.model_id` into a local transformers folder, fetching or converting it once."""
    model_id = config.model_id
    path = Path(model_id).expanduser()
    if path.is_dir():
        return ResolvedModel(path.resolve(), None, "local")
    if path.suffix.lower() == ".gguf":
        return _resolve_gguf(path)
    if model_id == DEMO_MODEL_ID:
        return ResolvedModel(demo.ensure_demo_model(), demo.DEMO_GGUF_SHA256, "demo")
    if _looks_like_path(model_id):
        raise ModelLoadError(f"model folder {model_id!r} does not exist")
    return _resolve_hub(config)


def served_name(config: ModelConfig, resolved: ResolvedModel) -> str:
    """The model's name in the API: --served-model-name, else the model id as given (TGI's), except
    that a GGUF file is named by its file name: its path is this machine's business, not the API's."""
    if config.served_model_name:
        return config.served_model_name
    if resolved.source == "gguf":
        return Path(config.model_id).name
    return config.model_id


def _looks_like_path(model_id: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else was meant as a local path."""
    return os.path.isabs(model_id) or model_id.startswith((".", "~")) or model_id.count("/") > 1


def _resolve_gguf(path: Path) -> ResolvedModel:
    """Convert a GGUF file once into the cache, keyed by the file's sha256."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    cache = Path(default_cache_dir()) / "gguf"
    sha256 = _gguf_sha256(path, cache)
    folder = cache / conversion_name(sha256)
    if not is_converted(folder):
        logger.info("converting %s into %s (once; later starts reuse it)", path, folder)
        convert_gguf(path, folder)
    return ResolvedModel(folder, sha256, "gguf")


def _gguf_sha256(path: Path, cache: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime): hashing a large GGUF takes seconds."""
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    memo = cache / "by-stat" / hashlib.sha256(identity).hexdigest()
    if memo.is_file():
        return memo.read_text(encoding="utf-8").strip()
    sha256 = file_sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(sha256, encoding="utf-8")
    return sha256


def _resolve_hub(config: ModelConfig) -> ResolvedModel:
    """Fetch config, tokenizer and weights (safetensors, else .bin) into the hub cache."""
    try:
        with progress.phase("downloading", f"fetched {config.model_id} from the hub", bar=False):  # the hub's bars
            folder = _snapshot(config, _HUB_SAFETENSORS_PATTERNS)
            if not any(folder.glob("*.safetensors")):
                logger.info("%s has no safetensors weights; fetching pytorch_model*.bin", config.model_id)
                folder = _snapshot(config, _HUB_BIN_PATTERNS)
    except Exception as error:
        logger.debug("hub fetch of %s failed", config.model_id, exc_info=True)
        raise ModelLoadError(_hub_error_message(config, error)) from None
    return ResolvedModel(folder, folder.name, "hub")


def _snapshot(config: ModelConfig, weight_patterns: list[str]) -> Path:
    """One `snapshot_download` of the metadata files plus `weight_patterns`."""
    patterns = _HUB_META_PATTERNS + weight_patterns + (["*.py"] if config.trust_remote_code else [])
    folder = snapshot_download(
        config.model_id,
        revision=config.revision,
        cache_dir=config.huggingface_hub_cache,
        allow_patterns=patterns,
        ignore_patterns=_HUB_IGNORE_PATTERNS,
    )
    return Path(folder)


def _hub_error_message(config: ModelConfig, error: Exception) -> str:
    """One line: what failed, the short reason, what to do."""
    reason, hint = _hub_error_reason(config, error)
    return f"could not fetch {config.model_id!r} from the Hugging Face hub: {reason}; {hint}"


def _hub_error_reason(config: ModelConfig, error: Exception) -> tuple[str, str]:
    """(reason, hint) for the hub errors a user can cause or fix."""
    cache = config.huggingface_hub_cache or hub_constants.HF_HUB_CACHE
    fetch_hint = "fetch it where the hub is reachable, or pass a local folder or .gguf file as the model id"
    causes = _error_chain(error)
    if isinstance(error, hub_errors.IncompleteSnapshotError):
        return f"the cached snapshot in {cache} is incomplete and the hub can't be reached", fetch_hint
    if any(isinstance(cause, hub_errors.OfflineModeIsEnabled) for cause in causes):
        return (
            f"offline mode is on (HF_HUB_OFFLINE) and it is not in the cache {cache}",
            "unset HF_HUB_OFFLINE to download it, or " + fetch_hint,
        )
    if isinstance(error, hub_errors.GatedRepoError):
        return "the repository is gated", "accept its terms on the hub and set HF_TOKEN"
    if isinstance(error, hub_errors.RepositoryNotFoundError):
        return "repository not found", "check the id, or set HF_TOKEN if it is private"
    if isinstance(error, hub_errors.RevisionNotFoundError):
        return f"revision {config.revision!r} not found", "check --revision"
    if isinstance(error, hub_errors.HFValidationError):
        return "not a valid repository id, nor an existing folder or .gguf file", "check the model id"
    if isinstance(error, hub_errors.LocalEntryNotFoundError):
        root = causes[-1]
        return (
            f"the hub at {hub_constants.ENDPOINT} can't be reached ({type(root).__name__}: "
            f"{_first_line(root)}) and it is not in the cache {cache}",
            fetch_hint,
        )
    return f"{type(error).__name__}: {_first_line(error)}", fetch_hint


def _error_chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an error message, capped so a message stays one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_device(name: str) -> torch.device:
    """`auto` = the first CUDA device when there is one, else the CPU; a named CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        _require_cuda_device(device)
    return device


def _require_cuda_device(device: torch.device) -> None:
    """Refuse a CUDA device this machine doesn't have, before any weights are read."""
    if not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(device)!r} was asked for, but CUDA is not available here")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ModelLoadError(f"device {str(device)!r} does not exist: there are {count} CUDA device(s)")


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`auto` = float32 on CPU (no fast bf16 matmul there); on CUDA bfloat16, or float16 without bf16."""
    if name != "auto":
        if name not in _DTYPES:
            raise ModelLoadError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
        return _DTYPES[name]
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    with torch.cuda.device(device):
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def load_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_implementation: str,
    trust_remote_code: bool = False,
    rope_scaling: tuple[str, float] | None = None,
) -> torch.nn.Module:
    """The causal LM (or text-to-text encoder-decoder) in `path`, in eval mode on `device`, never
    reaching out to the hub; `rope_scaling` (models/rope.py) replaces the config's RoPE scaling.

    safetensors win over `.bin` when a folder holds both; `.bin` files are unpickled with
    `weights_only=True`, so a checkpoint can't run code when it is read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    folder = _checkpoint_folder(path, "model", "config.json")
    try:
        config = AutoConfig.from_pretrained(
            os.fspath(folder), trust_remote_code=trust_remote_code, local_files_only=True
        )
        rope.apply_rope_scaling(config, rope_scaling)
        auto_class = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
        attention: str | dict[str, str] = attn_implementation
        if getattr(config, "vision_config", None) is not None:
            # The vision tower attends over whole images with transformers' SDPA; only the language
            # model's attention is ours (paged) or the one asked for.
            auto_class = AutoModelForImageTextToText
            attention = {"text_config": attn_implementation, "vision_config": "sdpa"}
        model = auto_class.from_pretrained(
            os.fspath(folder),
            config=config,
            dtype=dtype,
            attn_implementation=attention,
            trust_remote_code=trust_remote_code,
            weights_only=True,
            local_files_only=True,
        )
    except Exception as error:
        logger.debug("loading the model in %s failed", folder, exc_info=True)
        reason = _load_error_reason(error, folder)
        raise ModelLoadError(f"could not load the model in {folder}: {reason}") from None
    # Loaded on the CPU, then moved: `device_map` would need `accelerate` for a single device.
    return model.to(torch.device(device)).eval()


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    """The fast (Rust) tokenizer in `path`; the detokenizer relies on its offsets and speed."""
    from transformers import AutoTokenizer

    folder = _checkpoint_folder(path, "tokenizer", "tokenizer_config.json", "tokenizer.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            os.fspath(folder), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as error:
        logger.debug("loading the tokenizer in %s failed", folder, exc_info=True)
        reason = _load_error_reason(error, folder)
        raise ModelLoadError(f"could not load the tokenizer in {folder}: {reason}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"the tokenizer in {folder} is not a fast tokenizer (tokenizer.json)")
    return tokenizer


def load_processor(path: str | os.PathLike, trust_remote_code: bool = False, model_type: str | None = None):
    """A vision-language model's processor (images → pixel values and image placeholder tokens)."""
    from transformers import AutoProcessor

    folder = _checkpoint_folder(path, "processor", "processor_config.json", "preprocessor_config.json")
    try:
        if model_type in QWEN_VL_FAMILIES:
            processor = load_qwen_vl_processor(folder, trust_remote_code)
        elif model_type in SMOLVLM_FAMILIES:
            processor = load_smolvlm_processor(folder, trust_remote_code)
        else:
            processor = AutoProcessor.from_pretrained(
                os.fspath(folder), trust_remote_code=trust_remote_code, local_files_only=True
            )
    except Exception as error:
        logger.debug("loading the processor in %s failed", folder, exc_info=True)
        raise ModelLoadError(f"could not load the image processor in {folder}: {_first_line(error)}") from None
    if not hasattr(processor, "image_token") or not hasattr(processor, "tokenizer"):
        raise ModelLoadError(f"the processor in {folder} names no image token: it can't place images in a prompt")
    return processor


def _checkpoint_folder(path: str | os.PathLike, what: str, *expected: str) -> Path:
    """`path` as a folder that holds at least one of the `expected` files, else a clear error."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"could not load the {what}: folder {os.fspath(path)!r} does not exist")
    if not any((folder / name).is_file() for name in expected):
        raise ModelLoadError(f"could not load the {what} in {folder}: it holds no {' or '.join(expected)}")
    return folder


def _model_type(folder: Path) -> str | None:
    """`model_type` from the folder's config.json, when it can be read."""
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _load_error_reason(error: Exception, folder: Path) -> str:
    """A short reason for a transformers loading error, with the fix when there is a known one."""
    text = str(error)
    if "trust_remote_code" in text:
        return "it needs custom code from its repository; pass --trust-remote-code if you trust that code"
    if isinstance(error, pickle.UnpicklingError) or "Weights only load failed" in text:
        return (
            "a .bin weights file holds more than tensors and was refused (read with weights_only=True); "
            "convert it to safetensors"
        )
    if "does not recognize this architecture" in text or "Unrecognized configuration class" in text:
        import transformers

        return (
            f"unsupported architecture {_model_type(folder)!r}: transformers {transformers.__version__} "
            "has no causal-LM class for it"
        )
    return f"{type(error).__name__}: {_first_line(error)}"
