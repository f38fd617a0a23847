"""Model families expressed as ordered layer lists.

`config` is pure data (no torch import) so that recipes can be validated and plans made on a login
node without torch's import cost; the torch modules live in `gpt`.
"""

from oobleck_slurm.models.config import GPT_PRESETS, GPTConfig, gpt_config

__all__ = ["GPT_PRESETS", "GPTConfig", "gpt_config"]
