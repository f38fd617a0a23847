"""Read recipe YAML into plain values while remembering where every key came from.

`extends:` chains are merged here (base first, mappings merged key by key, everything else
replaced), so that validation sees one tree and can still name the file and line of each value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from oobleck_slurm.recipe.errors import RecipeError, RecipeIssue

KeyPath = tuple[str, ...]

MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of YAML; anything bigger is a wrong file


@dataclass
class Source:
    """A merged recipe tree plus, for each key path, the (file, line) that set it."""

    tree: dict[str, Any]
    origin: dict[KeyPath, tuple[str, int]] = field(default_factory=dict)
    root_file: str = ""

    def where(self, path: KeyPath) -> tuple[str, int | None]:
        """The file and line of `path`, or of its nearest ancestor that has one."""
        for cut in range(len(path), 0, -1):
            if path[:cut] in self.origin:
                return self.origin[path[:cut]]
        return self.root_file, None

    def issue(self, path: KeyPath, message: str) -> RecipeIssue:
        file, line = self.where(path)
        return RecipeIssue(file=file, key=".".join(path), message=message, line=line)


def read_source(path: Path) -> Source:
    """Load `path` and the recipes it extends; raise RecipeError on any syntax or file problem."""
    return _read(Path(path), chain=())


def _read(path: Path, chain: tuple[Path, ...]) -> Source:
    shown = str(path)
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise RecipeError([RecipeIssue(shown, "extends", f"recipes extend each other in a cycle: {cycle}")])
    text = _read_text(path)
    node = _compose(text, shown)
    if node is None:
        tree: dict[str, Any] = {}
        origin: dict[KeyPath, tuple[str, int]] = {}
    elif not isinstance(node, yaml.MappingNode):
        line = node.start_mark.line + 1
        raise RecipeError([RecipeIssue(shown, "", "a recipe must be a mapping of sections (cluster:, model:, ...)", line)])
    else:
        origin = {}
        issues: list[RecipeIssue] = []
        tree = _to_python(node, (), shown, origin, issues)
        if issues:
            raise RecipeError(issues)

    bases = tree.pop("extends", None)
    if bases is None:
        return Source(tree=tree, origin=origin, root_file=shown)
    base_paths = [bases] if isinstance(bases, str) else bases
    if not isinstance(base_paths, list) or not all(isinstance(b, str) for b in base_paths):
        file, line = origin.get(("extends",), (shown, None))
        raise RecipeError([RecipeIssue(file, "extends", "expected a recipe path or a list of recipe paths", line)])

    merged = Source(tree={}, root_file=shown)
    for base in base_paths:
        base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
        if not base_path.is_file():
            file, line = origin.get(("extends",), (shown, None))
            raise RecipeError([RecipeIssue(file, "extends", f"extended recipe not found: {base_path}", line)])
        _merge(merged, _read(base_path, (*chain, resolved)))
    _merge(merged, Source(tree=tree, origin=origin, root_file=shown))
    merged.root_file = shown
    return merged


def _read_text(path: Path) -> str:
    shown = str(path)
    if not path.exists():
        raise RecipeError([RecipeIssue(shown, "", "recipe file not found")])
    if not path.is_file():
        raise RecipeError([RecipeIssue(shown, "", "not a file")])
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError([RecipeIssue(shown, "", f"larger than {MAX_RECIPE_BYTES} bytes: not a recipe")])
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise RecipeError([RecipeIssue(shown, "", f"not UTF-8 text ({err.reason} at byte {err.start})")]) from None
    except OSError as err:
        raise RecipeError([RecipeIssue(shown, "", f"cannot read: {err.strerror}")]) from None


def _compose(text: str, shown: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark else None
        problem = err.problem or str(err)
        raise RecipeError([RecipeIssue(shown, "", f"YAML syntax error: {problem}", line)]) from None
    except yaml.YAMLError as err:
        raise RecipeError([RecipeIssue(shown, "", f"YAML error: {err}")]) from None


def _to_python(
    node: yaml.Node, path: KeyPath, shown: str, origin: dict[KeyPath, tuple[str, int]], issues: list[RecipeIssue]
) -> Any:
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str) or not key or key_node.tag != "tag:yaml.org,2002:str":
                issues.append(RecipeIssue(shown, ".".join(path), f"keys must be plain names, got {key!r}", line))
                continue
            if key in out:
                issues.append(RecipeIssue(shown, ".".join((*path, key)), "key given twice", line))
                continue
            origin[(*path, key)] = (shown, line)
            out[key] = _to_python(value_node, (*path, key), shown, origin, issues)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, path, shown, origin, issues) for item in node.value]
    # Scalars: the safe constructor gives YAML's own types (int, float, bool, None, str, date).
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _merge(into: Source, top: Source) -> None:
    _merge_tree(into.tree, top.tree)
    for key_path, where in top.origin.items():
        into.origin[key_path] = where


def _merge_tree(into: dict[str, Any], top: dict[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge_tree(into[key], value)
        else:
            into[key] = value
