"""What every family's Hugging Face side builds on: the architectures this package reads, the adapter
protocol a family implements, and the error.

Its own module so that the families' `hf.py` (which implement `HFAdapter` and read their config.json)
and `models/hf.py` (which dispatches to them, and reads and writes the folders) both depend on it,
not on each other in a circle. Pure data: no torch, no safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from oobleck_slurm.errors import BadInputError

if TYPE_CHECKING:
    import torch

# architecture (config.json's "architectures") -> (model_type, family)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "llama"),
    "GPT2LMHeadModel": ("gpt2", "gpt"),
}


class HFError(BadInputError, ValueError):
    """A Hugging Face folder this package cannot read or write; the message names the file and key."""


class HFAdapter(Protocol):
    """One family's mapping between its layers and a Hugging Face model's config and tensor names.

    `index` is the layer's position in `ModelDef.layer_keys()`; state dicts are the layer's own
    (`layer.state_dict()` names)."""

    def hf_config(self) -> dict[str, Any]:
        """A complete config.json (architectures, model_type, dtype float32, untied head, every shape
        key) that transformers loads into a model computing what our layers compute."""
        ...

    def hf_names(self, index: int) -> list[str]:
        """The Hugging Face tensor names of layer `index`."""
        ...

    def to_hf(self, index: int, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer `index`'s state under Hugging Face names and layouts (views where possible)."""
        ...

    def from_hf(self, index: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer `index`'s state from a checkpoint's tensors (only the layer's names are read)."""
        ...


def architecture(config: Mapping[str, Any], where: str) -> str:
    """The supported architecture a config.json describes: the first of its `architectures` this package
    knows, or, without that key, the one of its `model_type`."""
    supported = ", ".join(ARCHITECTURES)
    archs = config.get("architectures")
    if archs:
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise HFError(f"{where}: key 'architectures' must be a list of names, found {archs!r}")
        for arch in archs:
            if arch in ARCHITECTURES:
                return arch
        raise HFError(f"{where}: key 'architectures' = {archs}: not supported; supported: {supported}")
    model_type = config.get("model_type")
    for arch, (known_type, _) in ARCHITECTURES.items():
        if model_type == known_type:
            return arch
    raise HFError(f"{where}: neither key 'architectures' nor key 'model_type' (= {model_type!r}) names a "
                  f"supported model; supported: {supported}")
