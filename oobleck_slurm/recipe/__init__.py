"""Job recipes: YAML files loaded into typed, immutable config objects.

    recipe = load_recipe("recipes/local-tiny.yaml")   # raises RecipeError with every issue found
    recipe.training.microbatch_size

A recipe may `extends:` others (a centre recipe plus a job recipe); mappings merge key by key.
"""

from __future__ import annotations

from pathlib import Path

from oobleck_slurm.recipe.errors import RecipeError, RecipeIssue
from oobleck_slurm.recipe.schema import (
    ClusterConfig,
    DataConfig,
    FaultToleranceConfig,
    LRScheduleConfig,
    ModelConfig,
    OptimizerConfig,
    Recipe,
    TrainingConfig,
)
from oobleck_slurm.recipe.source import read_source
from oobleck_slurm.recipe.validate import build_recipe, recipe_to_dict

DEFAULT_RECIPE = Path(__file__).with_name("default.yaml")


def load_recipe(path: str | Path | None = None) -> Recipe:
    """Load and validate a recipe file; None loads the embedded default (local backend)."""
    return build_recipe(read_source(Path(path) if path is not None else DEFAULT_RECIPE))


__all__ = [
    "DEFAULT_RECIPE", "ClusterConfig", "DataConfig", "FaultToleranceConfig", "LRScheduleConfig",
    "ModelConfig", "OptimizerConfig", "Recipe", "RecipeError", "RecipeIssue", "TrainingConfig", "load_recipe",
    "recipe_to_dict",
]
