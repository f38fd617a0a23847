"""Layer profiles: what the cost model knows about a model on a device, and its JSON file format.

A profile is pure data (no torch): per layer times and byte counts, plus the device and its links.
It comes from a measurement (`measure.profile_model`), a JSON file (`load_profile`) or an estimate
from a GPU's peak figures (`estimate.estimate_profile`).

JSON format, version 1 (every number is per microbatch of `microbatch_size` samples, seconds, bytes):

    {
      "format": "oobleck-slurm-profile", "version": 1,
      "source": "measured" | "estimate:H100" | "file", "model": {...}  (free-form description),
      "device_name": "NVIDIA H100 80GB HBM3", "device_memory_bytes": 85899345920,
      "devices_per_node": 8, "microbatch_size": 4, "dtype": "bf16", "optimizer": "adamw",
      "links": {  # latency_s: per message; bandwidth_Bps: bytes per second (all-reduce: bus bandwidth)
        "intra_node": {"latency_s": 5e-6, "bandwidth_Bps": 3e11},
        "inter_node": {"latency_s": 1e-5, "bandwidth_Bps": 2.5e10},
        "allreduce_intra": {...}, "allreduce_inter": {...}
      },
      "layers": [{"name": "embed", "forward_s": ..., "backward_s": ..., "param_bytes": ...,
                  "grad_bytes": ..., "optimizer_bytes": ..., "output_bytes": ...,
                  "activation_bytes": ..., "workspace_bytes": ...}, ...],
      "key": "<sha256 of what the profile depends on>"   (optional in hand-written files)
    }

`output_bytes` is what the layer sends to the next stage; `activation_bytes` is what it keeps for
its backward pass (one microbatch); `workspace_bytes` is the most its forward or backward allocates
for a moment on top of that (gradients of its intermediate tensors, attention scores; optional, 0
when absent: files written before it existed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from oobleck_slurm.errors import BadInputError

PROFILE_FORMAT = "oobleck-slurm-profile"
PROFILE_VERSION = 1
LINK_NAMES = ("intra_node", "inter_node", "allreduce_intra", "allreduce_inter")
# Bounds on what a profile file may hold, so that a wrong or hostile file is refused with a message
# instead of exhausting memory or the planner's time. Real profiles: ~100 layers, 8 devices per node,
# layer times of milliseconds, state of gigabytes, files of kilobytes.
MAX_PROFILE_BYTES = 8 << 20
MAX_PROFILE_LAYERS = 4096
MAX_DEVICES_PER_NODE = 64
MAX_PROFILE_SECONDS = 1e6  # per layer and microbatch, or per message: 11 days is already no device
MAX_PROFILE_BYTES_VALUE = 2**60  # bytes of one layer or one device: an exbibyte


class ProfileError(BadInputError, ValueError):
    """A profile file or dict that cannot be used: says which file and which key."""


@dataclass(frozen=True)
class Link:
    """Alpha-beta model of a link: a message of n bytes takes latency_s + n / bandwidth_Bps."""

    latency_s: float
    bandwidth_Bps: float


@dataclass(frozen=True)
class LayerProfile:
    """One layer, one microbatch."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    output_bytes: int
    activation_bytes: int
    workspace_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        """Bytes a holder keeps whatever the batch: parameters, gradients, optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Profile:
    layers: tuple[LayerProfile, ...]
    device_name: str
    device_memory_bytes: int
    devices_per_node: int
    microbatch_size: int
    dtype: str
    optimizer: str
    links: dict[str, Link]
    source: str = "file"
    model: dict[str, Any] | None = None
    key: str = ""

    def __hash__(self) -> int:  # dict fields: hash by key (frozen dataclasses hash all fields)
        return hash((self.key, self.content_hash()))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def link(self, name: str) -> Link:
        return self.links[name]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "source": self.source,
            "model": self.model,
            "device_name": self.device_name,
            "device_memory_bytes": self.device_memory_bytes,
            "devices_per_node": self.devices_per_node,
            "microbatch_size": self.microbatch_size,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "links": {name: asdict(link) for name, link in self.links.items()},
            "layers": [asdict(layer) for layer in self.layers],
            "key": self.key,
        }

    def content_hash(self) -> str:
        """Hash of everything the cost model reads: two profiles with equal hashes plan alike."""
        data = self.to_dict()
        data.pop("key")
        return canonical_hash(data)


def canonical_hash(data: Any) -> str:
    """sha256 of the canonical JSON text of `data` (sorted keys, no whitespace)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def with_recompute(profile: Profile) -> Profile:
    """The profile of the same model trained with activation recomputation (`training.recompute`): a
    layer keeps only its input per microbatch in flight (the previous layer's output; the token ids for
    the first), its backward runs its forward again first, and for that moment its activations exist
    again on top of its workspace."""
    from dataclasses import replace

    layers = []
    for index, layer in enumerate(profile.layers):
        kept = profile.layers[index - 1].output_bytes if index else layer.activation_bytes  # the first: its ids
        layers.append(replace(layer, activation_bytes=kept, backward_s=layer.backward_s + layer.forward_s,
                              workspace_bytes=layer.workspace_bytes + layer.activation_bytes))
    return replace(profile, layers=tuple(layers), source=f"{profile.source}+recompute")


def profile_key(
    *, model: dict[str, Any], microbatch_size: int, dtype: str, device_name: str,
    torch_version: str, optimizer: str, source: str, devices_per_node: int,
) -> str:
    """The cache key of a profile: a hash of everything that changes its numbers."""
    return canonical_hash({
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": model,
        "microbatch_size": microbatch_size, "dtype": dtype, "device_name": device_name,
        "torch_version": torch_version, "optimizer": optimizer, "source": source,
        "devices_per_node": devices_per_node,
    })


