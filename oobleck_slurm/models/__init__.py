"""The model-family registry: each family is a folder with a pure-data config (a `ModelDef`), its
torch modules and its Hugging Face adapter; a user's own model comes in through `factory`.

Importing this package does not import torch: recipes are validated and plans made on a login node.
"""

from __future__ import annotations

from typing import Any

from oobleck_slurm.models.base import LayerEstimate, ModelDef
from oobleck_slurm.models.factory import FactoryError, FactoryModel, check_stage_widths, inspect_factory
from oobleck_slurm.models.gpt import GPT_PRESETS, GPTConfig, gpt_config
from oobleck_slurm.models.llama import LLAMA_PRESETS, LlamaConfig, llama_config

# family name -> its definition class and its named sizes
FAMILIES: dict[str, type[ModelDef]] = {"gpt": GPTConfig, "llama": LlamaConfig, "factory": FactoryModel}
PRESETS: dict[str, dict[str, Any]] = {"gpt": GPT_PRESETS, "llama": LLAMA_PRESETS}


def preset(family: str, size: str, **overrides: Any) -> ModelDef:
    """The family's preset `size` with any of its fields overridden."""
    from dataclasses import replace

    return replace(PRESETS[family][size], **overrides)


def with_layers(cfg: ModelDef, seed: int = 0) -> ModelDef:
    """`cfg` with its layers known: a user factory's are found by a meta-device build of its model
    (`inspect_factory`, which raises FactoryError naming the recipe key when it does not fit)."""
    return inspect_factory(cfg, seed) if isinstance(cfg, FactoryModel) and not cfg.layer_names else cfg


def model_from_dict(d: dict[str, Any]) -> ModelDef:
    """A definition back from `ModelDef.to_dict` (the JobSpec's JSON)."""
    fields = dict(d)
    family = fields.pop("family")
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family](**fields)


__all__ = [
    "FAMILIES", "GPT_PRESETS", "LLAMA_PRESETS", "PRESETS", "FactoryError", "FactoryModel", "GPTConfig",
    "check_stage_widths",
    "LayerEstimate", "LlamaConfig", "ModelDef", "gpt_config", "inspect_factory", "llama_config",
    "model_from_dict", "preset", "with_layers",
]
