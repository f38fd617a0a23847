"""Turn a merged recipe tree into typed, frozen config objects, collecting every issue."""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
import typing
from collections import abc
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import MappingProxyType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from oobleck_slurm.errors import BadInputError
from oobleck_slurm.models import PRESETS, GPTConfig
from oobleck_slurm.recipe import schema
from oobleck_slurm.recipe.errors import RecipeError, RecipeIssue
from oobleck_slurm.recipe.source import KeyPath, Source

_SECTIONS = typing.get_type_hints(schema.Recipe)


UNKNOWN_KEY = "unknown key"
# Integers beyond 64 bits fit no seed, count or C library call downstream; refuse them here.
MAX_RECIPE_INT = 2**63 - 1
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._+-]+")


class _Invalid(BadInputError):
    """A value does not fit its field; carries the message for the issue list."""


def build_recipe(source: Source) -> schema.Recipe:
    """Validate `source` and return the Recipe, or raise RecipeError listing every issue found."""
    issues: list[RecipeIssue] = []
    tree = dict(source.tree)
    # The name becomes part of a folder name: a default made from the file name keeps only safe characters.
    tree.setdefault("name", _UNSAFE_NAME_CHARS.sub("-", Path(source.root_file).stem).strip("-.") or "job")
    recipe = _build(schema.Recipe, tree, (), source, issues)
    # Contradictions are judged on valid values only: a bad value was replaced by its default, and a
    # message about that default would mislead. Unknown keys change no value.
    if all(issue.message.startswith(UNKNOWN_KEY) for issue in issues):
        recipe = _resolve_paths(recipe, source)  # files named by the recipe are checked where they are
        issues.extend(cross_checks(recipe, source))
    if issues:
        raise RecipeError(sorted(issues, key=lambda i: (i.file != source.root_file, i.file, i.line or 0)))
    return recipe


def _build(cls: type, raw: Any, path: KeyPath, source: Source, issues: list[RecipeIssue]) -> Any:
    if raw is None:  # an empty section (`training:`) means all defaults
        raw = {}
    if not isinstance(raw, dict):
        issues.append(source.issue(path, f"expected a mapping of {cls.__name__} keys, got {_describe(raw)}"))
        return cls()
    hints = typing.get_type_hints(cls)
    public = [f for f in fields(cls) if not f.metadata.get("internal")]
    names = [f.name for f in public]
    for key in raw:
        if key not in names:
            issues.append(source.issue((*path, key), _unknown_key_message(key, names, path)))
    values: dict[str, Any] = {}
    for f in public:
        if f.name not in raw:
            continue
        key_path = (*path, f.name)
        try:
            value = _convert(hints[f.name], raw[f.name], key_path, source, issues)
        except _Invalid as bad:
            issues.append(source.issue(key_path, str(bad)))
            continue
        problem = f.metadata["check"](value) if "check" in f.metadata else None
        if problem:
            issues.append(source.issue(key_path, problem))
            continue
        values[f.name] = value
    return cls(**values)


