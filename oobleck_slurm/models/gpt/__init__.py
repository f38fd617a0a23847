"""GPT-2-style decoder (learned positions, LayerNorm, GELU MLP). `config` is pure data; the torch
modules are in `model`, the Hugging Face GPT-2 adapter in `hf`."""

from oobleck_slurm.models.gpt.config import GPT_PRESETS, GPTConfig, gpt_config

__all__ = ["GPT_PRESETS", "GPTConfig", "gpt_config"]
