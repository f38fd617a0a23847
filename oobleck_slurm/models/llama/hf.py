"""Hugging Face Llama, Mistral and Qwen2 checkpoints: their config.json read into a `LlamaConfig`, and
`LlamaAdapter`, the renaming between our layers and their tensor names (`model.layers.{i}.…`).

All three architectures are the same computation for sequences no longer than a sliding window:
Mistral is Llama without biases and with a window, Qwen2 is Llama with biases on the q, k and v
projections (and a window that is usually switched off).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oobleck_slurm.models.hf_base import ARCHITECTURES, HFError, architecture
from oobleck_slurm.models.llama.config import LlamaConfig

if TYPE_CHECKING:
    import torch

_ROPE_PLAIN = (None, "default")


def _get(config: Mapping[str, Any], where: str, key: str, kind: type, default: Any = ...) -> Any:
    value = config.get(key, default)
    if value is ...:
        raise HFError(f"{where}: missing key {key!r}")
    if value is None and default is None:
        return None
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok or (kind is int and value <= 0):
        raise HFError(f"{where}: key {key!r} = {value!r}: expected a {'positive ' if kind is int else ''}"
                      f"{kind.__name__}")
    return value


def _rope(config: Mapping[str, Any], where: str, max_len: int) -> dict[str, Any]:
    """LlamaConfig's rope fields from transformers 5's `rope_parameters` or 4.x's `rope_theta` +
    `rope_scaling` (which transformers 5 still reads first)."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(key) or {}
    if not isinstance(params, dict):
        raise HFError(f"{where}: key {key!r} must be an object, found {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise HFError(f"{where}: key {key!r}: per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type not in (*_ROPE_PLAIN, "llama3"):
        raise HFError(f"{where}: key {key!r}: rope type {rope_type!r} is not supported (supported: none, "
                      f"'default', 'llama3')")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise HFError(f"{where}: key 'partial_rotary_factor' = {partial!r}: only full rotary embeddings "
                      f"are supported")
    theta_source = params if "rope_theta" in params else config
    fields: dict[str, Any] = {"rope_theta": _get(theta_source, where, "rope_theta", float, 10000.0)}
    if rope_type == "llama3":
        for field, name, kind, default in (("rope_factor", "factor", float, ...),
                                           ("rope_low_freq_factor", "low_freq_factor", float, ...),
                                           ("rope_high_freq_factor", "high_freq_factor", float, ...),
                                           ("rope_original_max_len", "original_max_position_embeddings", int,
                                            max_len)):
            fields[field] = _get(params, f"{where}: key {key!r}", name, kind, default)
        if fields["rope_high_freq_factor"] <= fields["rope_low_freq_factor"]:
            raise HFError(f"{where}: key {key!r}: high_freq_factor must exceed low_freq_factor")
    return fields


def _sliding_window(config: Mapping[str, Any], where: str, arch: str, n_layer: int) -> int | None:
    """The attention window some layers use, or None when every layer attends to all earlier positions."""
    window = _get(config, where, "sliding_window", int, None)
    if window is None:
        return None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        return window if "sliding_attention" in layer_types else None
    if arch == "Qwen2ForCausalLM":
        # Qwen2: layers from max_window_layers on slide, and only with use_sliding_window
        first = _get(config, where, "max_window_layers", int, n_layer)
        return window if config.get("use_sliding_window") and first < n_layer else None
    return window if arch == "MistralForCausalLM" else None


def config_from_hf(config: Mapping[str, Any], where: str, seq_len: int | None = None) -> LlamaConfig:
    """The `LlamaConfig` of a Llama, Mistral or Qwen2 config.json (`where` names the file in errors).

    `seq_len` defaults to `max_position_embeddings`; a sliding window shorter than it is refused."""
    arch = architecture(config, where)
    if ARCHITECTURES[arch][1] != "llama":
        raise HFError(f"{where}: {arch} is not a Llama-family architecture")
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise HFError(f"{where}: key 'hidden_act' = {act!r}: only 'silu' (SwiGLU) is supported")
    n_layer = _get(config, where, "num_hidden_layers", int)
    d_model = _get(config, where, "hidden_size", int)
    n_head = _get(config, where, "num_attention_heads", int)
    n_kv_heads = _get(config, where, "num_key_value_heads", int, None) or n_head
    head_dim = _get(config, where, "head_dim", int, None)
    max_len = _get(config, where, "max_position_embeddings", int)
    if seq_len is None:
        seq_len = max_len
    window = _sliding_window(config, where, arch, n_layer)
    if window is not None and window < seq_len:
        raise HFError(f"{where}: key 'sliding_window' = {window} is shorter than the sequence length {seq_len}: "
                      f"these layers attend to every earlier position, so train with sequences of at most "
                      f"{window} tokens")
    if n_head % n_kv_heads:
        raise HFError(f"{where}: key 'num_attention_heads' = {n_head} is not a multiple of "
                      f"'num_key_value_heads' = {n_kv_heads}")
    if head_dim is None and d_model % n_head:
        raise HFError(f"{where}: key 'hidden_size' = {d_model} is not a multiple of 'num_attention_heads' = "
                      f"{n_head} and no 'head_dim' is given")
    if arch == "Qwen2ForCausalLM":
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif arch == "MistralForCausalLM":
        qkv_bias = o_bias = mlp_bias = False
    else:
        qkv_bias = o_bias = _get(config, where, "attention_bias", bool, False)
        mlp_bias = _get(config, where, "mlp_bias", bool, False)
    return LlamaConfig(
        n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_heads=n_kv_heads,
        ffn_dim=_get(config, where, "intermediate_size", int), seq_len=seq_len, max_positions=max_len if max_len != seq_len else None,
        vocab_size=_get(config, where, "vocab_size", int),
        head_dim=None if head_dim in (None, d_model // n_head) and d_model % n_head == 0 else head_dim,
        norm_eps=_get(config, where, "rms_norm_eps", float, 1e-6),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, **_rope(config, where, max_len),
    )


@dataclass(frozen=True)
class LlamaAdapter:
    """`models.hf.HFAdapter` of the Llama family: our layer names are Hugging Face's within a layer."""

    cfg: LlamaConfig

    def _prefix(self, index: int) -> str:
        n = self.cfg.num_layers
        if not 0 <= index < n:
            raise IndexError(f"llama: layer {index} out of range [0, {n})")
        if index == 0:
            return "model."
        if index == n - 1:
            return ""
        return f"model.layers.{index - 1}."

    def _local_names(self, index: int) -> list[str]:
        cfg = self.cfg
        if index == 0:
            return ["embed_tokens.weight"]
        if index == cfg.num_layers - 1:
            return ["norm.weight", "lm_head.weight"]
        names = ["input_layernorm.weight"]
        for proj, bias in (("q_proj", cfg.qkv_bias), ("k_proj", cfg.qkv_bias), ("v_proj", cfg.qkv_bias),
                           ("o_proj", cfg.o_bias)):
            names += [f"self_attn.{proj}.weight"] + ([f"self_attn.{proj}.bias"] if bias else [])
        names.append("post_attention_layernorm.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names += [f"mlp.{proj}.weight"] + ([f"mlp.{proj}.bias"] if cfg.mlp_bias else [])
        return names

    def _hf_name(self, index: int, local: str) -> str:
        if index == self.cfg.num_layers - 1 and local == "norm.weight":
            return "model.norm.weight"
        return self._prefix(index) + local

    def hf_names(self, index: int) -> list[str]:
        return [self._hf_name(index, local) for local in self._local_names(index)]

    def to_hf(self, index: int, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = self._local_names(index)
        if set(state) != set(names):
            raise ValueError(f"llama: layer {index}'s state has keys {sorted(state)}, expected {names}")
        return {self._hf_name(index, local): state[local] for local in names}

    def from_hf(self, index: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for local in self._local_names(index):
            name = self._hf_name(index, local)
            if name == "lm_head.weight" and name not in tensors:
                name = "model.embed_tokens.weight"  # tie_word_embeddings: the head starts as the embedding
            out[local] = tensors[name]
        return out

    def hf_config(self) -> dict[str, Any]:
        cfg = self.cfg
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_factor is not None:
            rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                    "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                    "original_max_position_embeddings": cfg.rope_original_max_len}
        config: dict[str, Any] = {
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.dim_per_head, "hidden_act": "silu",
            "max_position_embeddings": max(cfg.max_positions or 0, cfg.seq_len), "rms_norm_eps": cfg.norm_eps,
            "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
            "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
            # transformers 5 reads rope_parameters (and rope_scaling first when set), 4.x rope_theta + rope_scaling
            "rope_parameters": rope, "rope_theta": cfg.rope_theta,
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_factor else None,
        }
        if cfg.qkv_bias == cfg.o_bias:
            config.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=cfg.qkv_bias,
                          mlp_bias=cfg.mlp_bias, pretraining_tp=1)
        elif cfg.qkv_bias and not cfg.mlp_bias:
            config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                          sliding_window=None, max_window_layers=cfg.n_layer,
                          layer_types=["full_attention"] * cfg.n_layer)
        else:
            raise HFError(f"llama: qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias}, mlp_bias={cfg.mlp_bias} has no "
                          f"Hugging Face architecture (Llama: attention biases on q, k, v and o together; "
                          f"Qwen2: on q, k, v only, no MLP bias)")
        return config
