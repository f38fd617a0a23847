"""Fuzzing the recipe loader: whatever the file holds, `load_recipe` returns a valid Recipe or raises
a RecipeError whose every issue names a file and says something; no other exception, no file
written or changed."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fuzzlib import byte_mutations, fuzz_settings, line_mutations, snapshot
from hypothesis import given
from hypothesis import strategies as st

from oobleck_slurm.recipe import DEFAULT_RECIPE, Recipe, RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[2]
# Every shipped recipe, by its path relative to the copy the tests mutate in (extends stay valid).
SHIPPED = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").rglob("*.yaml")) + ["default.yaml"]

SECTION_KEYS = {
    "cluster": ["backend", "nodes", "gpus_per_node", "cpus_per_node", "workers_per_node", "spare_nodes", "partition",
                "account", "time", "sbatch", "setup"],
    "model": ["family", "size", "n_layer", "d_model", "n_head", "seq_len", "factory", "kwargs"],
    "data": ["path", "text", "tokenizer"],
    "training": ["global_batch_size", "microbatch_size", "steps", "seed", "precision", "grad_clip", "optimizer",
                 "lr_schedule"],
    "fault_tolerance": ["f", "heartbeat_interval", "heartbeat_lease", "collective_timeout", "step_timeout",
                        "reconfiguration_timeout", "replacement", "checkpoint_interval"],
}


@pytest.fixture(scope="module")
def tree() -> Iterator[Path]:
    """A copy of recipes/ (and the embedded default) that mutants are written into."""
    with tempfile.TemporaryDirectory(prefix="fuzz-recipes-") as folder:
        root = Path(folder)
        shutil.copytree(REPO / "recipes", root / "recipes")
        text = REPO / "oobleck_slurm" / "data" / "persuasion.txt"  # the lab recipe's data, by relative path
        (root / text.relative_to(REPO)).parent.mkdir(parents=True)
        shutil.copy(text, root / text.relative_to(REPO))
        shutil.copy(DEFAULT_RECIPE, root / "default.yaml")
        yield root


def check_load(path: Path, root: Path) -> Recipe | None:
    """The property: a Recipe, or a RecipeError with clear issues; nothing under `root` changed."""
    before = snapshot(root)
    try:
        recipe = load_recipe(path)
    except RecipeError as err:
        assert err.issues, "a RecipeError must carry at least one issue"
        for issue in err.issues:
            assert issue.file and Path(issue.file).name, issue
            assert issue.message.strip(), issue
            assert issue.line is None or issue.line >= 1, issue
            assert str(issue).startswith(issue.file), issue
        recipe = None
    assert snapshot(root) == before, "loading a recipe changed a file"
    return recipe


# Scalars of every YAML type a user may write, including the awkward ones.
yaml_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
                | st.text(max_size=12) | st.sampled_from(["local", "slurm", "tiny", "came", "adamw", "bf16", "01:00:00"]))
yaml_values = st.recursive(yaml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3), max_leaves=12)


@st.composite
def recipe_documents(draw: st.DrawFn) -> dict:
    """Mostly well-formed recipes (known sections and keys) with values of any type."""
    doc: dict = {}
    for section in draw(st.lists(st.sampled_from([*SECTION_KEYS, "name", "extends", "bogus"]), max_size=5, unique=True)):
        if section in SECTION_KEYS:
            keys = draw(st.lists(st.sampled_from(SECTION_KEYS[section]), max_size=4, unique=True))
            doc[section] = {k: draw(yaml_values) for k in keys}
        else:
            doc[section] = draw(yaml_values)
    return doc


@fuzz_settings()
@given(doc=recipe_documents())
def test_generated_recipes(tree: Path, doc: dict) -> None:
    path = tree / "generated.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    check_load(path, tree)


@fuzz_settings()
@given(name=st.sampled_from(SHIPPED), data=st.data())
def test_line_mutations_of_shipped_recipes(tree: Path, name: str, data: st.DataObject) -> None:
    original = (tree / name).read_text()
    mutant = tree / Path(name).with_name("mutant.yaml")
    mutant.write_text(data.draw(line_mutations(original)))
    check_load(mutant, tree)


@fuzz_settings()
@given(name=st.sampled_from(SHIPPED), data=st.data())
def test_byte_mutations_of_shipped_recipes(tree: Path, name: str, data: st.DataObject) -> None:
    original = (tree / name).read_bytes()
    mutant = tree / Path(name).with_name("mutant.yaml")
    mutant.write_bytes(data.draw(byte_mutations(original)))
    check_load(mutant, tree)


@fuzz_settings(0.5)
@given(content=st.binary(max_size=512))
def test_arbitrary_bytes(tree: Path, content: bytes) -> None:
    path = tree / "bytes.yaml"
    path.write_bytes(content)
    check_load(path, tree)


@fuzz_settings(0.5)
@given(text=st.text(alphabet=st.sampled_from(list("[]{}:,-&*!?|>'\"#%@` \n\tab1")), max_size=200))
def test_yaml_punctuation_soup(tree: Path, text: str) -> None:
    path = tree / "soup.yaml"
    path.write_text(text)
    check_load(path, tree)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_loads_unchanged(tree: Path, name: str) -> None:
    assert isinstance(check_load(tree / name, tree), Recipe)
