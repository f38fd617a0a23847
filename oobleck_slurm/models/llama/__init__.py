"""Llama-family decoder (Llama 2/3, Mistral, Qwen2): RMSNorm, RoPE, grouped-query attention, SwiGLU.
`config` is pure data; the torch modules are in `model`, the Hugging Face adapter in `hf`."""

from oobleck_slurm.models.llama.config import LLAMA_PRESETS, LlamaConfig, llama_config

__all__ = ["LLAMA_PRESETS", "LlamaConfig", "llama_config"]
