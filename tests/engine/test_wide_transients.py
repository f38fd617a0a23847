"""What a wide stage's worker holds beyond its state outside a training step, against the planner's peak:
its evaluation, a checkpoint's gathers and a plan change. Real worker processes on real gloo groups
(under NCCL's ordering rules), measured with oobleck_slurm/peak_memory.py (wide_transients.py).

One 4-rank job, a GPT of 4 blocks of 12 MiB each (fp32): stage 0 layer 0 on rank 0, stage 1 the four
blocks on ranks 1-2 (a resharded stage: the planner gives a stage that mode where its gathered layers do
not fit, and counts two layers gathered at once, engine/shard.py), stage 2 the head on rank 3; 7
validation samples in microbatches of 2 (the last one of 1 sample). Then a plan change to two stages of
width 2 (ranks 0-1 and 2-3), each rank sending, keeping and receiving parts of layers.

Would fail: an evaluation that gathers a resharded stage's layers all at once (4 blocks, 48 MiB, where
the planner counts 2); a checkpoint that builds the whole layer's optimizer state twice over on the
stage's first rank (measured before the fix: 4.5x a layer beyond the payload); a plan change that keeps
flat copies of what it sends and keeps, and clones of the pieces it sends, until it returns (measured
before the fix: 1.3x the old state on top of it).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from oobleck_slurm.engine.batches import open_validation
from oobleck_slurm.engine.layout import ExecPlan, PipelineSpec
from oobleck_slurm.models.documents import run_layer
from oobleck_slurm.peak_memory import MALLOC_ENV

pytestmark = pytest.mark.slow
HELPER = Path(__file__).with_name("wide_transients.py")
MIB = 2**20
GPT = {"n_layer": 4, "d_model": 512, "n_head": 8, "seq_len": 64, "vocab_size": 256}  # blocks of 12 MiB
BLOCK = 12 * MIB
SLACK = 6 * MIB  # what the process allocates besides (Python objects, small tensors): measured 1-4 MiB
# gloo's all-gather receives into a flat buffer of its own and copies it out (ProcessGroupGloo): one more
# layer while a gather is in flight, on the CPU only (NCCL writes into the buffers it is given)
GLOO_GATHER = BLOCK
PIPELINE = ExecPlan(6, 4, (PipelineSpec((0, 1, 3), (0, 1, 5, 6), 0, 4, (1, 2, 1)),))  # stage 1 resharded
HALVES = ExecPlan(6, 4, (PipelineSpec((0, 2), (0, 3, 6), 0, 4, (2, 2)),))
CONFIG = {"gpt": GPT, "optimizer": "adamw", "precision": "fp32", "microbatch_size": 2, "microbatches": 4,
          "eval_samples": 7, "plans": [PIPELINE.to_json(), HALVES.to_json()], "transfers": [],
          "phases": ["evaluate", "payload", "adopt"]}


def run(config: dict[str, Any], world: int, out: Path) -> list[dict[str, Any]]:
    """Each rank in a fresh process (MALLOC_ENV: its RSS follows the live tensors), on a store hosted here."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=300))
    env = dict(os.environ, OMP_NUM_THREADS="1", **MALLOC_ENV)

    def rank(r: int) -> dict[str, Any]:
        arg = json.dumps({**config, "rank": r, "world": world, "port": store.port, "out": str(out)})
        done = subprocess.run([sys.executable, str(HELPER), arg], capture_output=True, text=True, env=env,
                              timeout=900, check=False)
        assert done.returncode == 0, f"rank {r}:\n{done.stderr[-3000:]}"
        return json.loads(done.stdout.splitlines()[-1])

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank, range(world)))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("wide")
    ranks = run(CONFIG, 4, out)
    assert all(r["probe"] == "clear_refs" and r["malloc_configured"] for r in ranks)
    return {"ranks": ranks, "out": out}


def transient(phase: dict[str, Any]) -> int:
    """Bytes held at the phase's peak beyond what the process held as it began."""
    return phase["peak"] - phase["before"]


