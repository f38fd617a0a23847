"""Document masking through the engine (`data.document_mask`; models/documents.py): the end-of-document id is
found in the data (or given, and checked against it); every stage, the middle ones included, reads its
rows' token ids and masks within documents, so pipelines train on the single-process reference with
masking on (fp64), through a re-plan copied from memory and through a kill -9 and its recovery. The
model-level exactness against each document run alone: tests/models/test_documents.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from documents_corpus import documents_folder
from jobrun import assert_matches_reference, run_job, tiny_recipe
from reference import train_reference
from three_ranks import train_three_ranks

from oobleck_slurm.data.prepare import prepare_corpus
from oobleck_slurm.data.tokens import TokenFileMeta, meta_to_json, sidecar_path
from oobleck_slurm.engine.batches import prepare_data
from oobleck_slurm.engine.from_recipe import job_from_recipe
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import check_supported
from oobleck_slurm.errors import BadInputError
from oobleck_slurm.models import FactoryModel, gpt_config, llama_config
from oobleck_slurm.recipe import RecipeError, load_recipe

EOS = 0  # the byte tokenizer's


def flat_file(path: Path, tokenizer: str) -> str:
    """A flat token file of 200 tokens with its sidecar, as prepared with `tokenizer`."""
    (np.arange(200) % 256).astype("<u2").tofile(path)
    sidecar_path(path).write_text(meta_to_json(TokenFileMeta("uint16", 256, tokenizer, 200, "0" * 64)))
    return str(path)


def masked_job(data: DataSpec, family: str = "gpt", recompute: bool = False) -> JobSpec:
    """The tiny model of `family` (6 layers, seq 64) with document masking, its eos found by prepare_data."""
    model = gpt_config("tiny") if family == "gpt" else llama_config("tiny")
    job = JobSpec(model=ModelSpec(model), data=replace(data, document_mask=True),
                  optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
                  train=TrainSpec(steps=6, microbatch_size=2, num_microbatches=8, seed=0, grad_clip=0.5,
                                  warmup_steps=2, precision="fp64", recompute=recompute))
    return replace(job, data=prepare_data(job, None))


def test_the_eos_is_found_in_the_data_or_given_and_checked(tmp_path):
    folder = documents_folder(tmp_path)
    assert masked_job(DataSpec("tokens", sources=((folder, 0.0),))).data.eos_id == EOS  # the manifest's
    byte = flat_file(tmp_path / "byte.bin", "byte")
    assert masked_job(DataSpec("tokens", path=byte)).data.eos_id == EOS  # the byte tokenizer's NUL
    hf = flat_file(tmp_path / "hf.bin", "tok/tokenizer.json")  # a flat file records no eos
    with pytest.raises(BadInputError, match=r"hf.bin does not record which token ends a document.*data.eos_id"):
        masked_job(DataSpec("tokens", path=hf))
    assert masked_job(DataSpec("tokens", path=hf, eos_id=7)).data.eos_id == 7
    with pytest.raises(BadInputError, match=r"data.eos_id is 7, but .*docs ends its documents with 0"):
        masked_job(DataSpec("tokens", sources=((folder, 0.5), (hf, 0.5)), eos_id=7))
    prepare_corpus([str(tmp_path / "docs.jsonl")], tmp_path / "nul5", workers=1, eos=5)  # the same text, eos 5
    with pytest.raises(BadInputError, match=r"the sources end their documents with different ids \(.*docs: 0, .*nul5: 5"):
        masked_job(DataSpec("tokens", sources=((folder, 0.5), (str(tmp_path / "nul5"), 0.5))))
    with pytest.raises(BadInputError, match="random data does not record"):
        masked_job(DataSpec("random", num_samples=8))
    # masking off: nothing is looked for, nothing changes
    job = masked_job(DataSpec("tokens", path=hf, eos_id=7))
    off = replace(job, data=replace(job.data, document_mask=False, eos_id=None))
    assert prepare_data(off, None).eos_id is None


def test_a_factory_model_is_refused():
    job = JobSpec(ModelSpec(FactoryModel("pkg.mod:fn", seq_len=8, vocab_size=256)),
                  DataSpec("random", num_samples=8, document_mask=True, eos_id=0), OptimSpec("adamw"),
                  TrainSpec(steps=1, microbatch_size=1, num_microbatches=1))
    with pytest.raises(NotImplementedError, match="factory family's layers take one tensor"):
        check_supported(job)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "recompute"), [("gpt", False), ("llama", True)], ids=["gpt", "llama-recomputed"])
def test_a_pipeline_with_masking_trains_on_the_masked_reference_through_a_replan(tmp_path, family, recompute):
    # recomputed: a layer's backward runs its forward again, with the microbatch's documents
    job = masked_job(DataSpec("tokens", sources=((documents_folder(tmp_path), 0.0),)), family, recompute)
    run = train_three_ranks(job)
    assert run.middle_reads == 3  # the first plan's middle stage read its rows' tokens, each step
    reference, _ = train_reference(job)
    assert run.losses == pytest.approx(reference, rel=1e-9)
    unmasked, _ = train_reference(replace(job, data=replace(job.data, document_mask=False)))
    assert abs(unmasked[-1] - reference[-1]) > 1e-4  # masking changed the trajectory: the comparison can fail


@pytest.mark.slow
def test_a_masked_job_survives_a_kill_on_the_masked_reference(tmp_path, templates_cache):
    recipe = tiny_recipe(nodes=7, steps=5, memory="8MB")  # pipelines of 3 or more stages
    recipe["data"] = {"sources": [{"path": documents_folder(tmp_path)}], "document_mask": True}
    recipe["training"].update(eval_interval=2, eval_samples=8)  # evaluation masks too (held-out windows)
    run = run_job(tmp_path, recipe, templates_cache, faults=[{"node": "node2", "step": 2, "at": "wait:last"}])
    spec = run.spec()
    assert spec.data.document_mask and spec.data.eos_id == EOS  # found in the prepared set's manifest
    assert run.kind("failure")[0]["nodes"] == ["node2"] and run.kind("resumed")
    assert any(len(p["stages"]) > 2 for p in run.first("plan")["pipelines"])  # a middle stage read its rows
    assert run.kind("eval")
    assert_matches_reference(run)  # losses, evaluations and final parameters


def test_the_recipe_keys_are_validated_and_reach_the_job(tmp_path):
    assert not load_recipe().data.document_mask  # default off
    on = tmp_path / "on.yaml"
    on.write_text("data:\n  document_mask: true\n  eos_id: 3\n")
    data = job_from_recipe(load_recipe(on), "t.bin").data
    assert (data.document_mask, data.eos_id) == (True, 3)
    for text, message in [
        ("data:\n  document_mask: sometimes\n", "data.document_mask: expected true or false"),
        ("data:\n  eos_id: 3\n", "data.eos_id: is used only by data.document_mask"),
        ("data:\n  document_mask: true\n  eos_id: -1\n", "data.eos_id: must be >= 0"),
        ("data:\n  document_mask: true\n  eos_id: 256\n", r"data.eos_id: 256 is not a token of the model's vocabulary"),
        ("model:\n  factory: pkg.mod:fn\ndata:\n  document_mask: true\n", "data.document_mask: needs the gpt or llama"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(RecipeError, match=message):
            load_recipe(bad)
