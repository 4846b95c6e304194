"""Reading LoRA adapters in PEFT's format (made here by peft): `--lora-adapters` parsing, the
scale PEFT applies (lora_alpha / r, rsLoRA's lora_alpha / √r), and a clear error naming the
adapter for every way it can be wrong for the base."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference_service.models.lora_files import AdapterError, parse_adapter_specs, read_adapter
from inference_service.models.lora_registry import AdapterRegistry
from inference_service.worker.lora.install import projection_shapes
from inference_service.worker.lora.weights import LoraTable
from tests.lora_adapters import make_adapter
from tests.unit.tiny_models import tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    model = tiny_model("llama")
    model.save_pretrained(folder)
    return folder, projection_shapes(model)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    return make_adapter(base[0], tmp_path_factory.mktemp("lora") / "a", seed=1, rank=4, alpha=12)


def _copy(adapter, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(adapter, target)
    return target


def _edit_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def test_specs_as_tgi_takes_them():
    assert parse_adapter_specs("a=/x/y, b=./z,org/name") == [("a", "/x/y"), ("b", "./z"), ("org/name", "org/name")]
    assert parse_adapter_specs("") == parse_adapter_specs(None) == []
    with pytest.raises(AdapterError, match="names 'a' twice"):
        parse_adapter_specs("a=/x,a=/y")
    with pytest.raises(AdapterError, match="is not `name=path`"):
        parse_adapter_specs("=/x")


@pytest.mark.parametrize("use_rslora", [False, True])
def test_pairs_hold_peft_weights_and_scale(base, tmp_path, use_rslora):
    folder = make_adapter(base[0], tmp_path / "a", seed=2, rank=4, alpha=12, use_rslora=use_rslora)
    weights = read_adapter("a", folder, base[1], 64, CPU)
    scale = 12 / math.sqrt(4) if use_rslora else 12 / 4
    saved = load_file(folder / "adapter_model.safetensors")
    pair = weights.pairs[(1, "v_proj")]
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    torch.testing.assert_close(pair.a, saved[f"{prefix}.lora_A.weight"].t())
    torch.testing.assert_close(pair.b, saved[f"{prefix}.lora_B.weight"].t() * scale)
    assert weights.rank == 4 and len(weights.pairs) == 2 * 7


def _error(base, folder, max_rank=64) -> str:
    with pytest.raises(AdapterError) as caught:
        read_adapter("mine", folder, base[1], max_rank, CPU)
    message = str(caught.value)
    assert message.startswith("LoRA adapter 'mine': ")
    return message


def test_missing_files(base, adapter, tmp_path):
    assert "does not exist" in _error(base, tmp_path / "nowhere")
    folder = _copy(adapter, tmp_path)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    assert "no adapter_model.safetensors" in _error(base, folder) and "only safetensors" in _error(base, folder)
    (folder / "adapter_config.json").unlink()
    assert "no adapter_config.json" in _error(base, folder)


def test_corrupt_files(base, adapter, tmp_path):
    folder = _copy(adapter, tmp_path)
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    assert "not a readable safetensors file" in _error(base, folder)
    (folder / "adapter_config.json").write_text("{r: 4")
    assert "not valid JSON" in _error(base, folder)


def test_rank_over_the_limit(base, adapter):
    assert "rank 4 is more than --max-lora-rank 2" in _error(base, adapter, max_rank=2)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"modules_to_save": ["lm_head", "score"]}, "modules_to_save (lm_head, score) is not supported"),
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
        ({"r": 0}, "rank r=0 is not a positive integer"),
    ],
)
def test_unsupported_options(base, adapter, tmp_path, changes, expected):
    folder = _copy(adapter, tmp_path)
    _edit_config(folder, **changes)
    assert expected in _error(base, folder)


def test_unsupported_targets_are_named(base, tmp_path):
    folder = make_adapter(base[0], tmp_path / "head", seed=3, rank=4, targets=["q_proj", "lm_head", "embed_tokens"])
    message = _error(base, folder)
    assert "targets modules that can't be served: embed_tokens, lm_head" in message


def test_shapes_of_another_base(base, tmp_path):
    other = tmp_path / "wide"
    tiny_model("llama", hidden_size=96, num_attention_heads=4, head_dim=24).save_pretrained(other)
    folder = make_adapter(other, tmp_path / "a", seed=4, rank=4, targets=["q_proj"])
    assert "lora_A [4, 96] and lora_B [96, 4] do not fit the base (expected [4, 64] and [64, 4])" in _error(
        base, folder
    )


def test_mismatched_ranks_and_missing_halves(base, adapter, tmp_path):
    folder = _copy(adapter, tmp_path)
    tensors = load_file(folder / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
    save_file(tensors, folder / "adapter_model.safetensors")
    assert "layers.0.mlp.up_proj has lora_A but not both" in _error(base, folder)


def test_registry_bounds_residency_and_keeps_others(base, adapter, tmp_path):
    table = LoraTable()
    registry = AdapterRegistry(table, base[1], max_loras=2, max_rank=64, device=CPU, base_name="base")
    registry.load("one", str(adapter))
    with pytest.raises(AdapterError, match="already loaded"):
        registry.load("one", str(adapter))
    with pytest.raises(AdapterError, match="does not exist"):
        registry.load("two", str(tmp_path / "missing"))
    registry.load("two", str(adapter))
    with pytest.raises(AdapterError, match="the most --max-loras allows"):
        registry.load("three", str(adapter))
    assert registry.names() == table.names() == ["one", "two"]
    registry.unload("one")
    assert registry.names() == table.names() == ["two"]
    with pytest.raises(AdapterError, match="no LoRA adapter named 'one'"):
        registry.unload("one")
    with pytest.raises(AdapterError, match="base model's name"):
        registry.load("base", str(adapter))
