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

# Limits on what a recipe file may hold. Real recipes are a page of YAML (a few kB, nesting depth 4,
# a hundred values); these are far above that and far below what could exhaust memory, the Python
# stack or a minute of CPU, whatever a wrong or hostile file holds.
MAX_RECIPE_BYTES = 256 * 1024  # a recipe is a page of YAML; anything bigger is a wrong file
MAX_RECIPE_DEPTH = 32  # nested mappings/lists; PyYAML's composer recurses once per level
MAX_RECIPE_EVENTS = 50_000  # YAML parser events (scalars, collection starts and ends) per file
MAX_RECIPE_VALUES = 100_000  # values after aliases are expanded (`billion laughs` stays bounded)
MAX_EXTENDS_DEPTH = 16  # a recipe extends a recipe that extends ... (each level is a recursive read)
MAX_EXTENDED_FILES = 64  # files read for one recipe, extends of extends included (diamonds repeat)


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
    return _read(Path(path), chain=(), budget=[MAX_EXTENDED_FILES])


def _read(path: Path, chain: tuple[Path, ...], budget: list[int]) -> Source:
    shown = str(path)
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise RecipeError([RecipeIssue(shown, "extends", f"recipes extend each other in a cycle: {cycle}")])
    if len(chain) > MAX_EXTENDS_DEPTH:
        raise RecipeError([RecipeIssue(shown, "extends", f"extends chain deeper than {MAX_EXTENDS_DEPTH} recipes")])
    budget[0] -= 1
    if budget[0] < 0:
        raise RecipeError([RecipeIssue(shown, "extends", f"more than {MAX_EXTENDED_FILES} recipe files extended")])
    text = _read_text(path)
    node = _compose(text, shown)
    if node is None:
        # Only comments or blanks: most likely a truncated or wrong file. The defaults are what
        # running without a recipe gives, so an empty file is never needed to ask for them.
        raise RecipeError([RecipeIssue(shown, "", "the recipe is empty (no sections); give no recipe for the "
                                       "defaults, or write `{}` for a recipe of defaults only")])
    if not isinstance(node, yaml.MappingNode):
        line = node.start_mark.line + 1
        raise RecipeError([RecipeIssue(shown, "", "a recipe must be a mapping of sections (cluster:, model:, ...)", line)])
    else:
        origin: dict[KeyPath, tuple[str, int]] = {}
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
            why = "extended recipe is not a file" if base_path.exists() else "extended recipe not found"
            raise RecipeError([RecipeIssue(file, "extends", f"{why}: {base_path}", line)])
        _merge(merged, _read(base_path, (*chain, resolved), budget))
    _merge(merged, Source(tree=tree, origin=origin, root_file=shown))
    merged.root_file = shown
    return merged


def _read_text(path: Path) -> str:
    shown = str(path)
    if not path.exists():
        raise RecipeError([RecipeIssue(shown, "", "recipe file not found")])
    if path.is_dir():
        raise RecipeError([RecipeIssue(shown, "", "is a directory, not a recipe file")])
    if not path.is_file():  # a FIFO or a device would block or never end
        raise RecipeError([RecipeIssue(shown, "", "not a regular file")])
    try:
        with path.open("rb") as file:
            # Read one byte past the limit rather than trusting st_size: the file may be growing.
            data = file.read(MAX_RECIPE_BYTES + 1)
    except OSError as err:
        raise RecipeError([RecipeIssue(shown, "", f"cannot read: {err.strerror or err}")]) from None
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError([RecipeIssue(shown, "", f"larger than {MAX_RECIPE_BYTES} bytes: not a recipe")])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise RecipeError([RecipeIssue(shown, "", f"not UTF-8 text ({err.reason} at byte {err.start})", line)]) from None
    if "\x00" in text:  # YAML forbids NUL; say it plainly rather than as a parser complaint
        raise RecipeError([RecipeIssue(shown, "", "binary data (NUL bytes), not a YAML recipe", text.count("\n", 0, text.index("\x00")) + 1)])
    return text


