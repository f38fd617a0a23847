"""The file-reading commands end to end, in-process (`oobleck_slurm.cli.main`): whatever the file,
`validate` exits 0 with the recipe or 2 with a message naming the file; never a traceback, never a
rich MarkupError from the file's text. (`plan --profile` is fuzzed in test_fuzz_profile.py.)"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzzlib import byte_mutations, fuzz_settings, line_mutations, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oobleck_slurm.cli import main
from oobleck_slurm.recipe import DEFAULT_RECIPE

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").rglob("*.yaml"))

# capsys is read (and so emptied) in every example: sharing it across examples is what we want.
cli_settings = settings(fuzz_settings(0.5), suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tree() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-cli-") as folder:
        root = Path(folder)
        shutil.copytree(REPO / "recipes", root / "recipes")
        shutil.copy(DEFAULT_RECIPE, root / "recipes" / "default.yaml")
        yield root


def validate(capsys: pytest.CaptureFixture[str], path: Path, as_json: bool) -> None:
    before = snapshot(path.parent)
    code = main(["validate", str(path), *(["--json"] if as_json else [])])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert snapshot(path.parent) == before, "validate changed a file"
    assert code in (0, 2), code
    if code == 2:
        assert "problem" in out.err and str(path.name) in out.err, out.err
    elif as_json:
        assert isinstance(json.loads(out.out), dict)
    else:
        assert "✓" in out.out


@cli_settings
@given(name=st.sampled_from([*SHIPPED, "recipes/default.yaml"]), data=st.data(), as_json=st.booleans())
def test_validate_line_mutants(tree: Path, capsys: pytest.CaptureFixture[str], name: str, data: st.DataObject,
                               as_json: bool) -> None:
    mutant = tree / Path(name).with_name("cli-mutant.yaml")
    mutant.write_text(data.draw(line_mutations((tree / name).read_text())))
    validate(capsys, mutant, as_json)


@cli_settings
@given(name=st.sampled_from([*SHIPPED, "recipes/default.yaml"]), data=st.data(), as_json=st.booleans())
def test_validate_byte_mutants(tree: Path, capsys: pytest.CaptureFixture[str], name: str, data: st.DataObject,
                               as_json: bool) -> None:
    mutant = tree / Path(name).with_name("cli-bytes.yaml")
    mutant.write_bytes(data.draw(byte_mutations((tree / name).read_bytes())))
    validate(capsys, mutant, as_json)


@cli_settings
@given(text=st.text(max_size=40), as_json=st.booleans())
def test_validate_any_description(tree: Path, capsys: pytest.CaptureFixture[str], text: str, as_json: bool) -> None:
    """Any text a recipe may carry (markup look-alikes, control characters) prints as text."""
    path = tree / "recipes" / "described.yaml"
    path.write_text(f"description: {json.dumps(text)}\ncluster:\n  setup: [{json.dumps(text)}]\n")
    validate(capsys, path, as_json)


@pytest.mark.parametrize("how", ["directory", "missing", "empty", "binary"])
def test_validate_wrong_files(tree: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    path = {"directory": tree / "recipes", "missing": tree / "missing.yaml",
            "empty": tree / "empty.yaml", "binary": tree / "binary.yaml"}[how]
    if how == "empty":
        path.write_bytes(b"")
    elif how == "binary":
        path.write_bytes(bytes(range(256)))
    code = main(["validate", str(path)])
    out = capsys.readouterr()
    assert code == 2 and str(path) in out.err and "Traceback" not in out.err
