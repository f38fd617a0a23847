"""The data's identity in checkpoints: what is recorded, what a resume may and may not change, the
consumed-samples cursor across a global batch change, data.epochs, and held-out validation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from oobleck_slurm.data.sampler import SAMPLER_VERSION
from oobleck_slurm.data.tokens import TokenFileMeta, meta_to_json, sidecar_path
from oobleck_slurm.engine.batches import StepBatches, data_identity, open_dataset, open_validation, prepare_data
from oobleck_slurm.engine.checkpoint import (
    DATA_FILE,
    CheckpointWriter,
    DataChangedError,
    identity_changes,
    layer_file,
    read_data_record,
    step_dir,
    write_data_record,
)
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.errors import BadInputError
from oobleck_slurm.models import gpt_config

SEQ = 8


def token_file(path: Path, num_tokens: int, offset: int = 0, vocab: int = 256) -> Path:
    """A real flat token file: ids offset, offset+1, ... mod `vocab` (uint16), with its sidecar."""
    (np.arange(offset, offset + num_tokens) % vocab).astype("<u2").tofile(path)
    sidecar_path(path).write_text(meta_to_json(TokenFileMeta("uint16", vocab, "byte", num_tokens, f"{offset:064x}")))
    return path


def job(data: DataSpec, batch: int = 8, steps: int = 20) -> JobSpec:
    model = ModelSpec(replace(gpt_config("tiny"), seq_len=SEQ))
    return JobSpec(model, data, OptimSpec("adamw"), TrainSpec(steps=steps, microbatch_size=2,
                                                              num_microbatches=batch // 2, seed=5))


def fake_checkpoint(root: Path, spec: JobSpec, step: int, batches: StepBatches) -> None:
    """A complete checkpoint of `step` as the workers leave it: data.json, then every layer file."""
    write_data_record(root, step, batches.record(step))
    for key in spec.model.keys():
        layer_file(root, step, key).write_bytes(b"")


def batches_of(spec: JobSpec) -> StepBatches:
    t = spec.train
    return StepBatches(open_dataset(spec.data, SEQ, 256), t.global_batch_size, t.microbatch_size, t.seed,
                       origin=spec.data.origin, identity=spec.data.identity)


@pytest.fixture
def two_sources(tmp_path: Path) -> DataSpec:
    a, b = token_file(tmp_path / "a.bin", 4001), token_file(tmp_path / "b.bin", 2001, offset=7)
    return DataSpec("tokens", sources=((str(a), 0.7), (str(b), 0.3)))


def test_identity_records_sources_shape_and_order(two_sources: DataSpec) -> None:
    ident = data_identity(two_sources, SEQ, 256, 5)
    assert ident["sampler_version"] == SAMPLER_VERSION and ident["seq_len"] == SEQ and ident["seed"] == 5
    assert ident["global_batch_size"] == 256 and ident["holdout"] == 0
    first = ident["sources"][0]
    assert first["weight"] == 0.7 and first["files"][0]["bytes"] == 8002
    assert first["files"][0]["num_tokens"] == 4001 and len(first["files"][0]["edges_sha256"]) == 64


def test_identity_changes_names_what_changed_and_lets_batch_paths_and_mtimes_through(two_sources: DataSpec,
                                                                                      tmp_path: Path) -> None:
    ident = data_identity(two_sources, SEQ, 256, 5)
    assert identity_changes(ident, ident) == []
    moved = data_identity(two_sources, SEQ, 512, 5)
    moved["sources"][0]["path"] = "/elsewhere/a.bin"
    moved["sources"][0]["files"][0]["mtime_ns"] += 1
    assert identity_changes(ident, moved) == []  # a bigger batch, a copy elsewhere: the same data
    assert identity_changes(ident, data_identity(two_sources, SEQ * 2, 256, 5)) == ["data.seq_len was 8, is 16"]
    assert identity_changes(ident, data_identity(replace(two_sources, holdout=3), SEQ, 256, 5)) == [
        "data.holdout was 0, is 3"]
    token_file(tmp_path / "b.bin", 2003, offset=7)  # re-prepared: two more tokens
    changed = identity_changes(ident, data_identity(two_sources, SEQ, 256, 5))
    assert "data.sources[1].files[0].bytes was 4002, is 4006" in changed
    assert "data.sources[1].files[0].num_tokens was 2001, is 2003" in changed


def test_checkpoint_writer_puts_the_data_record_before_the_layers(two_sources: DataSpec, tmp_path: Path) -> None:
    spec = job(two_sources)
    spec = replace(spec, data=prepare_data(spec, None))
    root = tmp_path / "ckpt"
    writer = CheckpointWriter(root, batches_of(spec).record)
    layer = torch.nn.Linear(2, 2)
    payload = {f"param.{n}": p.detach().clone() for n, p in layer.named_parameters()}
    writer.submit(3, "layer0", payload)
    writer.flush()
    record = read_data_record(root, 3)
    assert record is not None and record["consumed_samples"] == 3 * 8 and record["step"] == 3
    assert record["identity"] == spec.data.identity
    assert read_data_record(root, 4) is None  # a checkpoint from before data records: None, not an error
    (step_dir(root, 3) / DATA_FILE).write_text("{not json")
    with pytest.raises(BadInputError, match="data.json: not a readable data record"):
        read_data_record(root, 3)


def test_resume_checks_identity_and_a_batch_change_continues_the_stream(two_sources: DataSpec,
                                                                        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first = job(two_sources, batch=8)
    first = replace(first, data=prepare_data(first, str(root)))
    assert first.data.origin == (0, 0)
    b1 = batches_of(first)
    trained = np.concatenate([b1.sampler.sample_ids(s) for s in range(6)])
    fake_checkpoint(root, first, 6, b1)

    # Requeued with the global batch doubled: the stream goes on at sample 48, no gap, no repeat.
    second = job(two_sources, batch=16)
    second = replace(second, data=prepare_data(second, str(root)))
    assert second.data.origin == (6, 48)
    b2 = batches_of(second)
    after = np.concatenate([b2.sampler.sample_ids(s) for s in range(6, 9)])
    assert np.array_equal(np.concatenate([trained, after]), b1.sampler.stream_ids(np.arange(48 + 3 * 16)))
    fake_checkpoint(root, second, 9, b2)
    assert read_data_record(root, 9)["consumed_samples"] == 48 + 3 * 16  # type: ignore[index]

    # The same job on other data, another seq_len or seed: refused, naming what changed.
    with pytest.raises(DataChangedError, match=r"checkpoint of step 9 .*data.sources\[0\].weight was 0.7, is 0.6"):
        prepare_data(job(replace(two_sources, sources=((two_sources.sources[0][0], 0.6), two_sources.sources[1]))),
                     str(root))
    other = job(two_sources)
    other = replace(other, train=replace(other.train, seed=6))
    with pytest.raises(DataChangedError, match="data.seed was 5, is 6"):
        prepare_data(other, str(root))


def test_epochs_refuses_a_run_that_would_repeat_a_source(tmp_path: Path) -> None:
    small = DataSpec("tokens", path=str(token_file(tmp_path / "s.bin", 801)), epochs=1)  # 100 samples
    assert prepare_data(job(small, batch=8, steps=12), None).origin == (0, 0)  # 96 samples: one pass
    with pytest.raises(BadInputError, match=r"data.epochs: the job's 13 steps of 8 samples make 2 passes over "
                                            r".*s.bin \(100 training samples\), data.epochs allows 1"):
        prepare_data(job(small, batch=8, steps=13), None)
    assert prepare_data(job(replace(small, epochs=2), batch=8, steps=13), None).origin == (0, 0)


def test_validation_is_each_sources_tail_and_never_trained_on(tmp_path: Path) -> None:
    a, b = token_file(tmp_path / "a.bin", 4001, 0, 2**16), token_file(tmp_path / "b.bin", 2001, 30_000, 2**16)
    spec = DataSpec("tokens", sources=((str(a), 0.7), (str(b), 0.3)), holdout=10)  # every window unique
    train = open_dataset(spec, SEQ, 2**16)
    assert train.sizes == [500 - 7, 250 - 3]  # 10 held out, apportioned 0.7 / 0.3
    val = open_validation(spec, SEQ, 2**16, 10)
    vx, _ = val.batch(np.arange(10))
    tx, _ = train.batch(np.arange(train.num_samples))
    trained = {tuple(r) for r in tx.tolist()}
    assert not any(tuple(r) in trained for r in vx.tolist())
    # The training order depends on the training samples only: evaluating draws nothing from it.
    sampler_ids = StepBatches(train, 8, 2, 5).sampler.sample_ids(3)
    open_validation(spec, SEQ, 2**16, 10).batch(np.arange(10))
    assert np.array_equal(StepBatches(train, 8, 2, 5).sampler.sample_ids(3), sampler_ids)


def test_recipe_sources_checks_and_the_slurm_data_rule(tmp_path: Path) -> None:
    from oobleck_slurm.engine.from_recipe import job_from_recipe
    from oobleck_slurm.recipe import RecipeError, load_recipe
    from oobleck_slurm.recipe.validate import data_issues

    token_file(tmp_path / "a.bin", 4001)
    (tmp_path / "ok.yaml").write_text("data:\n  sources:\n    - {path: a.bin, weight: 2}\n    - {path: '*.bin', weight: 1}\n"
                                      "  epochs: 3\n")
    spec = job_from_recipe(load_recipe(tmp_path / "ok.yaml"), tmp_path / "unused.bin").data
    assert spec.path is None and spec.epochs == 3
    assert spec.sources == ((str(tmp_path / "a.bin"), 2.0), (str(tmp_path / "*.bin"), 1.0))  # relative to the recipe
    (tmp_path / "bad.yaml").write_text("data:\n  path: a.bin\n  sources:\n    - {path: a.bin, weight: 2}\n"
                                       "    - {path: missing.bin}\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(tmp_path / "bad.yaml")
    text = str(err.value)
    assert "not both" in text and "give every source a weight, or none" in text
    assert f"source 2: nothing found at {tmp_path / 'missing.bin'}" in text
    (tmp_path / "slurm.yaml").write_text("cluster: {backend: slurm}\n")
    [issue] = data_issues(load_recipe(tmp_path / "slurm.yaml"))
    assert "a Slurm job needs training data" in str(issue) and "data.sources" in str(issue)
    (tmp_path / "slurm2.yaml").write_text("cluster: {backend: slurm}\ndata:\n  sources: [{path: /not/here/yet}]\n")
    assert data_issues(load_recipe(tmp_path / "slurm2.yaml")) == []  # on the cluster's file system: checked at start


def test_a_prepared_set_is_a_source_beside_a_flat_file(tmp_path: Path) -> None:
    from oobleck_slurm.data.indexed import IndexedWriter, dtype_for_vocab

    for name, start in (("p0", 0), ("p1", 3000)):  # two Megatron shards, read by data/indexed.py
        with open(tmp_path / f"{name}.bin", "wb") as f:
            w = IndexedWriter(f, dtype_for_vocab(2**16))
            w.add(np.arange(start, start + 1601) % 2**16)
            w.end_document()
            (tmp_path / f"{name}.idx").write_bytes(w.index_bytes())
    flat = token_file(tmp_path / "flat.bin", 801, 9000, 2**16)
    spec = DataSpec("tokens", sources=((str(tmp_path / "p*.bin"), 0.5), (str(flat), 0.5)))
    data = open_dataset(spec, SEQ, 2**16)
    assert data.sizes == [400, 100]
    ident = data_identity(spec, SEQ, 8, 0)["sources"]
    assert ident[0]["shards"] == 2 and ident[0]["num_tokens"] == 3202 and len(ident[0]["prepared_sha256"]) == 64
    assert ident[1]["files"][0]["num_tokens"] == 801
    x, y = data.batch(np.array([0, 200, 400]))  # shard 0, shard 1, the flat file
    assert x[:, 0].tolist() == [0, 3000, 9000] and torch.equal(x[:, 1:], y[:, :-1])
