"""Layer checkpoint files: safetensors `<dir>/step<S>/<key>.safetensors` with the step in the metadata,
written atomically (timing first), read back exactly (0-dim optimizer step counters included), and
every way a file can be wrong reported naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from oobleck_slurm.engine.checkpoint import (
    LAYER_SUFFIX,
    CheckpointError,
    CheckpointWriter,
    latest_complete,
    layer_file,
    layer_payload,
    load_layer,
    read_layer_file,
    save_layer,
)
from oobleck_slurm.engine.layer_optim import make_layer_optimizer
from oobleck_slurm.engine.spec import OptimSpec


class Layer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(6, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("scale", torch.randn(4))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)) * self.scale


def trained(seed: int, name: str = "adamw", steps: int = 2) -> tuple[Layer, torch.optim.Optimizer]:
    layer = Layer(seed)
    opt = make_layer_optimizer(layer, OptimSpec(name, lr=1e-2))
    for _ in range(steps):
        layer(torch.randn(5, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return layer, opt


@pytest.mark.parametrize("name", ["adamw", "came"])
def test_round_trip_is_exact(tmp_path: Path, name: str) -> None:
    layer, opt = trained(0, name)
    path = save_layer(tmp_path, 3, "block.0", layer_payload(layer, opt))
    assert path == layer_file(tmp_path, 3, "block.0") == tmp_path / "step3" / f"block.0{LAYER_SUFFIX}"
    fresh, fresh_opt = trained(1, name, steps=0)  # another seed, no optimizer state yet
    nbytes = load_layer(tmp_path, 3, "block.0", fresh, fresh_opt)
    want, got = layer_payload(layer, opt), layer_payload(fresh, fresh_opt)
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(want[key], got[key]) and want[key].dtype == got[key].dtype, key
    assert nbytes == sum(t.numel() * t.element_size() for t in want.values())
    assert "buffer.scratch" not in want and "buffer.scale" in want  # non-persistent buffers: not saved


def test_the_file_is_plain_safetensors_with_the_step_in_its_metadata(tmp_path: Path) -> None:
    layer, opt = trained(0)
    path = save_layer(tmp_path, 12, "embed", layer_payload(layer, opt))
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]  # no pickle: an 8-byte length, then JSON
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert header["__metadata__"] == {"format": "oobleck-slurm-layer", "version": "1", "step": "12"}
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
    assert "step" not in names
    assert {n.split(".", 1)[0] for n in names} == {"param", "buffer", "state"}
    tensors = load_file(str(path))
    steps = [n for n, t in tensors.items() if n.startswith("state.") and n.endswith(".step")]
    assert steps and all(tensors[n].dim() == 0 and float(tensors[n]) == 2.0 for n in steps)  # 0-dim counters


def test_non_contiguous_tensors_are_saved(tmp_path: Path) -> None:
    t = torch.arange(12.0).reshape(3, 4).t()
    assert not t.is_contiguous()
    path = save_layer(tmp_path, 1, "k", {"param.w": t, "state.0.step": torch.tensor(5.0)})
    data = read_layer_file(path, 1)
    assert torch.equal(data["param.w"], t) and data["state.0.step"].shape == ()


def test_writes_are_atomic_with_the_timing_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import oobleck_slurm.engine.checkpoint as checkpoint

    layer, opt = trained(0)
    order: list[str] = []
    replace = checkpoint.os.replace

    def spy(src: str | Path, dst: str | Path) -> None:
        order.append(Path(dst).name)
        assert Path(src).name.endswith(".tmp")  # whole files are renamed into place
        replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", spy)
    writer = CheckpointWriter(tmp_path)
    writer.submit(4, "head", layer_payload(layer, opt))
    writer.flush()
    assert order == [".head.seconds", f"head{LAYER_SUFFIX}"]
    d = tmp_path / "step4"
    assert float((d / ".head.seconds").read_text()) >= 0
    assert sorted(p.name for p in d.iterdir()) == [".head.seconds", f"head{LAYER_SUFFIX}"]


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import oobleck_slurm.engine.checkpoint as checkpoint

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(OSError, match="No space left"):
        save_layer(tmp_path, 2, "k", {"param.w": torch.zeros(2)})
    assert list((tmp_path / "step2").iterdir()) == []


def test_latest_complete_needs_every_layer_file(tmp_path: Path) -> None:
    layer, opt = trained(0)
    assert latest_complete(tmp_path / "none", ["a"]) is None
    for step, keys in ((5, ["a", "b"]), (10, ["a", "b"]), (15, ["a"])):
        for key in keys:
            save_layer(tmp_path, step, key, layer_payload(layer, opt))
    (tmp_path / "step15" / "b.pt").write_bytes(b"")  # another suffix does not count
    assert latest_complete(tmp_path, ["a", "b"]) == 10
    assert latest_complete(tmp_path, ["a"]) == 15


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    layer, opt = trained(0)
    path = layer_file(tmp_path, 3, "k")

    def load() -> None:
        load_layer(tmp_path, 3, "k", *trained(1, steps=0))

    with pytest.raises(CheckpointError, match=f"{path}: layer file does not exist"):
        load()
    path.parent.mkdir()
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(CheckpointError, match=f"{path}: not a valid safetensors file"):
        load()
    good = layer_payload(layer, opt)
    save_layer(tmp_path, 3, "k", good)
    path.write_bytes(path.read_bytes()[:-8])  # truncated
    with pytest.raises(CheckpointError, match=f"{path}: not a valid safetensors file"):
        load()

    save_layer(tmp_path, 4, "k", good)  # the step-4 file put where step 3's belongs
    layer_file(tmp_path, 4, "k").replace(path)
    with pytest.raises(CheckpointError, match=f"{path}: holds step 4, expected 3"):
        load()

    save_file({k: v.contiguous() for k, v in good.items()}, str(path))  # no metadata: written by someone else
    with pytest.raises(CheckpointError, match=f"{path}: metadata format None version None"):
        load()
    save_file(good, str(path), metadata={"format": "oobleck-slurm-layer", "version": "1", "step": "x"})
    with pytest.raises(CheckpointError, match=f"{path}: metadata step 'x' is not a step number"):
        load()

    save_layer(tmp_path, 3, "k", {k: v for k, v in good.items() if k != "param.proj.weight"})
    with pytest.raises(CheckpointError, match=f"{path}: has no tensor 'param.proj.weight'"):
        load()
    save_layer(tmp_path, 3, "k", {**good, "param.proj.weight": torch.zeros(4, 7)})
    with pytest.raises(CheckpointError, match=r"tensor 'param.proj.weight' is \(4, 7\), the layer's is \(4, 6\)"):
        load()
    save_layer(tmp_path, 3, "k", {k: v for k, v in good.items() if not k.startswith("state.0.")})
    with pytest.raises(CheckpointError, match=f"{path}: optimizer state does not match this optimizer: missing"):
        load()
    save_layer(tmp_path, 3, "k", good)
    load()  # and a good file loads


def test_a_failed_write_is_raised_by_flush_not_hung_on(tmp_path):
    from oobleck_slurm.engine.checkpoint import CheckpointError, CheckpointWriter

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should go")
    writer = CheckpointWriter(blocker)
    writer.submit(1, "embed", {"param.w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="not-a-folder"):
        writer.flush()
    writer.flush()  # reported once; the writer keeps serving
