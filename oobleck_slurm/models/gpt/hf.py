"""Hugging Face GPT-2 (`GPT2LMHeadModel`): our GPT's config and layers to and from its config.json and
tensor names (`transformer.h.{i}.attn.c_attn.weight`, ...).

GPT-2 stores its projections as `Conv1D` weights, (in, out): the transpose of our `nn.Linear`. Our GPT
uses exact GELU, which transformers calls "gelu"; OpenAI's GPT-2 checkpoints use the tanh approximation
("gelu_new") and are refused rather than silently computing something else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oobleck_slurm.models.gpt.config import GPTConfig
from oobleck_slurm.models.hf_base import HFError, architecture

if TYPE_CHECKING:
    import torch

LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which our GPT uses

# our local name -> (GPT-2's local name, whether the weight is transposed)
_BLOCK = {
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "fc.weight": ("mlp.c_fc.weight", True), "fc.bias": ("mlp.c_fc.bias", False),
    "fc_proj.weight": ("mlp.c_proj.weight", True), "fc_proj.bias": ("mlp.c_proj.bias", False),
}
_EMBED = {"tok.weight": ("transformer.wte.weight", False), "pos.weight": ("transformer.wpe.weight", False)}
_HEAD = {"ln.weight": ("transformer.ln_f.weight", False), "ln.bias": ("transformer.ln_f.bias", False),
         "lm_head.weight": ("lm_head.weight", False)}


def _int(config: Mapping[str, Any], where: str, key: str) -> int:
    value = config.get(key)
    if value is None:
        raise HFError(f"{where}: missing key {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise HFError(f"{where}: key {key!r} = {value!r}: expected a positive int")
    return value


def config_from_hf(config: Mapping[str, Any], where: str, seq_len: int | None = None) -> GPTConfig:
    """The `GPTConfig` of a GPT-2 config.json (`where` names the file in errors). `seq_len` defaults to
    `n_positions` and may be shorter (the first rows of the position table are used)."""
    arch = architecture(config, where)
    if arch != "GPT2LMHeadModel":
        raise HFError(f"{where}: {arch} is not GPT-2")
    d = _int(config, where, "n_embd")
    n_positions = _int(config, where, "n_positions")
    act = config.get("activation_function", "gelu_new")
    if act != "gelu":
        raise HFError(f"{where}: key 'activation_function' = {act!r}: only exact 'gelu' is supported (our GPT's "
                      f"MLP; OpenAI's GPT-2 checkpoints use the tanh approximation 'gelu_new')")
    checks = (("n_inner", config.get("n_inner"), (None, 4 * d)),
              ("layer_norm_epsilon", config.get("layer_norm_epsilon", LAYER_NORM_EPS), (LAYER_NORM_EPS,)),
              ("scale_attn_weights", config.get("scale_attn_weights", True), (True,)),
              ("scale_attn_by_inverse_layer_idx", config.get("scale_attn_by_inverse_layer_idx", False), (False,)),
              ("add_cross_attention", config.get("add_cross_attention", False), (False,)))
    for key, value, allowed in checks:
        if value not in allowed:
            raise HFError(f"{where}: key {key!r} = {value!r}: our GPT needs {' or '.join(map(repr, allowed))}")
    if seq_len is not None and seq_len > n_positions:
        raise HFError(f"{where}: key 'n_positions' = {n_positions}: the learned position table is shorter than "
                      f"the sequence length {seq_len}")
    n_head = _int(config, where, "n_head")
    if d % n_head:
        raise HFError(f"{where}: key 'n_embd' = {d} is not a multiple of 'n_head' = {n_head}")
    return GPTConfig(n_layer=_int(config, where, "n_layer"), d_model=d, n_head=n_head,
                     seq_len=n_positions if seq_len is None else seq_len,
                     vocab_size=_int(config, where, "vocab_size"))


@dataclass(frozen=True)
class GPT2Adapter:
    """`models.hf.HFAdapter` of the GPT family, to transformers' `GPT2LMHeadModel`."""

    cfg: GPTConfig

    def _names(self, index: int) -> dict[str, tuple[str, bool]]:
        n = self.cfg.num_layers
        if not 0 <= index < n:
            raise IndexError(f"gpt: layer {index} out of range [0, {n})")
        if index == 0:
            return _EMBED
        if index == n - 1:
            return _HEAD
        return {ours: (f"transformer.h.{index - 1}.{theirs}", t) for ours, (theirs, t) in _BLOCK.items()}

    def hf_names(self, index: int) -> list[str]:
        return [name for name, _ in self._names(index).values()]

    def to_hf(self, index: int, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = self._names(index)
        if set(state) != set(names):
            raise ValueError(f"gpt: layer {index}'s state has keys {sorted(state)}, expected {list(names)}")
        out = {}
        for ours, (theirs, transposed) in names.items():
            tensor = state[ours]
            if ours == "attn.qkv.bias":
                # masked in our attention (CausalSelfAttention): its stored value never acts
                d = self.cfg.d_model
                tensor = tensor.clone()
                tensor[d : 2 * d] = 0.0
            out[theirs] = tensor.t() if transposed else tensor
        return out

    def from_hf(self, index: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for ours, (theirs, transposed) in self._names(index).items():
            if theirs == "lm_head.weight" and theirs not in tensors:
                theirs = "transformer.wte.weight"  # tie_word_embeddings: the head starts as the embedding
            tensor = tensors[theirs]
            if ours == "pos.weight" and tensor.shape[0] > self.cfg.seq_len:
                tensor = tensor[: self.cfg.seq_len]
            out[ours] = tensor.t() if transposed else tensor
        return out

    def hf_config(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu",
            "layer_norm_epsilon": LAYER_NORM_EPS, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "use_cache": True, "tie_word_embeddings": False,
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32", "dtype": "float32",
        }
