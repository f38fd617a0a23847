"""Exactness, with real worker processes and gloo: heterogeneous pipelines train exactly like one
process on the same global batches, for AdamW and CAME, and across a plan change between steps."""

import psutil
import pytest

from oobleck_slurm.engine.launch import EngineError, run_local
from oobleck_slurm.engine.layout import make_plan
from oobleck_slurm.engine.reference import train_reference
from oobleck_slurm.events import events_path, read_events
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.models.config import gpt_config

pytestmark = pytest.mark.slow

# Relative error per tensor: max |p - p_ref| / max |p_ref|, and relative loss error, <= 1e-5.
# Runs in float64: in float32, summing the same microbatch gradients in another order (no engine
# involved: the reference against itself with the microbatches permuted) already moves single
# elements of Adam/CAME-trained tensors by up to 7e-5 relative, and whole tensors (norm-wise) by up
# to 8e-6, because Adam-type updates normalise near-zero gradients to full size. In float64 that
# floor is ~1e-13, so the tolerance separates real errors (wrong weighting, a lost microbatch, a
# stale layer) from rounding. The float32 case is checked norm-wise with a tolerance above its floor.
RTOL = 1e-5
RTOL_FP32_NORMWISE = 5e-5
STEPS = 4


def tiny_job(optimizer: str, lr: float, precision: str = "fp64") -> JobSpec:
    return JobSpec(
        model=ModelSpec(gpt_config("tiny")),  # 4 blocks, d=64, seq 64: 6 layers
        data=DataSpec("random", num_samples=256, seed=1),
        optim=OptimSpec(optimizer, lr=lr, weight_decay=0.1),
        train=TrainSpec(steps=STEPS, microbatch_size=2, num_microbatches=8, seed=0, grad_clip=1.0,
                        warmup_steps=2, precision=precision),
        extra={"save_params": True},
    )


def assert_same_trajectory(run, ref_losses, ref_params, expected_ranks, fp32=False):
    losses = [s["loss"] for s in run.steps]
    assert [s["step"] for s in run.steps] == list(range(STEPS))
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (losses, ref_losses)
    assert sorted(run.params) == expected_ranks
    checked = set()
    for rank, layers in run.params.items():
        for key, tensors in layers.items():
            for name, p in tensors.items():
                ref = ref_params[key][name]
                assert p.dtype == ref.dtype
                if fp32:
                    err = float((p - ref).norm() / ref.norm().clamp_min(1e-12))
                    assert err <= RTOL_FP32_NORMWISE, f"rank {rank} {key}.{name}: relative error {err:.2e}"
                else:
                    err = float((p - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
                    assert err <= RTOL, f"rank {rank} {key}.{name}: relative error {err:.2e}"
                checked.add(key)
    assert checked == set(ref_params)  # every layer was compared
    # And the step really moved the parameters (the test can fail).
    assert losses[-1] != losses[0]


HETERO = make_plan(6, [[0, 6], [0, 3, 6], [0, 2, 4, 6]], [2, 3, 3])  # 1-, 2-, 3-stage pipelines


@pytest.mark.parametrize("optimizer, precision", [("adamw", "fp64"), ("came", "fp64"), ("adamw", "fp32")])
def test_three_heterogeneous_pipelines_match_single_process(tmp_path, optimizer, precision):
    job = tiny_job(optimizer, 3e-3, precision)
    run = run_local(job, HETERO, 6, tmp_path)
    ref_losses, ref_params = train_reference(job)
    assert_same_trajectory(run, ref_losses, ref_params, [0, 1, 2, 3, 4, 5], fp32=precision == "fp32")
    step = run.steps[-1]
    assert len(step["pipeline_seconds"]) == 3 and all(s > 0 for s in step["pipeline_seconds"])
    assert len(step["compute_seconds"]) == 6 and step["samples_per_s"] > 0


def test_plan_change_between_steps_keeps_the_trajectory(tmp_path):
    """Steps 0-1 on 1+2+3-stage pipelines; steps 2-3 on a 1-stage and two 2-stage pipelines with
    other cuts, rank 5 a spare: layers and CAME state (factored moments) move between ranks on a
    new generation of process groups."""
    job = tiny_job("came", 3e-3)
    other = make_plan(6, [[0, 4, 6], [0, 1, 6], [0, 6]], [3, 4, 1])
    run = run_local(job, [(0, HETERO), (2, other)], 6, tmp_path)
    assert [s["generation"] for s in run.steps] == [0, 0, 1, 1]
    ref_losses, ref_params = train_reference(job)
    assert_same_trajectory(run, ref_losses, ref_params, [0, 1, 2, 3, 4, 5])
    assert run.params[5] == {}  # the spare dropped its layers
    assert sorted(run.params[4]) == ["block.00", "block.01", "block.02", "block.03", "embed", "head"]


def test_bad_data_is_a_clear_error_before_any_worker_starts(tmp_path):
    job = tiny_job("adamw", 1e-3)
    bad = JobSpec(job.model, DataSpec("tokens", path=str(tmp_path / "missing.bin")), job.optim, job.train)
    with pytest.raises(ValueError, match=r"missing\.bin does not exist"):
        run_local(bad, HETERO, 6, tmp_path / "job")
    assert not (tmp_path / "job" / "logs" / "worker0.log").exists()


def test_dead_worker_fails_the_run_fast_and_leaves_no_process(tmp_path):
    job = JobSpec(**{**tiny_job("adamw", 1e-3).__dict__, "extra": {"fault": {"rank": 2, "step": 1}}})
    with pytest.raises(EngineError, match=r"worker 2 exited with code 17"):
        run_local(job, make_plan(6, [[0, 6], [0, 3, 6]], [4, 4]), 3, tmp_path)
    steps = [e["step"] for e in read_events(events_path(tmp_path), "step")]
    assert steps == [0]
    assert [e["rank"] for e in read_events(events_path(tmp_path), "failure")] == [2]
    workers = [p for p in psutil.Process().children(recursive=True)
               if "oobleck_slurm.engine.process" in " ".join(p.cmdline())]
    assert workers == []


def test_tied_embeddings_are_refused_before_any_worker_starts(tmp_path):
    job = tiny_job("adamw", 1e-3)
    tied = JobSpec(ModelSpec(gpt_config("tiny", tie_embeddings=True)), job.data, job.optim, job.train)
    with pytest.raises(NotImplementedError, match="tie_embeddings=True is not supported by the engine"):
        run_local(tied, HETERO, 6, tmp_path)