def test_evaluating_a_resharded_stage_gathers_two_layers_at_a_time(measured):
    # ranks 1 and 2 hold a resharded stage of 4 blocks: the planner counts 2 of them whole at once
    # (the one in use and the next one's gather); the validation hidden states are 128 KiB each here
    for r in (1, 2):
        held = transient(measured["ranks"][r]["evaluate"])
        assert held <= 2 * BLOCK + GLOO_GATHER + SLACK, f"rank {r}: evaluation held {held / MIB:.1f} MiB beyond its state"


def test_evaluating_layer_by_layer_gives_the_loss_of_a_whole_forward_bitwise(measured):
    # the reference: every layer whole (the stages' first ranks' checkpoint payloads), each validation
    # microbatch through all of them, as the worker evaluates a stage of one rank
    from wide_transients import job_spec

    job = job_spec({**CONFIG, "rank": 0})
    params: dict[str, dict[str, torch.Tensor]] = {}
    for r in range(4):
        params.update(torch.load(measured["out"] / f"layers{r}.pt"))
    layers = job.model.build(job.train.seed, 0, 6)
    for key, layer in zip(job.model.keys(), layers):
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(params[key][f"param.{name}"])
    validation = open_validation(job.data, job.model.seq_len, job.model.vocab_size, job.train.eval_samples)
    n, b = validation.num_samples, job.train.microbatch_size
    total = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for m in range(-(-n // b)):
            ids = list(range(m * b, min(n, (m + 1) * b)))
            h, y = validation.batch(ids)
            for layer in layers:
                h = run_layer(layer, h)
            total += job.model.config.loss(h, y).double() * len(ids)
    losses = {r["evaluate"]["loss"] for r in measured["ranks"]}
    assert losses == {float(total) / n}


def test_a_checkpoint_of_a_wide_layer_holds_one_whole_tensor_beyond_its_payload(measured):
    # the stage's first rank: the payload (CPU copies: parameters and both moments, 3 layers here) plus
    # one gathered buffer of the layer (parameters, then each moment in turn) and its own moment shard;
    # the other rank: that buffer and shard alone (and gloo's own buffer of the gather in flight)
    for r in (1, 2):
        for entry in measured["ranks"][r]["payload"]:
            held, full = transient(entry), entry["full_bytes"]
            bound = entry.get("bytes", 0) + 1.5 * full + GLOO_GATHER + SLACK
            assert held <= bound, (f"rank {r} layer {entry['layer']}: {held / MIB:.1f} MiB beyond its state for a "
                                   f"payload of {entry.get('bytes', 0) / MIB:.1f} MiB, a layer of {full / MIB:.1f} MiB")


def test_a_plan_change_holds_the_old_state_the_new_holdings_and_one_layer_built(measured):
    # while the copies run: the old state and the new holdings (parameters and moments of the new shards,
    # read and received in place); then the old state is freed and each layer installed: the new state,
    # one layer's holding and that layer built whole twice (from the seed, then its full buffer); here
    # within the new state and two whole blocks (a block's holding of 18 MiB overlaps its build)
    for r, rank in enumerate(measured["ranks"]):
        adopt = rank["adopt"]
        held = transient(adopt)
        bound = adopt["state_after"] + 2 * BLOCK + SLACK
        assert held <= bound, (f"rank {r}: the plan change held {held / MIB:.1f} MiB beyond the old state of "
                               f"{adopt['state'] / MIB:.1f} MiB (new state: {adopt['state_after'] / MIB:.1f} MiB)")
        assert adopt["after"] - adopt["before"] <= adopt["state_after"] - adopt["state"] + SLACK  # nothing kept


def test_a_wide_stage_holds_its_shards_state_and_nothing_more(measured):
    # between steps: the parameters, gradient and AdamW's two moments of its shard of each layer, what
    # the planner counts (cost.stage_memory_terms: parameters, gradients and optimizer over g)
    for r in (1, 2):
        rank = measured["ranks"][r]
        shard = sum(e["full_bytes"] for e in rank["payload"]) / 2
        state = rank["evaluate"]["state"]
        assert state <= 4 * shard + 2**16, f"rank {r}: holds {state / shard:.2f} x its parameters' shard"