def _compose(text: str, shown: str) -> yaml.Node | None:
    try:
        _check_shape(text, shown)
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark else None
        problem = err.problem or str(err)
        if err.context and err.problem:  # "expected a single document in the stream, but found another document"
            problem = f"{err.context}, {err.problem}"
        raise RecipeError([RecipeIssue(shown, "", f"YAML syntax error: {problem}", line)]) from None
    except yaml.YAMLError as err:
        raise RecipeError([RecipeIssue(shown, "", f"YAML error: {err}")]) from None


def _check_shape(text: str, shown: str) -> None:
    """Refuse, before composing, what would exhaust the stack, memory or time later.

    PyYAML's parser is iterative but its composer recurses once per nesting level, and an alias is
    one node however much it stands for: `&x [*x]` is a cycle and nine levels of nine aliases are
    387 million values once expanded. One pass over the parser's events bounds the depth, the
    number of events, and the expanded size of every anchored node; a self-reference is an alias
    met while its own anchor is still open.
    """
    depth = 0
    events = 0
    open_anchors: list[str | None] = []  # anchor of each open collection (None: no anchor)
    sizes: list[int] = [0]  # expanded values inside each open collection; [0] is the document level
    heights: list[int] = [0]  # expanded nesting below each open collection
    anchored: dict[str, tuple[int, int]] = {}  # anchor -> (expanded size, height) of the node it names
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        events += 1
        line = event.start_mark.line + 1 if event.start_mark else None
        if events > MAX_RECIPE_EVENTS:
            raise RecipeError([RecipeIssue(shown, "", f"more than {MAX_RECIPE_EVENTS} YAML values: not a recipe", line)])
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_RECIPE_DEPTH:
                raise RecipeError([RecipeIssue(shown, "", f"nested deeper than {MAX_RECIPE_DEPTH} levels", line)])
            open_anchors.append(event.anchor)
            sizes.append(1)
            heights.append(0)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
            anchor, size, height = open_anchors.pop(), sizes.pop(), heights.pop() + 1
            if anchor is not None:
                anchored[anchor] = (size, height)
            sizes[-1] += size
            heights[-1] = max(heights[-1], height)
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                anchored[event.anchor] = (1, 0)
            sizes[-1] += 1
        elif isinstance(event, yaml.AliasEvent) and event.anchor is not None:  # an alias always names one
            if event.anchor in open_anchors:
                raise RecipeError([RecipeIssue(
                    shown, "", f"alias *{event.anchor} refers to a node that contains it (a cycle)", line)])
            size, height = anchored.get(event.anchor, (1, 0))  # an undefined one is the composer's to report
            # An alias nests its node's whole depth here: chained aliases must not sum past the limit.
            if depth + height > MAX_RECIPE_DEPTH:
                raise RecipeError([RecipeIssue(
                    shown, "", f"alias *{event.anchor} nests values deeper than {MAX_RECIPE_DEPTH} levels", line)])
            sizes[-1] += size
            heights[-1] = max(heights[-1], height)
        if sum(sizes) > MAX_RECIPE_VALUES:
            raise RecipeError([RecipeIssue(
                shown, "", f"aliases expand to more than {MAX_RECIPE_VALUES} values: not a recipe", line)])


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
    try:
        return yaml.SafeLoader("").construct_object(node, deep=True)
    except Exception as err:  # noqa: BLE001 - an unknown tag, `!!int abc`, `!!timestamp x`: all the user's input
        line = node.start_mark.line + 1
        what = err.problem if isinstance(err, yaml.MarkedYAMLError) and err.problem else str(err)
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        issues.append(RecipeIssue(shown, ".".join(path), f"cannot read {node.value!r} tagged {tag}: {what}", line))
        return None


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