def profile_from_dict(data: Any, where: str = "profile") -> Profile:
    """Parse and check a profile dict; errors name `where` (a file) and the offending key."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{where}: key 'format' must be {PROFILE_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError(
            f"{where}: key 'version' is {data.get('version')!r}; this oobleck-slurm reads version {PROFILE_VERSION}"
        )

    def get(obj: dict, key: str, kind: type | tuple, path: str, positive: bool = False,
            limit: float | None = None) -> Any:
        if key not in obj:
            raise ProfileError(f"{where}: missing key '{path}{key}'")
        value = obj[key]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if ok and isinstance(value, (int, float)):
            # A float too big for an int or an int too big for a float are both out of any limit.
            ok = (math.isfinite(value) if isinstance(value, float) else True) and (value > 0 if positive else value >= 0)
            if ok and limit is not None and value > limit:
                raise ProfileError(f"{where}: key '{path}{key}' must be at most {limit:g}, got {value!r}")
        if not ok:
            want = "a positive number" if positive else (
                "a non-negative number" if kind in ((int, float), int) else f"a {getattr(kind, '__name__', kind)}"
            )
            raise ProfileError(f"{where}: key '{path}{key}' must be {want}, got {_short(value)}")
        return value

    links_raw = get(data, "links", dict, "")
    links = {}
    for name in LINK_NAMES:
        link = get(links_raw, name, dict, "links.")
        links[name] = Link(
            latency_s=float(get(link, "latency_s", (int, float), f"links.{name}.", limit=MAX_PROFILE_SECONDS)),
            bandwidth_Bps=float(get(link, "bandwidth_Bps", (int, float), f"links.{name}.", positive=True,
                                    limit=MAX_PROFILE_BYTES_VALUE)),
        )
    layers_raw = get(data, "layers", list, "")
    if not layers_raw:
        raise ProfileError(f"{where}: key 'layers' is empty; a profile needs at least one layer")
    if len(layers_raw) > MAX_PROFILE_LAYERS:
        raise ProfileError(f"{where}: key 'layers' has {len(layers_raw)} layers; at most {MAX_PROFILE_LAYERS}")
    layers = []
    for i, raw in enumerate(layers_raw):
        path = f"layers[{i}]."
        if not isinstance(raw, dict):
            raise ProfileError(f"{where}: key 'layers[{i}]' must be an object, got {_short(raw)}")
        name = raw.get("name", f"layer{i}")
        if not isinstance(name, str):
            raise ProfileError(f"{where}: key 'layers[{i}].name' must be a string, got {_short(name)}")
        values: dict[str, Any] = {"name": name}
        for f in fields(LayerProfile):
            if f.name == "name" or (f.name not in raw and f.default is not MISSING):
                continue  # an optional key left out: its default
            if f.type == "int":
                values[f.name] = int(get(raw, f.name, (int, float), path, limit=MAX_PROFILE_BYTES_VALUE))
            else:
                values[f.name] = float(get(raw, f.name, (int, float), path, limit=MAX_PROFILE_SECONDS))
        layers.append(LayerProfile(**values))
    return Profile(
        layers=tuple(layers),
        device_name=str(get(data, "device_name", str, "")),
        device_memory_bytes=int(get(data, "device_memory_bytes", (int, float), "", positive=True,
                                    limit=MAX_PROFILE_BYTES_VALUE)),
        devices_per_node=int(get(data, "devices_per_node", int, "", positive=True, limit=MAX_DEVICES_PER_NODE)),
        microbatch_size=int(get(data, "microbatch_size", int, "", positive=True, limit=MAX_PROFILE_BYTES_VALUE)),
        dtype=str(get(data, "dtype", str, "")),
        optimizer=str(get(data, "optimizer", str, "")),
        links=links,
        source=str(data.get("source", "file")),
        model=data.get("model"),
        key=str(data.get("key") or ""),
    )


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile JSON file; a ProfileError names the file and the bad key."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a directory, or a FIFO that would block the read
        raise ProfileError(f"{path}: not a profile file ({'a directory' if path.is_dir() else 'not a regular file'})")
    try:
        with path.open("rb") as file:
            data_bytes = file.read(MAX_PROFILE_BYTES + 1)
    except OSError as err:
        raise ProfileError(f"{path}: cannot read profile file: {err.strerror or err}") from None
    if len(data_bytes) > MAX_PROFILE_BYTES:
        raise ProfileError(f"{path}: larger than {MAX_PROFILE_BYTES} bytes: not a profile file")
    try:
        data = json.loads(data_bytes.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ProfileError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except RecursionError:  # json's C parser refuses deep nesting with this; no profile nests deeply
        raise ProfileError(f"{path}: JSON nested too deeply: not a profile file") from None
    except ValueError as err:  # e.g. an integer of more than 4300 digits (Python's int conversion limit)
        raise ProfileError(f"{path}: not a usable JSON document: {err}") from None
    profile = profile_from_dict(data, where=str(path))
    if not profile.key:  # hand-written file: key it by its content, so caches never mix files
        profile = _with_key(profile, profile.content_hash())
    return profile


def _short(value: Any, limit: int = 80) -> str:
    """repr() for a message, cut: a bad value may be a whole nested document."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")


def _with_key(profile: Profile, key: str) -> Profile:
    from dataclasses import replace

    return replace(profile, key=key)
