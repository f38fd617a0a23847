"""Shared by the fuzz tests: settings, byte-level mutations, and a snapshot that proves a loader
changed no file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st

PROFILE = os.environ.get("OOBLECK_FUZZ_PROFILE", "ci")


def fuzz_settings(fraction: float = 1.0) -> settings:
    """The chosen profile (conftest.py), with `fraction` of its examples for the slower properties."""
    base = settings.get_profile(PROFILE)
    return settings(base, max_examples=max(5, int(base.max_examples * fraction)))


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime (ns) of every file under `folder`: equal snapshots, nothing written."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` truncated, with bytes flipped, inserted or deleted: what a bad copy or disk does."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
        if not out:
            break
        i = draw(st.integers(0, len(out) - 1))
        if how == "truncate":
            del out[i:]
        elif how == "flip":
            out[i] ^= draw(st.integers(1, 255))
        elif how == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del out[i:i + draw(st.integers(1, 16))]
    return bytes(out)


@st.composite
def line_mutations(draw: st.DrawFn, text: str) -> str:
    """`text` with lines deleted, duplicated (a key given twice), re-indented, or with a value
    replaced by one of another type: what a hand edit gets wrong."""
    lines = text.splitlines()
    odd_values = ["", "~", "[]", "{}", "-1", "0", "1.5", "yes", "'[red]x[/]'", "&a [*a]", "*nope", "!!binary aGk=",
                  "1e999", "9" * 30, ".nan", "'\\u0000'", "[1, [2, [3]]]", "{a: {b: {c: 1}}}", "2024-01-01"]
    for _ in range(draw(st.integers(1, 3))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        how = draw(st.sampled_from(["delete", "duplicate", "retype", "indent", "dedent"]))
        if how == "delete":
            del lines[i]
        elif how == "duplicate":
            lines.insert(i, lines[i])
        elif how == "retype" and ":" in lines[i]:
            key = lines[i].split(":", 1)[0]
            lines[i] = f"{key}: {draw(st.sampled_from(odd_values))}"
        elif how == "indent":
            lines[i] = "  " + lines[i]
        elif how == "dedent":
            lines[i] = lines[i].lstrip()
    return "\n".join(lines) + "\n"


def json_values(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    """Any JSON value (NaN and infinities included: Python's json writes and reads them)."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=max_leaves)
