"""Steps of Llama-style models without transformers' per-layer machinery: every decode-only step,
and on CPU the prompt steps too.

Once the weights are 4- or 8-bit, a decode step is bound by per-layer overhead, not by reading
weights: transformers' decoder layer (module calls, hooks, kwargs, views, the attention
interface, a dozen small ops) costs about 350 µs per layer of the demo model on this CPU, against
about 200 µs of matmuls. For the families whose layer is Llama's (RMSNorm, rotary attention with
optional Q/K biases and Qwen3's per-head Q/K norms, a gated SiLU MLP), ModelRunner runs decode-only
steps through this plan instead. It is the same math in fewer calls:
- q, k and v run as one projection, and gate and up as one, over weights concatenated once at
  load; the layers' own modules are re-pointed at row slices of the concatenation, so nothing is
  stored twice and prefill steps (through transformers) read the same memory;
- on CPU in fp32 the ops between projections are native (kernels.bindings.DecodeGlue: residual add +
  RMSNorm, Q/K norm + rotary + KV write, SiLU·mul), one call each, and in bf16 too
  (kernels.bf16_glue, rounding where transformers' bf16 ops round); elsewhere they are the torch ops
  transformers runs, in its order, and the logits are bitwise those of the transformers path.
On CPU a decode-only step runs all its layers in one native call where it can (runner/
fused_layers.py in fp32 and over packed codes, LoRA updates included; runner/bf16_layers.py in bf16):
the same kernels in the same order, without the Python between them.
On CPU, steps holding prompt chunks (prefill, and prefill beside decodes) run through the same
plan: the chunks attend through the paged functions transformers' path calls (attention/paged.py's
attend_mixed), and a vision-language model's merged image embeddings stand in for the ids'. What it
saves is transformers' per-layer overhead again: its rotary and RMSNorm ops over every row, which
cost a prompt step as much as its attention (and the small chunks that ride beside streams, most of
theirs). Steps with multimodal rotary positions or tokens attending both ways keep transformers' path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from inference_service.worker import step_yield
from inference_service.worker.attention.kv_cache import PagedKVCache
from inference_service.worker.attention.paged import attend_decode, attend_mixed
from inference_service.worker.attention.step_metadata import StepMetadata
from inference_service.worker.kernels.bf16_glue import BF16DecodeGlue
from inference_service.worker.kernels.bindings import DecodeGlue
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.lora.batch import current_step
from inference_service.worker.lora.decode import DOWN, GATE_UP, O_PROJ, QKV, DecodeLora, StepAdder
from inference_service.worker.runner.bf16_layers import FusedBF16Layers, fused_bf16_layers_for
from inference_service.worker.runner.fused_layers import FusedLayers, fused_layers_for
from inference_service.worker.runner.fused_projections import fuse_projections

logger = logging.getLogger(__name__)

# Model types whose decoder layer is Llama's, up to what `_Layer` reads from the modules.
LLAMA_STYLE = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class DecodeStep:
    """`forward(meta, input_ids, position_ids, keep_rows)` for a decode-only step → fp32 logits [K, V]."""

    def __init__(self, model: Any, glue: DecodeGlue | BF16DecodeGlue | None = None):
        # model: a transformers PreTrainedModel, whose attributes torch types as tensors
        body, config = _text_model(model)
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.final_norm = _Norm(body.norm)
        self.lm_head: torch.nn.Module = model.lm_head
        if isinstance(self.lm_head, QuantLinear):  # no fused layer's: few rows may take its own kernel
            self.lm_head.use_few_row_panels()
        window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        self.layers = [_Layer(layer, window) for layer in body.layers]
        self.ops = _NativeOps(glue) if glue is not None else _TorchOps()
        # On CPU: every layer in one native call where the step allows (runner/bf16_layers.py in bf16,
        # runner/fused_layers.py in fp32, LoRA updates included)
        self.fused: FusedBF16Layers | FusedLayers | None = None
        if isinstance(glue, BF16DecodeGlue):
            self.fused = fused_bf16_layers_for(self.layers)
        elif glue is not None and glue.cache_dtype == torch.float32:
            self.fused = fused_layers_for(self.layers)
        # LoRA adapters enabled (lora/install.py): a step with adapter rows adds their updates after
        # each projection; a step without runs exactly as without adapters
        self.lora: DecodeLora | None = None

    def __str__(self) -> str:
        """How decode steps run, for the startup log."""
        if self.fused is not None:
            kind = "bf16" if isinstance(self.fused, FusedBF16Layers) else "fp32"
            return f"fused projections, all layers in one native {kind} call"
        return f"fused projections, {'native' if isinstance(self.ops, _NativeOps) else 'torch'} ops between them"

    def takes(self, meta: StepMetadata, position_ids: torch.Tensor) -> bool:
        """Whether this plan runs the step: every decode-only step, and on CPU a step with prompt
        chunks too (causal ones, one position per token), their attention through the paged
        functions transformers' path calls."""
        if meta.decode_only:
            return True
        return (
            meta.slot_mapping.device.type == "cpu"
            and position_ids.dim() == 2
            and not any(chunk.both_way_spans for chunk in meta.prefills)
        )

    def forward(
        self,
        meta: StepMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep_rows: list[int],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, position_ids [1, S] → logits of `keep_rows` [K, V]; `inputs_embeds` [1, S, D]
        (a vision-language model's images merged in) replaces the ids' embeddings."""
        hidden = self.embed(input_ids[0]) if inputs_embeds is None else inputs_embeds[0]  # [S, D]
        cos, sin = self.rotary(hidden, position_ids)  # [1, S, Dh]
        step = current_step() if self.lora is not None else None
        fused = self.fused if self.fused is not None and meta.decode_only and self.fused.takes(meta, hidden) else None
        if step is not None:
            assert self.lora is not None
            adder = self.lora.adder(step, hidden)
            if isinstance(fused, FusedLayers) and fused.takes_lora(adder):
                hidden = fused.run(meta, hidden, cos[0], sin[0], adder)
            else:
                hidden = self._layers(meta, hidden, cos[0], sin[0], adder)
        elif fused is not None:
            hidden = fused.run(meta, hidden, cos[0], sin[0])
        else:
            hidden = self._layers(meta, hidden, cos[0], sin[0])
        if len(keep_rows) != hidden.shape[0]:
            hidden = hidden[keep_rows]
        _, normed = self.ops.add_norm(hidden, None, self.final_norm)  # native where the layers' ops are
        return self.lm_head(normed).float()

    def _layers(
        self,
        meta: StepMetadata,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: StepAdder | None = None,
    ) -> torch.Tensor:
        """The layers op by op: hidden [S, D] → the residual stream after the last one (with `lora`,
        each projection's output gets the step's LoRA updates)."""
        ops = self.ops
        delta = None  # the last sublayer's output, not yet added to `hidden`
        for number, layer in enumerate(self.layers):
            rows, heads, kv_heads = hidden.shape[0], layer.num_heads, layer.num_kv_heads
            hidden, normed = ops.add_norm(hidden, delta, layer.input_norm)
            qkv = layer.qkv(normed) if lora is None else lora.project(layer.qkv, normed, number, QKV)
            qkv = qkv.view(rows, heads + 2 * kv_heads, layer.head_dim)
            if meta.kv_cache is None:
                raise ValueError("a decode step needs the paged KV cache in its metadata")
            if not meta.decode_only:  # where transformers' path polls: a lone prefill may give way
                step_yield.poll(number, len(self.layers))
            q, k, v = ops.rope_kv_write(qkv, cos, sin, layer, meta.kv_cache, meta.slot_mapping)
            if meta.decode_only:
                key_cache, value_cache = meta.kv_cache.layer(layer.index)
                scales = meta.kv_cache.scales(layer.index)
                attended = attend_decode(
                    meta, q.transpose(0, 1), key_cache, value_cache, layer.scaling, layer.window, None, scales
                )  # [S, H, Dv]
            else:  # prompt chunks: a chunk that starts its sequence over its new K/V as computed
                k, v = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))  # [1, KVH, S, D]
                attended = attend_mixed(
                    meta, q.transpose(0, 1).unsqueeze(0), k, v, layer.index, layer.scaling, layer.window, None
                )  # [S, H, Dv]
            attended = attended.reshape(rows, -1)
            out = layer.o_proj(attended) if lora is None else lora.project(layer.o_proj, attended, number, O_PROJ)
            hidden, normed = ops.add_norm(hidden, out, layer.post_norm)
            gate_up = layer.gate_up(normed) if lora is None else lora.project(layer.gate_up, normed, number, GATE_UP)
            act = ops.silu_mul(gate_up)
            delta = layer.down(act) if lora is None else lora.project(layer.down, act, number, DOWN)
        return hidden + delta if delta is not None else hidden


class _Norm:
    """transformers' RMSNorm, op for op (so the result is bitwise the same)."""

    def __init__(self, module: Any):
        # module: a transformers RMSNorm, whose attributes torch types as `Tensor | Module`
        self.weight: torch.Tensor = module.weight
        self.eps: float = module.variance_epsilon

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class _Layer:
    """One decoder layer's weights and shapes, read once from transformers' modules."""

    def __init__(self, layer: Any, window: int | None):
        # layer: a transformers decoder layer, whose attributes torch types as `Tensor | Module`
        attn, mlp = layer.self_attn, layer.mlp
        self.index: int = attn.layer_idx
        self.input_norm = _Norm(layer.input_layernorm)
        self.post_norm = _Norm(layer.post_attention_layernorm)
        self.num_heads: int = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads: int = attn.k_proj.out_features // attn.head_dim
        self.head_dim: int = attn.head_dim
        self.scaling: float = attn.scaling
        self.window: int | None = getattr(attn, "sliding_window", None) or window
        self.q_norm = _Norm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = _Norm(attn.k_norm) if hasattr(attn, "k_norm") else None
        self.qkv = fuse_projections([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj: torch.nn.Module = attn.o_proj
        self.gate_up = fuse_projections([mlp.gate_proj, mlp.up_proj])
        self.down: torch.nn.Module = mlp.down_proj


class _TorchOps:
    """The ops between projections as transformers runs them (any device and dtype)."""

    @staticmethod
    def add_norm(hidden: torch.Tensor, delta: torch.Tensor | None, norm: _Norm) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            hidden = hidden + delta
        return hidden, norm(hidden)

    @staticmethod
    def rope_kv_write(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: _Layer,
        kv_cache: PagedKVCache,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [S, H + 2 KVH, Dh] → q, k (normed if the layer norms them, rotated) and v; k and v
        written into the cache."""
        heads, kv_heads = layer.num_heads, layer.num_kv_heads
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        if layer.q_norm is not None:
            if layer.k_norm is None:
                raise ValueError("a layer with a Q norm but no K norm")
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [S, 1, Dh]: broadcast over heads
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kv_cache.write(layer.index, slots, k, v)
        return q, k, v

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        width = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :width]) * gate_up[:, width:]


class _NativeOps:
    """The same ops through kernels.bindings.DecodeGlue (CPU, fp32) or kernels.bf16_glue's (CPU,
    bf16): one call each."""

    def __init__(self, glue: DecodeGlue | BF16DecodeGlue):
        self.glue = glue

    def add_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, norm: _Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, self.glue.add_rms_norm(hidden, delta, norm.weight, norm.eps)

    def rope_kv_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: _Layer,
        kv_cache: PagedKVCache,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_norm, k_norm = layer.q_norm, layer.k_norm
        # A cache in the glue's dtype takes the rows in the same pass; another dtype converts them after it.
        direct = kv_cache.kv_dtype == self.glue.cache_dtype
        key_cache, value_cache = kv_cache.layer(layer.index) if direct else (None, None)
        self.glue.rope_kv_write(
            qkv,
            cos,
            sin,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm else 0.0,
            key_cache,
            value_cache,
            slots,
            layer.num_heads,
            layer.num_kv_heads,
        )
        heads, kv_heads = layer.num_heads, layer.num_kv_heads
        k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]  # normed and rotated in place
        if not direct:
            kv_cache.write(layer.index, slots, k, v)
        return qkv[:, :heads], k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.glue.silu_mul(gate_up)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def decode_step_for(model: Any, glue: DecodeGlue | BF16DecodeGlue | None = None) -> DecodeStep | None:
    """The decode plan for a Llama-style model (with native ops if `glue`); None (transformers' path
    serves every step) for other models."""
    reason = _unsupported(model)
    if reason:
        logger.debug("decode steps run through transformers' layers: %s", reason)
        return None
    return DecodeStep(model, glue)


def _text_model(model: Any) -> tuple[Any, Any]:
    """The decoder body (embeddings, layers, final norm) and its config: a vision-language model's
    language model (LLaVA's, Idefics3's: a decode step holds no image token, so it is text only)."""
    # model: a transformers PreTrainedModel, whose attributes torch types as tensors
    config = model.config
    text_config = config.get_text_config()
    if text_config is config:
        return getattr(model, "model", None), config
    return model.get_decoder(), text_config


def _unsupported(model: Any) -> str | None:
    body, config = _text_model(model)
    if config.model_type not in LLAMA_STYLE:
        return f"model type {config.model_type!r} is not one whose layer is Llama's"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "a rotary embedding over part of each head"
    if getattr(model, "lm_head", None) is None:
        return "the model has no lm_head"
    if body is None or not all(hasattr(body, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers")):
        return "the model has not Llama's layout"
    for layer in body.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a layer has not Llama's attention"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer has not Llama's MLP"
    return None