def _convert(tp: Any, value: Any, path: KeyPath, source: Source, issues: list[RecipeIssue]) -> Any:
    origin = get_origin(tp)
    if isinstance(tp, type) and is_dataclass(tp):
        return _build(tp, value, path, source, issues)
    if origin in (Union, UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(options[0], value, path, source, issues)
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        raise _Invalid(f"expected one of {', '.join(map(repr, choices))}, got {value!r}{suggestion}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Invalid(f"expected true or false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_RECIPE_INT:
                raise _Invalid(f"integer out of range (more than 64 bits): {value}")
            return value
        raise _Invalid(f"expected an integer, got {_describe(value)}")
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer too big for a float
                raise _Invalid(f"number out of range: {value}") from None
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise _Invalid(f"expected a number, got {_describe(value)}")
        if not math.isfinite(number):  # .inf, 1e400, nan: no rate, timeout or clip means that
            raise _Invalid(f"expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise _Invalid(f"expected a string, got {_describe(value)}")
    if origin is tuple:
        item_type = get_args(tp)[0]
        items = value if isinstance(value, list) else [value]
        return tuple(_convert(item_type, item, path, source, issues) for item in items)
    if origin in (dict, abc.Mapping):
        if not isinstance(value, dict):
            raise _Invalid(f"expected a mapping, got {_describe(value)}")
        value_type = get_args(tp)[1]
        if value_type is not Any:
            # sbatch values are strings Slurm reads (`exclusive: true` -> ''); numeric maps keep numbers.
            value = {k: _convert(value_type, _scalar_text(v) if value_type is str else v, (*path, k), source, issues)
                     for k, v in value.items()}
        return MappingProxyType(dict(value))  # read-only, like the frozen dataclass that holds it
    if tp is Any:
        return value
    raise TypeError(f"recipe schema uses an unsupported type {tp!r} at {'.'.join(path)}")


def _scalar_text(value: Any) -> Any:
    # sbatch option values: `exclusive: true` or `gres: 4` mean the strings Slurm expects.
    if isinstance(value, bool):
        return "" if value else value
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _unknown_key_message(key: str, names: list[str], path: KeyPath) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f"{UNKNOWN_KEY}; did you mean {'.'.join((*path, close[0]))!r}?"
    # A key placed in the wrong section is a common slip: look in the other sections too.
    for section, section_type in _SECTIONS.items():
        if is_dataclass(section_type) and key in {f.name for f in fields(section_type)}:
            return f"{UNKNOWN_KEY} here; did you mean '{section}.{key}'?"
    where = ".".join(path) or "the top level"
    return f"{UNKNOWN_KEY}; {where} accepts: {', '.join(names)}"


def cross_checks(recipe: schema.Recipe, source: Source) -> list[RecipeIssue]:
    """Contradictions between fields, caught at load time rather than minutes into a job."""
    issues: list[RecipeIssue] = []
    add = lambda path, msg: issues.append(source.issue(path, msg))  # noqa: E731
    c, m, t, ft = recipe.cluster, recipe.model, recipe.training, recipe.fault_tolerance

    if recipe.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        add(("logging", "tensorboard"), "the `tensorboard` package is not installed (pip install "
            "'oobleck-slurm[tensorboard]'), or set it to false")
    if recipe.logging.wandb is not None and importlib.util.find_spec("wandb") is None:
        add(("logging", "wandb"), "the `wandb` package is not installed (pip install 'oobleck-slurm[wandb]'), "
            "or remove the key")
    if t.global_batch_size % t.microbatch_size:
        add(("training", "microbatch_size"),
            f"global_batch_size {t.global_batch_size} is not divisible by microbatch_size {t.microbatch_size}")
    elif t.global_microbatches < ft.f + 1:
        add(("training", "global_batch_size"),
            f"{t.global_microbatches} microbatches cannot feed f+1={ft.f + 1} pipelines (each needs at least one)")
    if ft.f >= c.nodes:
        add(("fault_tolerance", "f"),
            f"f={ft.f} needs at least f+1={ft.f + 1} nodes (one pipeline each), but cluster.nodes is {c.nodes}")
    if c.gpus_per_node and c.workers_per_node is not None and c.workers_per_node != c.gpus_per_node:
        add(("cluster", "workers_per_node"),
            f"one worker runs per GPU: with gpus_per_node {c.gpus_per_node}, workers_per_node must be "
            f"{c.gpus_per_node} or left out, got {c.workers_per_node}")
    if c.max_stage_devices is None:
        pass  # the default: the planner picks widths that divide the node's devices and the microbatch
    elif c.devices_per_node % c.max_stage_devices:
        add(("cluster", "max_stage_devices"),
            f"must divide the devices per node ({c.devices_per_node}), got {c.max_stage_devices}")
    else:
        # the widths the planner may pick (planning/templates.allowed_stage_devices); the engine splits
        # each microbatch's samples evenly over a stage, except a whole node's only stage, which may
        # compute several microbatches per pass (templates.folded_width)
        wide = [g for g in range(2, c.max_stage_devices + 1) if c.devices_per_node % g == 0]
        if uneven := [g for g in wide if t.microbatch_size % g and g != c.devices_per_node]:
            add(("cluster", "max_stage_devices"),
                f"a stage of g workers splits each microbatch between them: microbatch_size {t.microbatch_size} "
                f"is not a multiple of the stage width(s) {uneven} (lower max_stage_devices or raise microbatch_size)")
    nodes = {f"node{i + 1}" for i in range(c.nodes + c.spare_nodes)}
    for drill in recipe.drills:
        if c.backend == "local" and drill.node not in nodes:
            add(("drills",), f"drill node {drill.node!r} is not a node of this job (node1 .. node{c.nodes + c.spare_nodes})")
        if drill.step >= recipe.training.steps:
            add(("drills",), f"drill at step {drill.step} never fires: training.steps is {recipe.training.steps}")
        if drill.how == "supervisor" and c.backend == "slurm" and not c.supervisor.failover:
            add(("drills",), "a supervisor drill on Slurm needs a standby: set cluster.supervisor.failover: true "
                             "(docs/failover.md)")
        if drill.how in ("worker", "hang") and drill.worker >= c.devices_per_node:
            add(("drills",), f"drill worker {drill.worker} does not exist: {c.devices_per_node} worker(s) per node")
    if ft.replacement == "spare" and c.spare_nodes == 0:
        add(("fault_tolerance", "replacement"), "'spare' needs cluster.spare_nodes >= 1")
    issues += _cluster_issues(recipe, source)

    order = [("collective_timeout", ft.collective_timeout), ("heartbeat_lease", ft.heartbeat_lease),
             ("step_timeout", ft.step_timeout), ("reconfiguration_timeout", ft.reconfiguration_timeout)]
    for (low_name, low), (high_name, high) in zip(order, order[1:]):
        if not low < high:
            add(("fault_tolerance", high_name),
                f"timeouts must nest: {low_name} ({low:g} s) < {high_name} ({high:g} s) is required")
    if not ft.heartbeat_interval < ft.heartbeat_lease:
        add(("fault_tolerance", "heartbeat_lease"),
            f"must exceed heartbeat_interval ({ft.heartbeat_interval:g} s), got {ft.heartbeat_lease:g} s")

    det = recipe.detection
    for key in ("window", "continuity"):
        if getattr(det, key) < det.interval:
            add(("detection", key), f"must be at least detection.interval ({det.interval:g} s), got {getattr(det, key):g} s")

    opt = t.optimizer
    want_betas, want_eps = {"adamw": (2, 1), "came": (3, 2)}[opt.name]
    if opt.betas is not None:
        if len(opt.betas) != want_betas:
            add(("training", "optimizer", "betas"), f"{opt.name} takes {want_betas} betas, got {len(opt.betas)}")
        elif not all(0 <= b < 1 for b in opt.betas):
            add(("training", "optimizer", "betas"), f"each beta must be in [0, 1), got {list(opt.betas)}")
    if opt.eps is not None:
        if len(opt.eps) != want_eps:
            add(("training", "optimizer", "eps"), f"{opt.name} takes {want_eps} eps value(s), got {len(opt.eps)}")
        elif not all(e > 0 for e in opt.eps):
            add(("training", "optimizer", "eps"), f"each eps must be > 0, got {list(opt.eps)}")
    if recipe.data.validation and not t.eval_interval:
        add(("data", "validation"), "is evaluated every training.eval_interval steps, which is 0 (never)")
    if t.loss_spike is not None and t.loss_spike.warmup > t.loss_spike.window:
        add(("training", "loss_spike", "warmup"),
            f"{t.loss_spike.warmup} accepted losses cannot be had in a window of {t.loss_spike.window} "
            f"(training.loss_spike.window): warmup must be <= window")
    if t.lr_schedule.warmup_steps > t.steps:
        add(("training", "lr_schedule", "warmup_steps"),
            f"{t.lr_schedule.warmup_steps} warmup steps exceed training.steps ({t.steps})")
    if t.lr_schedule.min_lr > opt.lr:
        add(("training", "lr_schedule", "min_lr"), f"min_lr {t.lr_schedule.min_lr:g} exceeds optimizer.lr {opt.lr:g}")

    model_issues = _model_issues(m, source)
    issues += model_issues
    if not model_issues and m.factory is None and not recipe.data.path and not recipe.data.sources:
        # The byte tokenizer's ids run to 255: the model's vocabulary must hold them.
        uses_bytes = recipe.data.tokenizer == "byte" and not (m.hf and (Path(m.hf) / "tokenizer.json").is_file())
        vocab = m.resolve().vocab_size
        if uses_bytes and vocab < 256:
            add(("data", "tokenizer"), f"the byte tokenizer's ids run to 255, but the model's vocab_size is {vocab}: "
                                       f"give a tokenizer.json (data.tokenizer) or a larger vocabulary")

    d = recipe.data
    if d.eos_id is not None and not d.document_mask:
        add(("data", "eos_id"), "is used only by data.document_mask, which is false")
    if d.document_mask and m.factory is not None:
        add(("data", "document_mask"), "needs the gpt or llama family (or model.hf): a factory's layers take one "
                                       "tensor, not a microbatch's documents")
    elif d.eos_id is not None and not model_issues and d.eos_id >= (vocab := m.resolve().vocab_size):
        add(("data", "eos_id"), f"{d.eos_id} is not a token of the model's vocabulary (vocab_size {vocab})")
    if d.path and d.text:
        add(("data", "text"), "give data.path (a prepared token file) or data.text (a text file), not both")
    for key in ("path", "text", "validation"):
        value = getattr(d, key)
        found = _data_file(source, key, value) if value else None
        # data.path may also name a prepared set: a Megatron prefix (PREFIX.idx beside PREFIX.bin), a folder
        # or a glob of shards (data/dataset.py is_prepared_set)
        if found is not None and not (found.is_file() or (key == "path" and _source_exists(found))):
            add(("data", key), f"file not found: {found}" + (" (nor a prepared set: PREFIX.idx/.bin, a folder "
                                                             "or a glob of shards)" if key == "path" else ""))
    issues += _source_issues(recipe, source)
    if _is_tokenizer_path(d.tokenizer):
        found = Path(d.tokenizer)
        if not (found.is_file() or (found / "tokenizer.json").is_file()):
            add(("data", "tokenizer"), f"no Hugging Face tokenizer at {found} (a tokenizer.json, or a folder holding one)")
    elif d.tokenizer != "byte" and schema.factory_string(d.tokenizer):
        add(("data", "tokenizer"), f"expected 'byte', a tokenizer.json path or 'package.module:function', "
                                   f"got {d.tokenizer!r}")
    return issues


def _cluster_issues(recipe: schema.Recipe, source: Source) -> list[RecipeIssue]:
    """The job as Slurm will run it: the time-limit notice, the centre's longest time limit, and one
    network domain for the whole job on HPE Slingshot (docs/slurm.md, "One network domain per job")."""
    issues: list[RecipeIssue] = []
    add = lambda path, msg: issues.append(source.issue(path, msg))  # noqa: E731
    c, ft = recipe.cluster, recipe.fault_tolerance
    limit = schema.slurm_seconds(c.time)
    if c.signal_delay_s >= limit:
        add(("cluster", "signal_delay_s"), f"the time-limit notice must come before the limit: {c.signal_delay_s} s "
                                           f"is not less than cluster.time {c.time!r} ({limit} s)")
    if c.max_time is not None and limit > schema.slurm_seconds(c.max_time):
        add(("cluster", "time"), f"{c.time!r} exceeds cluster.max_time {c.max_time!r}, the longest time limit the "
                                 f"centre grants this job: lower it (requeues continue the run), or raise max_time "
                                 f"where the centre allows more (e.g. more nodes)")
    if c.backend == "slurm" and c.network and schema.JOB_VNI in c.network.split(","):
        # A job VNI is the job's own (Slurm's switch/hpe_slingshot): another job cannot join it.
        if ft.replacement == "request":
            add(("fault_tolerance", "replacement"),
                "'request' starts a replacement as a job of its own, and on HPE Slingshot (cluster.network has "
                "job_vni) its workers cannot reach this job's: use cluster.spare_nodes >= 1 with replacement: "
                "spare, or replacement: none")
        if c.supervisor.failover:
            add(("cluster", "supervisor", "failover"),
                "failover runs every training node as a job of its own, and on HPE Slingshot (cluster.network has "
                "job_vni) workers of different jobs cannot reach each other: set it to false")
    return issues


def _source_issues(recipe: schema.Recipe, source: Source) -> list[RecipeIssue]:
    """data.sources: one way of giving the data, a path each, weights on all or none. Whether each
    source exists is checked here for a local job; a Slurm job's data lives on the cluster's file
    system, which the machine running `validate` may not see: the job checks it at its start."""
    issues: list[RecipeIssue] = []
    d = recipe.data
    if not d.sources:
        return issues
    add = lambda msg: issues.append(source.issue(("data", "sources"), msg))  # noqa: E731
    if d.path or d.text:
        add("give data.sources, or data.path / data.text (one source), not both")
    given = [s.weight is not None for s in d.sources]
    if any(given) and not all(given):
        add("give every source a weight, or none (then each weighs in proportion to its size)")
    for i, s in enumerate(d.sources):
        if not s.path:
            add(f"source {i + 1} has no path")
        elif recipe.cluster.backend == "local" and not _source_exists(found := _recipe_path(source, ("data", "sources"), s.path)):
            add(f"source {i + 1}: nothing found at {found} (a token file, a glob of them or a prepared folder)")
    return issues


def _source_exists(path: Path) -> bool:
    import glob

    return path.exists() or Path(f"{path}.idx").is_file() or bool(glob.glob(str(path)))


def data_issues(recipe: schema.Recipe) -> list[RecipeIssue]:
    """The data a job that can run must name (`validate` and `submit`, not `plan`): a Slurm job trains
    on data given by the recipe; the shipped text is the default of local jobs only."""
    d = recipe.data
    if recipe.cluster.backend != "slurm" or d.path or d.text or d.sources:
        return []
    from oobleck_slurm.recipe.source import read_source

    return [read_source(Path(recipe.source)).issue(("data",), (
        "a Slurm job needs training data, and this recipe names none (the shipped text is for local jobs): "
        "give data.path (a prepared token file: `python -m oobleck_slurm prepare TEXT OUT.bin`), "
        "data.sources ([{path: ..., weight: ...}, ...]: token files, globs or prepared folders), "
        "or data.text (a text file, prepared on first use)"))]


def _model_issues(m: schema.ModelConfig, source: Source) -> list[RecipeIssue]:
    """The model section: one way of giving the model (family and size, `hf` or `factory`), the keys
    that way takes, and a definition that can be made from them. A factory's layers are checked by
    `models.inspect_factory` (it imports the user's code, so not here)."""
    issues: list[RecipeIssue] = []
    add = lambda key, msg: issues.append(source.issue(("model", key), msg))  # noqa: E731
    defaults = schema.ModelConfig()
    given = {f.name for f in fields(m)  # set, to something else than the default (a job's recipe copy has every key)
             if ("model", f.name) in source.origin and getattr(m, f.name) != getattr(defaults, f.name)}
    if m.hf is not None and m.factory is not None:
        add("factory", "give model.hf (a Hugging Face folder) or model.factory (your own layers), not both")
        return issues
    if m.kwargs and not m.factory:
        add("kwargs", "kwargs are passed to model.factory, which is not set")
    if m.hf is not None or m.factory is not None:
        way = "hf" if m.hf is not None else "factory"
        applies = {"seq_len"} if way == "hf" else {"seq_len", "vocab_size"}
        for key in sorted(given & ({"family", "size"} | set(schema.ALL_SHAPE_KEYS)) - applies):
            what = "its config.json" if way == "hf" else "the factory"
            add(key, f"model.{way} takes the model's shape from {what}: remove model.{key} (beside model.{way}, "
                     f"only {' and '.join(sorted(applies))} apply)")
    else:
        presets = PRESETS[m.family]
        if m.size not in presets:
            add("size", f"unknown {m.family} size {m.size!r}; known: {', '.join(presets)}")
            return issues
        for key in sorted(set(m.overrides()) - set(schema.SHAPE_KEYS[m.family])):
            add(key, f"the {m.family} family has no {key!r}; its shape keys: {', '.join(schema.SHAPE_KEYS[m.family])}")
    if issues:
        return issues
    try:
        cfg = m.resolve()
    except ValueError as err:  # a Hugging Face folder that cannot be read, or a shape that contradicts itself
        key = "hf" if m.hf is not None else next((k for k in ("n_head", "n_kv_heads", "d_model") if k in given), "size")
        add(key, str(err))
        return issues
    d_model, n_head = getattr(cfg, "d_model", None), getattr(cfg, "n_head", None)
    if isinstance(cfg, GPTConfig) and d_model is not None and n_head is not None and d_model % n_head:
        add("n_head", f"d_model {d_model} is not divisible by n_head {n_head}")
    return issues


def _is_tokenizer_path(value: str) -> bool:
    """A Hugging Face tokenizer.json, or a folder holding one written as a path ('./tok')."""
    return value.endswith(".json") or "/" in value


def _data_file(source: Source, key: str, value: str) -> Path:
    return _recipe_path(source, ("data", key), value)


def _recipe_path(source: Source, key: KeyPath, value: str) -> Path:
    # Relative paths are relative to the recipe file that named them, not to the caller's cwd.
    file, _ = source.where(key)
    path = Path(value).expanduser()
    return path if path.is_absolute() else (Path(file).parent / path).resolve()


def _resolve_paths(recipe: schema.Recipe, source: Source) -> schema.Recipe:
    from dataclasses import replace

    data, model = recipe.data, recipe.model
    resolved: dict[str, Any] = {key: str(_data_file(source, key, getattr(data, key)))
                                for key in ("path", "text", "validation") if getattr(data, key)}
    if _is_tokenizer_path(data.tokenizer):
        resolved["tokenizer"] = str(_recipe_path(source, ("data", "tokenizer"), data.tokenizer))
    if model.hf is not None:
        model = replace(model, hf=str(_recipe_path(source, ("model", "hf"), model.hf)))
    sources = tuple(replace(s, path=str(_recipe_path(source, ("data", "sources"), s.path)) if s.path else s.path)
                    for s in data.sources)
    ft = recipe.fault_tolerance
    if ft.resume_from:
        try:
            ft = replace(ft, resume_from=str(_recipe_path(source, ("fault_tolerance", "resume_from"), ft.resume_from)))
        except (RuntimeError, ValueError, OSError):
            pass  # "~nobody/...", a NUL byte: submit names it as a checkpoint that does not exist
    return replace(recipe, data=replace(data, **resolved, sources=sources), model=model, fault_tolerance=ft,
                   source=source.root_file)


def recipe_to_dict(obj: Any) -> Any:
    """Plain, JSON-ready values of a recipe (or any of its sections)."""
    if is_dataclass(obj):
        return {f.name: recipe_to_dict(getattr(obj, f.name)) for f in fields(obj) if not f.metadata.get("internal")}
    if isinstance(obj, (dict, MappingProxyType)):
        return {k: recipe_to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [recipe_to_dict(v) for v in obj]
    return obj
