"""Hugging Face model folders in and out, the part common to every family.

A folder holds `config.json` and its weights in `model.safetensors` or, sharded,
`model-0000i-of-0000N.safetensors` with `model.safetensors.index.json` naming each tensor's shard. A
family reads the config into its `ModelDef` (`model_from_hf`) and maps one of its layers' state to and
from Hugging Face names through its `HFAdapter` (`hf_adapter(model)`), so a worker loads only its
own layers' tensors, opening only the shards that hold them (`load_layer_weights`), and an export
streams layer by layer (`save_hf`).

HFError, HFAdapter, ARCHITECTURES and `architecture` are defined in hf_base.py (which the families'
hf.py import) and imported here for this module's callers.

The core package must not need transformers: this module reads and writes the files itself, with
safetensors (imported when tensors are read or written) and json.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oobleck_slurm.models.gpt.config import GPTConfig
from oobleck_slurm.models.gpt.hf import GPT2Adapter
from oobleck_slurm.models.gpt.hf import config_from_hf as read_gpt
from oobleck_slurm.models.hf_base import ARCHITECTURES, HFAdapter, HFError, architecture
from oobleck_slurm.models.llama.config import LlamaConfig
from oobleck_slurm.models.llama.hf import LlamaAdapter
from oobleck_slurm.models.llama.hf import config_from_hf as read_llama

if TYPE_CHECKING:
    import torch
    from torch import nn

    from oobleck_slurm.models.base import ModelDef

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

def read_config(folder: str | Path) -> dict[str, Any]:
    """FOLDER/config.json as a dict, with an HFError naming the file when it is missing or malformed."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"{folder}: not a directory (a Hugging Face model folder with {CONFIG_FILE} was expected)")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise HFError(f"{path}: missing: a Hugging Face model folder needs its {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path}: cannot be read as JSON: {e}") from e
    if not isinstance(config, dict):
        raise HFError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def model_from_hf(folder: str | Path, seq_len: int | None = None) -> ModelDef:
    """The model definition of a Hugging Face folder (config.json only; weights load per layer with
    `load_layer_weights`).

    Its `seq_len` is `seq_len` when given, else config.json's `max_position_embeddings` (often far longer
    than a training run's sequences): pass the sequence length the run will use, so that it is checked
    against what the model supports (a Mistral or Qwen2 sliding window shorter than it is refused, as
    these layers attend to every earlier position) rather than overriding it afterwards."""
    config = read_config(folder)
    where = str(Path(folder) / CONFIG_FILE)
    family = ARCHITECTURES[architecture(config, where)][1]
    if family == "gpt":
        return read_gpt(config, where, seq_len=seq_len)
    return read_llama(config, where, seq_len=seq_len)


def hf_adapter(model_def: ModelDef) -> HFAdapter:
    """The state-dict adapter of a built-in family's model to and from Hugging Face names; a model of
    another family (a user's factory) raises NotImplementedError."""
    if isinstance(model_def, GPTConfig):
        return GPT2Adapter(model_def)
    if isinstance(model_def, LlamaConfig):
        return LlamaAdapter(model_def)
    raise NotImplementedError(f"model family {model_def.family!r} has no Hugging Face adapter")


def has_weights(folder: str | Path) -> bool:
    """Whether FOLDER holds safetensors weights (a single file or a sharded index)."""
    folder = Path(folder)
    return (folder / WEIGHTS_FILE).is_file() or (folder / INDEX_FILE).is_file()


