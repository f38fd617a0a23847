"""Fuzzing the profile loader (`--profile FILE`) and `plan --profile` end to end: a Profile or a
ProfileError naming the file; in the CLI, exit 0 or exit 2 with a message, never a traceback."""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzzlib import byte_mutations, fuzz_settings, json_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oobleck_slurm.cli import main
from oobleck_slurm.planning.estimate import estimate_profile
from oobleck_slurm.planning.profile import MAX_PROFILE_BYTES, Profile, ProfileError, load_profile
from oobleck_slurm.recipe import load_recipe

# The embedded default's memory budget per device fits its own measured profile, not these documents.
TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "local-tiny.yaml")


def base_profile() -> dict[str, Any]:
    """A valid profile of the default recipe's model, one device per node (so that it plans)."""
    recipe = load_recipe()
    profile = estimate_profile(recipe.model.resolve(), "H100", microbatch_size=recipe.training.microbatch_size,
                               dtype="fp32", optimizer="adamw", devices_per_node=1)
    return profile.to_dict()


BASE = base_profile()


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON value (dict keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


ODD = st.sampled_from([None, True, -1, 0, -0.0, 1e308, 2**64, 10**30, float("nan"), float("inf"), -float("inf"),
                       "", "[red]x[/]", "1", [], {}, [1, 2], {"a": 1}]) | json_values(6)


@st.composite
def mutated_profiles(draw: st.DrawFn) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(paths(doc)))
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        how = draw(st.sampled_from(["delete", "retype", "duplicate-layer"]))
        if how == "delete":
            del parent[where[-1]]
        elif how == "retype":
            # a copy: ODD's lists and dicts are shared by every test case, and a later mutation of this
            # document may delete inside them (hypothesis then reports the changed draws as flaky)
            parent[where[-1]] = copy.deepcopy(draw(ODD))
        elif isinstance(doc.get("layers"), list) and doc["layers"]:
            doc["layers"] = doc["layers"] + doc["layers"][: draw(st.integers(1, 3))]
        if not isinstance(doc, dict) or not paths(doc):
            break
    return doc


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-profile-") as name:
        yield Path(name)


def check_load(path: Path) -> Profile | None:
    try:
        return load_profile(path)
    except ProfileError as err:
        assert str(err).startswith(str(path)), err  # names the file
        assert len(str(err)) < 2000, "a message should be a line, not the file"
        return None


@fuzz_settings()
@given(doc=mutated_profiles())
def test_mutated_profiles(folder: Path, doc: dict) -> None:
    path = folder / "mutant.json"
    path.write_text(json.dumps(doc))
    profile = check_load(path)
    if profile is not None:
        assert profile.layers and profile.devices_per_node >= 1


@fuzz_settings(0.5)
@given(data=st.data())
def test_byte_mutations_of_a_profile(folder: Path, data: st.DataObject) -> None:
    path = folder / "bytes.json"
    path.write_bytes(data.draw(byte_mutations(json.dumps(BASE, indent=1).encode())))
    check_load(path)


@fuzz_settings(0.5)
@given(value=json_values())
def test_any_json_value(folder: Path, value: Any) -> None:
    path = folder / "any.json"
    path.write_text(json.dumps(value))
    assert check_load(path) is None  # never a profile: no format key


@pytest.mark.parametrize(("content", "words"), [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"format": ' + b"9" * 5000 + b"}", "not a usable JSON document"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"", "not valid JSON"),
])
def test_hostile_profile_files(folder: Path, content: bytes, words: str) -> None:
    path = folder / "hostile.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match=words):
        load_profile(path)


def test_huge_directory_and_missing_profile_files(folder: Path) -> None:
    huge = folder / "huge.json"
    with huge.open("wb") as file:
        file.truncate(MAX_PROFILE_BYTES + 10)
    for path, words in ((huge, "larger than"), (folder, "a directory"), (folder / "nope.json", "cannot read")):
        with pytest.raises(ProfileError, match=words):
            load_profile(path)


def test_too_many_layers_or_devices(folder: Path) -> None:
    path = folder / "big.json"
    path.write_text(json.dumps({**BASE, "layers": BASE["layers"] * 1000}))
    with pytest.raises(ProfileError, match="at most"):
        load_profile(path)
    path.write_text(json.dumps({**BASE, "devices_per_node": 10**6}))
    with pytest.raises(ProfileError, match="devices_per_node' must be at most"):
        load_profile(path)


# ---- the CLI, in-process: `plan --profile FILE` and `profile --profile FILE` ---------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out, out.err


# capsys is read (and so emptied) in every example: sharing it across examples is what we want.
@settings(fuzz_settings(0.5), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=mutated_profiles(), as_json=st.booleans(), command=st.sampled_from(["plan", "profile"]))
def test_cli_with_mutated_profiles(folder: Path, capsys: pytest.CaptureFixture[str], doc: dict, as_json: bool,
                                   command: str) -> None:
    path = folder / "cli.json"
    path.write_text(json.dumps(doc))
    written = path.read_bytes()
    code, out, err = run_cli(capsys, command, "--profile", str(path), "--cache", str(folder / "cli-cache"),
                             *(["--json"] if as_json else []))
    assert code in (0, 2), (code, out, err)
    if code == 2:
        assert err.strip(), "exit 2 must say why"
    elif as_json:
        json.loads(out)
    assert path.read_bytes() == written  # the cache may grow; the profile file is never written


def test_cli_plan_with_the_base_profile(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = folder / "base.json"
    path.write_text(json.dumps(BASE))
    code, out, _ = run_cli(capsys, "plan", TINY, "--profile", str(path), "--cache", str(folder / "cli-cache"), "--json")
    assert code == 0 and json.loads(out)["plan"]


def test_cli_profile_display_escapes_names(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = copy.deepcopy(BASE)
    doc["device_name"] = "[bold]GPU[/] [/]"
    doc["layers"][0]["name"] = "[/embed]"
    path = folder / "markup.json"
    path.write_text(json.dumps(doc))
    code, out, _ = run_cli(capsys, "profile", "--profile", str(path), "--cache", str(folder / "cli-cache"))
    assert code == 0 and "[/embed]" in out
    code, out, _ = run_cli(capsys, "plan", TINY, "--profile", str(path), "--cache", str(folder / "cli-cache"))
    assert code == 0 and "[bold]GPU[/]" in out.replace("\n", "")
