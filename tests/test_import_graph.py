"""The package's layers: no two subpackages (or top-level modules) of oobleck_slurm import each other,
directly or round a cycle. Every import counts, at module level or inside a function: a cycle of
lazy imports still means two layers that know each other. Read from the source with ast (nothing
is imported)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "oobleck_slurm"


def unit_of(module: str) -> str | None:
    """The layer a module `oobleck_slurm.x[.y...]` belongs to: its subpackage, or the top-level module."""
    parts = module.split(".")
    if parts[0] != "oobleck_slurm" or len(parts) < 2:
        return None
    return parts[1]


def imported_modules(path: Path) -> Iterator[str]:
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package upwards
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                yield ".".join([*base, *([node.module] if node.module else [])])
            elif node.module:
                yield node.module
                # `from oobleck_slurm import x` names a subpackage or module x
                if node.module == "oobleck_slurm":
                    yield from (f"oobleck_slurm.{alias.name}" for alias in node.names)


def units() -> set[str]:
    """The package's layers: its subpackages and its top-level modules."""
    return {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} | {
        p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}


def import_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    known = units()
    graph: dict[str, set[str]] = {unit: set() for unit in known}
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if unit not in known:
            continue
        graph[unit] |= {other for module in imported_modules(path)
                        if (other := unit_of(module)) in known and other != unit}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one unit (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for other in sorted(graph.get(unit, ())):
            if other not in index:
                visit(other)
                low[unit] = min(low[unit], low[other])
            elif other in stack:
                low[unit] = min(low[unit], index[other])
        if low[unit] == index[unit]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in sorted(graph):
        if unit not in index:
            visit(unit)
    return found


def test_no_subpackage_cycle() -> None:
    graph = import_graph()
    assert {"supervisor", "cluster", "protocol", "engine"} <= set(graph)  # the scan sees the package
    found = cycles(graph)
    detail = "; ".join(" <-> ".join(c) + " (" + ", ".join(
        f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) + ")" for c in found)
    assert not found, f"import cycles between oobleck_slurm's layers: {detail}"


def test_the_job_folder_and_slurm_know_nothing_above_them() -> None:
    """cluster/ (job folder, Slurm) and protocol/ are below the supervisor, engine and commands; only
    the exception hierarchy, the exit codes and the job's timeouts (errors.py, exit_codes.py,
    timeouts.py) are below them."""
    graph = import_graph()
    bottom = {"errors", "exit_codes", "timeouts"}
    assert graph["errors"] <= {"exit_codes"} and not graph["exit_codes"], (graph["errors"], graph["exit_codes"])
    assert not graph["timeouts"], graph["timeouts"]
    assert graph["cluster"] <= {"recipe"} | bottom, graph["cluster"]
    assert graph["protocol"] <= {"cluster"} | bottom, graph["protocol"]


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_core_imports_no_hugging_face_library() -> None:
    """transformers and tokenizers are the optional `hf` extra: a job that uses neither a Hugging Face
    folder nor a tokenizer.json loads the CLI, the models, the worker and the supervisor without them."""
    import subprocess
    import sys

    code = ("import sys, oobleck_slurm.cli, oobleck_slurm.models, oobleck_slurm.models.hf, "
            "oobleck_slurm.engine.worker, oobleck_slurm.engine.elastic_process, oobleck_slurm.supervisor.main, "
            "oobleck_slurm.commands.export, oobleck_slurm.data; "
            "print(sorted(m for m in ('transformers', 'tokenizers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---- modules ------------------------------------------------------------------------------------
# The same rule one level down: no module of the package imports itself round a circle of other
# modules. Counted: every import that can run, at module level or inside a function (a lazy import
# still runs, and still means two modules that know each other). Not counted: imports under
# `if TYPE_CHECKING:` (they never run: a module names a type of one that calls it, as a family's
# model.py names its config), and the implicit import of a module's parent packages (a package's
# __init__ importing its own submodules is how a package shows its face, not a dependency of them).


def package_modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the package (a package by its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module that can run: anywhere but the body of `if TYPE_CHECKING:`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def module_graph() -> dict[str, set[str]]:
    """module -> the package's other modules it imports (see above for what counts)."""
    modules = package_modules()

    def known(name: str) -> str | None:  # the longest known module a dotted name starts with
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from a.b import c` imports the module a.b.c when there is one, else a name of a.b
            targets += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                        for alias in node.names]
        graph[name] = {t for target in targets if (t := known(target)) and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A depth-first search: for each edge back to a module on the current path, that cycle as the path
    [a, b, ..., a]. Every graph with a cycle has such an edge, so none means no cycle."""
    on_path: dict[str, bool] = {}  # visited modules: True while on the current path
    path: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        on_path[node] = True
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if on_path.get(nxt):
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in on_path:
                visit(nxt)
        path.pop()
        on_path[node] = False

    for node in sorted(graph):
        if node not in on_path:
            visit(node)
    return found


def test_no_module_import_cycle() -> None:
    graph = module_graph()
    assert len(graph) > 100 and "oobleck_slurm.models.hf" in graph  # the scan sees the package
    found = find_cycles(graph)
    assert not found, "import cycles between oobleck_slurm's modules:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_module_graph_counts_lazy_imports_and_not_type_only_ones() -> None:
    graph = module_graph()
    # GPTConfig.build_layers imports model.py inside the method; model.py names GPTConfig for mypy only
    assert "oobleck_slurm.models.gpt.model" in graph["oobleck_slurm.models.gpt.config"]
    assert "oobleck_slurm.models.gpt.config" not in graph["oobleck_slurm.models.gpt.model"]
    # `from oobleck_slurm.planning import cost` is the module cost, not the package's __init__
    assert "oobleck_slurm.planning.cost" in graph["oobleck_slurm.planning.templates"]
    assert "oobleck_slurm.planning" not in graph["oobleck_slurm.planning.templates"]


def test_the_module_cycle_finder_lists_each_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"c"}}) == [["a", "b", "a"], ["c", "c"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
