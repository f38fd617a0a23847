"""Hostile or wrong files given as a recipe: a clear RecipeError naming the file (and line), fast,
never a traceback, a RecursionError, a hang or a memory blow-up."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from oobleck_slurm.recipe import RecipeError, load_recipe
from oobleck_slurm.recipe.source import (
    MAX_EXTENDED_FILES,
    MAX_EXTENDS_DEPTH,
    MAX_RECIPE_BYTES,
    MAX_RECIPE_DEPTH,
    MAX_RECIPE_VALUES,
)

# Every hostile case must be refused well within this (a real recipe loads in milliseconds).
FAST_S = 60.0  # "refused without a hang or a blow-up", generous for a busy machine (it takes well under a second)

LAUGHS = "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else ', '.join(['lol'] * 9)}]\n" for i in range(10)
)

# (case id, file bytes, words the message must contain, line or None)
HOSTILE = [
    ("deep-flow-list", b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", f"nested deeper than {MAX_RECIPE_DEPTH}", 1),
    ("deep-flow-map", b"a: " + b"{b: " * 3000 + b"1" + b"}" * 3000 + b"\n", "nested deeper than", 1),
    ("deep-block-map", "".join("  " * i + f"k{i}:\n" for i in range(200)).encode(), "nested deeper than", None),
    ("self-alias-list", b"a: &x [*x]\n", "alias *x refers to a node that contains it", 1),
    ("self-alias-map", b"cluster: &c\n  sbatch: *c\n", "alias *c refers to a node that contains it", 2),
    ("billion-laughs", LAUGHS.encode(), f"aliases expand to more than {MAX_RECIPE_VALUES} values", None),
    ("alias-depth-chain", ("a: &a " + "[" * 30 + "]" * 30 + "\n"
                           + "".join(f"{n}: &{n} " + "[" * 20 + f"*{p}" + "]" * 20 + "\n"
                                     for p, n in zip("abcd", "bcde"))).encode(), "nests values deeper than", 2),
    ("python-tag", b"model:\n  kwargs: !!python/object/apply:os.system [echo hi]\n", "", None),
    ("python-scalar-tag", b"name: !!python/name:os.system x\n", "cannot read 'x' tagged !!python/name:os.system", 1),
    ("bad-int-tag", b"cluster:\n  nodes: !!int many\n", "cannot read 'many' tagged !!int", 2),
    ("bad-timestamp-tag", b"name: !!timestamp soon\n", "tagged !!timestamp", 1),
    ("custom-tag", b"cluster:\n  nodes: !weird 4\n", "tagged !weird", 2),
    ("nul-bytes", b"name: a\x00b\n", "binary data (NUL bytes)", 1),
    ("latin-1", b"name: caf\xe9\n", "not UTF-8", 1),
    ("elf-binary", b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4, "", None),
    ("utf16", "name: x\n".encode("utf-16"), "not UTF-8", 1),
    ("two-documents", b"name: a\n---\nname: b\n", "expected a single document", 2),
    ("undefined-alias", b"name: *nope\n", "YAML syntax error", 1),
    ("huge-int", b"cluster:\n  nodes: " + b"9" * 400 + b"\n", "integer out of range", 2),
    ("infinite-lr", b"training:\n  optimizer:\n    lr: .inf\n", "expected a finite number", 3),
    ("huge-float", b"fault_tolerance:\n  step_timeout: 1e999\n", "expected a finite number", 2),
    ("int-too-big-for-float", b"training:\n  grad_clip: " + b"9" * 330 + b"\n", "out of range", 2),
    ("too-many-nodes", b"cluster:\n  nodes: 10000000\n", "must be at most", 2),
    ("name-path-traversal", b"name: ../../etc\n", "it names the job folder", 1),
    ("name-markup", b"name: '[red]x[/]'\n", "it names the job folder", 1),
    ("kwargs-date", b"model:\n  factory: pkg.mod:build\n  kwargs:\n    when: 2024-01-01\n", "expected a JSON value", 3),
    ("sbatch-newline", b"cluster:\n  sbatch:\n    comment: \"a\\n#SBATCH --x\"\n", "must be one line", 2),
    ("scalar-document", b"just text\n", "a recipe must be a mapping", 1),
]


@pytest.mark.parametrize(("content", "words", "line"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_recipe_is_refused_clearly(tmp_path: Path, content: bytes, words: str, line: int | None) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(content)
    started = time.monotonic()
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    assert time.monotonic() - started < FAST_S
    issues = caught.value.issues
    assert issues and all(i.file == str(path) for i in issues), str(caught.value)
    text = str(caught.value)
    assert words in text, text
    if line is not None:
        assert any(i.line == line for i in issues), text


def test_huge_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    with path.open("wb") as file:  # sparse: 1 GiB on paper, nothing on disk
        file.truncate(1 << 30)
    with pytest.raises(RecipeError, match=f"larger than {MAX_RECIPE_BYTES} bytes"):
        load_recipe(path)


def test_many_values_under_the_byte_limit_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "many.yaml"
    path.write_text("cluster:\n  setup: [" + ",".join(["1"] * 120_000) + "]\n")
    started = time.monotonic()
    with pytest.raises(RecipeError, match="more than .* YAML values"):
        load_recipe(path)
    assert time.monotonic() - started < FAST_S


def test_directory_given_as_recipe(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="is a directory, not a recipe file") as caught:
        load_recipe(tmp_path)
    assert caught.value.issues[0].file == str(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_given_as_recipe_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(RecipeError, match="not a regular file"):
        load_recipe(fifo)


def test_extends_a_directory(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = tmp_path / "job.yaml"
    path.write_text("extends: sub\n")
    with pytest.raises(RecipeError, match="extended recipe is not a file") as caught:
        load_recipe(path)
    assert caught.value.issues[0].line == 1


def test_long_extends_chain_is_bounded(tmp_path: Path) -> None:
    count = MAX_EXTENDS_DEPTH + 3
    for i in range(count):
        (tmp_path / f"r{i}.yaml").write_text(f"extends: r{i + 1}.yaml\n" if i + 1 < count else "{}\n")
    with pytest.raises(RecipeError, match="extends chain deeper than"):
        load_recipe(tmp_path / "r0.yaml")


def test_extends_diamonds_are_bounded(tmp_path: Path) -> None:
    # Each level extends the next one twice: 2**12 reads without a budget.
    levels = 12
    for i in range(levels):
        (tmp_path / f"d{i}.yaml").write_text(f"extends: [d{i + 1}.yaml, d{i + 1}.yaml]\n")
    (tmp_path / f"d{levels}.yaml").write_text("{}\n")
    started = time.monotonic()
    with pytest.raises(RecipeError, match=f"more than {MAX_EXTENDED_FILES} recipe files"):
        load_recipe(tmp_path / "d0.yaml")
    assert time.monotonic() - started < FAST_S


def test_anchors_and_aliases_within_limits_still_work(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text("name: anchors\ncluster:\n  setup: &lines [module load a, module load b]\n"
                    "model:\n  factory: pkg.mod:build\n  kwargs:\n    also: *lines\n")
    recipe = load_recipe(path)
    assert recipe.cluster.setup == ("module load a", "module load b")
    assert recipe.model.kwargs["also"] == ["module load a", "module load b"]


def test_default_name_from_an_odd_file_name_is_made_safe(tmp_path: Path) -> None:
    path = tmp_path / "my job [v2].yaml"
    path.write_text("{}\n")
    assert load_recipe(path).name == "my-job-v2"