class _Checkpoint(Mapping[str, "torch.Tensor"]):
    """A folder's tensors by name, opening a file only when one of its tensors is asked for; a missing
    tensor raises HFError naming the file. `origin` keeps the name and file of each tensor handed out."""

    def __init__(self, folder: Path, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[str, Any] = {}
        self.origin: dict[int, tuple[str, Path]] = {}
        single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
        if single.is_file():
            self.where = str(single)
            self._files = {name: single for name in self._handle(single).keys()}
        elif index.is_file():
            self.where = str(index)
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise HFError(f"{index}: cannot be read as JSON: {e}") from e
            except (KeyError, TypeError) as e:
                raise HFError(f"{index}: missing key 'weight_map'") from e
            if not isinstance(weight_map, dict):
                raise HFError(f"{index}: key 'weight_map' must map tensor names to files")
            self._files = {name: folder / str(file) for name, file in weight_map.items()}
        else:
            others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
            hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
            raise HFError(f"{folder}: no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")

    def _handle(self, path: Path) -> Any:
        key = str(path)
        if key not in self._open:
            if not path.is_file():
                raise HFError(f"{self.where}: names the file {path.name}, which is missing")
            from safetensors import safe_open

            try:
                self._open[key] = self._stack.enter_context(safe_open(key, framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own SafetensorError on a bad header
                raise HFError(f"{path}: not a readable safetensors file: {e}") from e
        return self._open[key]

    def file_of(self, name: str) -> Path:
        if name not in self._files:
            raise HFError(f"{self.where}: no tensor {name!r}")
        return self._files[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self.file_of(name)
        handle = self._handle(path)
        if name not in handle.keys():
            raise HFError(f"{path}: no tensor {name!r} (though {self.where} places it there)")
        tensor = handle.get_tensor(name)
        self.origin[id(tensor)] = (name, path)
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def load_layer_weights(folder: str | Path, model_def: ModelDef, index: int, layer: nn.Module) -> None:
    """Copy layer `index`'s tensors from FOLDER's safetensors into `layer` (built, on any device; the
    values are cast to its dtype). Reads only this layer's tensors and opens only their shards."""
    import torch

    folder = Path(folder)
    adapter = hf_adapter(model_def)
    own = layer.state_dict()
    key = model_def.layer_keys()[index]
    with ExitStack() as stack:
        checkpoint = _Checkpoint(folder, stack)
        state = adapter.from_hf(index, checkpoint)
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise HFError(f"{checkpoint.where}: layer {index} ({key}) read the wrong tensors: missing "
                          f"{missing}, unexpected {unexpected}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                if id(tensor) in checkpoint.origin:
                    hf_name, path = checkpoint.origin[id(tensor)]
                    source = f"{path}: tensor {hf_name!r}"
                else:
                    files = sorted({str(p) for _, p in checkpoint.origin.values()})
                    source = f"{', '.join(files) or checkpoint.where}: the tensor for {name!r}"
                raise HFError(f"{source} has shape {list(tensor.shape)}, but layer {index} ({key}) of the "
                              f"model config.json describes has {list(own[name].shape)}")
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor)


def save_hf(out: str | Path, model_def: ModelDef, layer_states: Iterable[tuple[int, Mapping[str, torch.Tensor]]],
            max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write a Hugging Face folder OUT: config.json and the weights in float32, in `model.safetensors`
    or, when they exceed `max_shard_bytes`, in shards with `model.safetensors.index.json`.

    `layer_states` yields (layer index, that layer's state dict) for every layer once, in any order; only
    one shard's tensors are held at a time. Each file is written under a temporary name and renamed into
    place; weight files of an earlier save to OUT that this one does not rewrite are removed. Returns the
    files written."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    adapter = hf_adapter(model_def)
    n = model_def.num_layers
    seen: set[int] = set()
    names: set[str] = set()
    temps: list[Path] = []
    shards: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total_bytes = 0

    def temp(suffix: str) -> Path:
        fd, name = tempfile.mkstemp(dir=out, prefix=".tmp-", suffix=suffix)
        os.close(fd)
        temps.append(Path(name))
        return Path(name)

    def flush() -> None:
        nonlocal current, current_bytes
        path = temp(".safetensors")
        save_file(current, str(path), metadata={"format": "pt"})
        shards.append((path, list(current)))
        current, current_bytes = {}, 0

    try:
        for index, state in layer_states:
            if not 0 <= index < n or index in seen:
                raise ValueError(f"save_hf: layer {index} is {'given twice' if index in seen else 'out of range'} "
                                 f"(the model has layers 0..{n - 1})")
            seen.add(index)
            for name, tensor in adapter.to_hf(index, state).items():
                if name in names:
                    raise ValueError(f"save_hf: tensor {name!r} comes from two layers")
                names.add(name)
                # A fresh contiguous fp32 CPU tensor: safetensors refuses views sharing storage (tied weights).
                fresh = torch.empty(tuple(tensor.shape), dtype=torch.float32)
                fresh.copy_(tensor.detach())
                size = fresh.numel() * fresh.element_size()
                if current and current_bytes + size > max_shard_bytes:
                    flush()
                current[name] = fresh
                current_bytes += size
                total_bytes += size
        if len(seen) != n:
            missing = sorted(set(range(n)) - seen)
            raise ValueError(f"save_hf: layers {missing} were not given (the model has layers 0..{n - 1})")
        if current or not shards:
            flush()

        written: list[tuple[Path, Path]] = []
        if len(shards) == 1:
            written.append((shards[0][0], out / WEIGHTS_FILE))
        else:
            weight_map: dict[str, str] = {}
            for i, (path, shard_names) in enumerate(shards, 1):
                shard_file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                written.append((path, out / shard_file))
                weight_map.update(dict.fromkeys(shard_names, shard_file))
            index_path = temp(".json")
            index_path.write_text(json.dumps({"metadata": {"total_size": total_bytes},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
            written.append((index_path, out / INDEX_FILE))
        config_path = temp(".json")
        config_path.write_text(json.dumps(adapter.hf_config(), indent=2, sort_keys=True) + "\n")
        written.append((config_path, out / CONFIG_FILE))
        for path, final in written:
            os.chmod(path, 0o644)
            os.replace(path, final)
    finally:
        for path in temps:
            path.unlink(missing_ok=True)
    finals = [final for _, final in written]
    for stale in out.iterdir():
        is_weights = stale.name in (WEIGHTS_FILE, INDEX_FILE) or _SHARD.fullmatch(stale.name)
        if is_weights and stale not in finals:
            stale.unlink()
    return [finals[-1], *finals[:-1]]
