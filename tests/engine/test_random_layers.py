"""Random and stateful layers (engine/layer_rng.py, models/factory.py).

Dropout trains the same trajectory whatever the plan: every layer's forward of a microbatch draws from
generators seeded by (seed, step, microbatch, layer), so one worker computing all four microbatches, and
two pipelines (one of them of two stages, in other processes, with other microbatches before them) give
the same masks; so does a recomputed forward. Evaluation runs in eval mode (no dropout). The reference
(tests/reference.py) draws the same masks microbatch by microbatch. A stage wider than one worker splits a
microbatch, so random layers are refused there: by name before the job (dropout modules), or at the
first forward (dropout called as a function). Layers that update a buffer in training (BatchNorm's
running statistics) are refused by name when the factory is inspected.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from plan_runs import assert_exact, run_plans, warm_server
from reference import reference_evals, train_reference

from oobleck_slurm.agent.warm import WarmServer
from oobleck_slurm.commands.common import model_factory_issues
from oobleck_slurm.engine.abort import AbortableGeneration
from oobleck_slurm.engine.layer_rng import LayerDrawError
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.engine.spec import DataSpec, JobSpec, ModelSpec, OptimSpec, TrainSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.models import FactoryError, FactoryModel, check_stage_widths, inspect_factory
from oobleck_slurm.recipe import load_recipe
from oobleck_slurm.timeouts import JobTimeouts

pytestmark = pytest.mark.slow
KWARGS = {"depth": 3, "width": 32, "vocab": 256, "seq": 16, "hidden": 48, "dropout": 0.3}  # 5 layers
ONE_WORKER = ExecPlan(5, 4, (PipelineSpec((0,), (0, 5), 0, 4),))
TWO_PIPELINES = ExecPlan(5, 4, (PipelineSpec((0,), (0, 5), 0, 1), PipelineSpec((1, 2), (0, 2, 5), 1, 3)))
WIDE = ExecPlan(5, 2, (PipelineSpec((0,), (0, 5), 0, 2, (2,), (True,)),))  # one kept stage of 2 workers
TIMEOUTS = JobTimeouts(collective_timeout=60.0, step_timeout=300.0)  # nothing here should time out
JOIN_S = 300.0  # 2 threads on a shared machine


def factory_job(factory: str = "factory_model:make_layers", steps: int = 3, recompute: bool = False,
                **kwargs: float) -> JobSpec:
    model = inspect_factory(FactoryModel(factory, seq_len=16, vocab_size=256, kwargs={**KWARGS, **kwargs}))
    return JobSpec(
        model=ModelSpec(model),
        data=DataSpec("random", num_samples=256, seed=1, holdout=6),
        optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1),
        train=TrainSpec(steps=steps, microbatch_size=2, num_microbatches=4, seed=0, grad_clip=0.5, warmup_steps=1,
                        precision="fp64", recompute=recompute, eval_interval=steps, eval_samples=6),
    )


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmServer]:
    yield from warm_server()


def test_dropout_trains_the_same_trajectory_whatever_the_plan(warm: WarmServer, tmp_path: Path) -> None:
    job = factory_job()
    assert job.model.config.random_layers == (1, 2, 3)  # type: ignore[attr-defined]  # the blocks
    runs = []
    for name, plan, world in [("one", ONE_WORKER, 1), ("two", TWO_PIPELINES, 3)]:
        (tmp_path / name).mkdir()
        losses, layers = run_plans(warm, tmp_path / name, job, [(0, plan)], world=world)
        assert_exact(job, losses, layers)  # the reference's masks, microbatch by microbatch
        runs.append(losses)
        evaluated = float((tmp_path / name / "eval.json").read_text())
        ref_eval = reference_evals(job)[job.train.steps]
        assert abs(evaluated - ref_eval) <= 1e-5 * abs(ref_eval), (name, evaluated, ref_eval)  # no dropout
    assert runs[0] == pytest.approx(runs[1], rel=1e-12, abs=0)  # the two plans: rounding apart at most
    # dropout was on: without it the trajectory is another
    plain, _ = train_reference(factory_job(dropout=0.0))
    assert min(abs(a - b) for a, b in zip(plain, train_reference(job)[0])) > 1e-6


def test_a_recomputed_forward_draws_the_same_masks(warm: WarmServer, tmp_path: Path) -> None:
    job = factory_job(recompute=True)
    losses, layers = run_plans(warm, tmp_path, job, [(0, TWO_PIPELINES)], world=3)
    assert_exact(job, losses, layers)  # the reference does not recompute: a different mask would show


def run_wide(job: JobSpec) -> list[BaseException]:
    """Two workers as threads on real gloo groups, one stage of both (WIDE): adopt and one step each;
    what each raised."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=dt.timedelta(seconds=30))
            worker = Worker(job, r)
            worker.adopt(WIDE, AbortableGeneration(client, 0, r, 2, WIDE, TIMEOUTS))
            worker.train_step()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_random_layers_are_refused_on_a_stage_wider_than_one_worker(tmp_path: Path) -> None:
    with_modules = factory_job(steps=1)
    with_modules = dataclasses.replace(with_modules, train=dataclasses.replace(with_modules.train, num_microbatches=2))
    errors = run_wide(with_modules)  # found by their modules: at adopt, before any step
    assert len(errors) == 2 and all(isinstance(e, LayerDrawError) for e in errors), errors
    assert "block.0, block.1, block.2 draw random numbers" in str(errors[0])
    functional = factory_job("factory_model:functional_dropout", steps=1)
    assert functional.model.config.random_layers == ()  # type: ignore[attr-defined]  # no module says so
    functional = dataclasses.replace(functional, train=dataclasses.replace(functional.train, num_microbatches=2))
    errors = run_wide(functional)  # found at the first forward: the layer moved the generator
    assert len(errors) == 2 and all(isinstance(e, LayerDrawError) for e in errors), errors
    assert "layer layer.01 draws random numbers in training" in str(errors[0])  # the factory's list: no names
    # and before the job: the recipe's cluster.max_stage_devices
    with pytest.raises(FactoryError, match="block.0, block.1, block.2 use dropout") as refused:
        check_stage_widths(factory_job().model.config, 2)
    assert refused.value.key == "cluster.max_stage_devices"
    check_stage_widths(factory_job().model.config, 1)
    path = tmp_path / "r.yaml"
    path.write_text("cluster: {workers_per_node: 2, cpus_per_node: 2, max_stage_devices: 2}\n"
                    "training: {global_batch_size: 8, microbatch_size: 2}\n"
                    "model:\n  factory: factory_model:make_layers\n  seq_len: 16\n  vocab_size: 256\n"
                    "  kwargs: {depth: 3, width: 32, vocab: 256, seq: 16, dropout: 0.1}\n")
    issues = [str(issue) for issue in model_factory_issues(load_recipe(path))]
    assert len(issues) == 1 and "r.yaml" in issues[0] and "cluster.max_stage_devices" in issues[0], issues


@pytest.mark.parametrize(("factory", "buffers"), [("batch_norm", "bn.num_batches_tracked, bn.running_mean, bn.running_var"),
                                                  ("counting", "seen")])
def test_a_layer_that_updates_a_buffer_in_training_is_refused_by_name(factory: str, buffers: str) -> None:
    with pytest.raises(FactoryError, match=f"layer 1 \\(layer.01\\) updates its buffer\\(s\\) {buffers} in training") as e:
        inspect_factory(FactoryModel(f"factory_model:{factory}", seq_len=16, vocab_size=256, kwargs=KWARGS))
    assert e.value.key == "model.factory" and f"factory_model:{factory}" in str(e.value)
