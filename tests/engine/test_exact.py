"""Exactness through the production path (submit's start function: supervisor, agents, one worker per
device): bf16 within its documented tolerance of the fp32 reference. fp64 jobs match the reference
within 1e-5 relative (why: below) in every training test: pipelines of 4 stages over two nodes of 2 workers each
(CAME) in tests/cli/test_submit.py, every failure kind in tests/recovery/."""

import dataclasses

import pytest
import torch
from jobrun import run_job, tiny_recipe
from reference import train_reference

from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import check_supported
from oobleck_slurm.models import gpt_config

pytestmark = pytest.mark.slow

# Relative error per tensor: max |p - p_ref| / max |p_ref|, and relative loss error, <= 1e-5, in
# float64: in float32, summing the same microbatch gradients in another order (no engine involved: the
# reference against itself with the microbatches permuted) already moves single elements of
# Adam/CAME-trained tensors by up to 7e-5 relative, and whole tensors (norm-wise) by up to 8e-6,
# because Adam-type updates normalise near-zero gradients to full size. In float64 that floor is
# ~1e-13, so the tolerance separates real errors (wrong weighting, a lost microbatch, a stale layer)
# from rounding. bf16 (autocast, fp32 master weights and
# optimizer state) against the fp32 reference at BF16_LOSS_RTOL: bf16 keeps 8 bits of mantissa, so
# each matmul rounds at ~4e-3 relative; over a few steps the loss stays within 2e-2.
BF16_LOSS_RTOL = 2e-2


def test_bf16_within_its_tolerance_of_the_fp32_reference(tmp_path, templates_cache):
    bf16 = run_job(tmp_path, tiny_recipe(precision="bf16"), templates_cache)
    spec = bf16.spec()
    fp32 = dataclasses.replace(spec, train=dataclasses.replace(spec.train, precision="fp32"))
    ref_losses, _ = train_reference(fp32)
    losses = bf16.losses()
    assert sorted(losses) == list(range(len(ref_losses)))
    errors = [abs(losses[s] - ref) / abs(ref) for s, ref in enumerate(ref_losses)]
    assert max(errors) <= BF16_LOSS_RTOL, errors
    assert max(errors) > 0  # autocast really ran in bf16 (the comparison can fail)
    assert {t.dtype for layer in bf16.final_params().values() for t in layer.values()} == {torch.float32}


def test_tied_embeddings_are_refused_with_the_reason():
    tied = JobSpec(ModelSpec(gpt_config("tiny", tie_embeddings=True)), DataSpec("random", num_samples=8), OptimSpec("adamw"),
                   TrainSpec(steps=1, microbatch_size=1, num_microbatches=1))
    with pytest.raises(NotImplementedError, match="tie_embeddings=True is not supported by the engine"):
        check_supported(tied)
