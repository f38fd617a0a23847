"""Where the engine waits on the host (finding 8 of the engine review).

A resharded stage (shard.py) reduce-scatters each layer's gradient of a microbatch after the layer's
backward: the wait for that scatter comes after the next layer's backward has been launched, so the
scatter overlaps it (as planning/cost.py's exposed_shard_time assumes), and the gradient shards are
those of an immediate wait. Two workers as threads on a real gloo group; the group is wrapped only to
log what is posted, and the wait callable logs what is waited for.

An NCCL wait polls the work from the host (abort.py: abortable within the poll period): the pauses
between polls start with a yield and grow to `nccl_poll`, so a short operation is seen at once and a
long one costs a poll every `nccl_poll`, never longer (the abort latency). Checked with a real gloo work,
whose `is_completed` the poll reads as it reads NCCL's.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from oobleck_slurm.engine.abort import FailureWatch, GenerationAborted
from oobleck_slurm.engine.comm import make_group
from oobleck_slurm.engine.shard import ShardedLayer, StageParams
from oobleck_slurm.engine.spec import OptimSpec
from oobleck_slurm.engine.stage import Stage
from oobleck_slurm.protocol import keys
from oobleck_slurm.timeouts import DEFAULT_TIMEOUTS

JOIN_S = 120.0  # two threads on a shared machine
TIMEOUT = dt.timedelta(seconds=60)
WIDTH, LAYERS, FEATURES, MICROBATCHES = 2, 3, 16, 2


class LoggedGroup:
    """A real process group whose posts are logged (kind, work) in order."""

    def __init__(self, pg: dist.ProcessGroup, log: list[tuple[str, Any]]) -> None:
        self.pg, self.log = pg, log

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work:
        work = self.pg.allgather(outputs, inputs)
        self.log.append(("gather", work))
        return work

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]]) -> dist.Work:
        work = self.pg.reduce_scatter(outputs, inputs)
        self.log.append(("scatter", work))
        return work

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        work = self.pg._allgather_base(output, input)
        self.log.append(("gather", work))
        return work

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: dist.ReduceScatterOptions) -> dist.Work:
        work = self.pg._reduce_scatter_base(output, input, opts)
        self.log.append(("scatter", work))
        return work

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work:
        work = self.pg.allreduce(tensors)
        self.log.append(("allreduce", work))
        return work


def layers() -> list[nn.Module]:
    """The same layers in every thread (their own generator: threads share torch's global one)."""
    out = [nn.Linear(FEATURES, FEATURES, dtype=torch.float64) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (p for layer in out for p in layer.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return out


def inputs(rank: int, mb: int) -> torch.Tensor:
    return torch.randn(4, FEATURES, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + mb))


def loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def resharded_backward(rank: int, store: dist.Store, logs: dict[int, list], shards: dict[int, list],
                       by_allreduce: bool) -> None:
    """One rank of a resharded stage of WIDTH: MICROBATCHES forwards and backwards (1F1B's order on the
    last stage), logging posts, waits and each layer's end of backward. `by_allreduce`: gloo's way of
    reduce-scattering (comm.SCATTER_BY_ALLREDUCE), else NCCL's."""
    log: list[tuple[str, Any]] = []
    group = LoggedGroup(make_group(store, "stage", rank, WIDTH, TIMEOUT, "gloo", TIMEOUT), log)

    def wait(work: dist.Work) -> None:
        log.append(("wait", work))
        work.wait()

    sharded = [ShardedLayer(layer, WIDTH, rank, OptimSpec("adamw")) for layer in layers()]
    for layer in sharded:
        layer.begin_step(keep=False)
    params = StageParams(sharded, group, wait, keep=False, bucket_bytes=25 * 2**20, scatter_by_allreduce=by_allreduce)
    stage = Stage([s.module for s in sharded], 0, True, torch.device("cpu"), loss, params=params)
    for mb in range(MICROBATCHES):
        stage.forward(mb, inputs(rank, mb), torch.zeros(1), 1.0)
        stage.backward(mb, None, lambda i: log.append(("done", i)))
    params.finish()
    logs[rank] = log
    shards[rank] = [s.grad_shard.clone() for s in sharded]


@pytest.mark.parametrize("by_allreduce", [False, True], ids=["nccl-way", "gloo-way"])
def test_a_resharded_stage_waits_for_a_layers_scatter_behind_the_next_layers_backward(by_allreduce: bool) -> None:
    store = dist.HashStore()
    logs: dict[int, list] = {}
    shards: dict[int, list] = {}
    threads = [threading.Thread(target=resharded_backward, args=(r, store, logs, shards, by_allreduce), daemon=True)
               for r in range(WIDTH)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert sorted(logs) == list(range(WIDTH)), "a rank failed or hung"
    for log in logs.values():
        scatter = "allreduce" if by_allreduce else "scatter"  # a resharded stage all-reduces nothing else
        scatters = [work for kind, work in log if kind == scatter]  # layers 2, 1, 0 of each microbatch
        assert len(scatters) == LAYERS * MICROBATCHES
        posted_at = {id(work): i for i, (kind, work) in enumerate(log) if kind == scatter}
        waited = {id(work): i for i, (kind, work) in enumerate(log) if kind == "wait"}
        for mb in range(MICROBATCHES):
            posted = scatters[mb * LAYERS : (mb + 1) * LAYERS]
            for later, earlier in zip(posted, posted[1:]):  # layer i's scatter, then layer i - 1's
                # layer i's scatter is waited for only once layer i - 1's backward ran (its scatter posted)
                assert waited[id(later)] > posted_at[id(earlier)], log
        assert all(id(work) in waited for work in scatters)  # every scatter completed by the stage's end
    # the shards hold the sum of both ranks' gradients over both microbatches
    ref = layers()
    for rank in range(WIDTH):
        for mb in range(MICROBATCHES):
            h = inputs(rank, mb)
            for layer in ref:
                h = layer(h)
            loss(h, torch.zeros(1)).backward()
    for i, layer in enumerate(ref):
        whole = torch.cat([p.grad.reshape(-1) for p in layer.parameters()])
        got = torch.cat([shards[r][i] for r in range(WIDTH)])[: whole.numel()]
        assert torch.allclose(got, whole, rtol=1e-12, atol=1e-15)


def test_poll_pauses_start_with_a_yield_and_never_exceed_the_poll_period() -> None:
    from oobleck_slurm.engine.abort import poll_pauses

    first, most = DEFAULT_TIMEOUTS.nccl_poll_first, DEFAULT_TIMEOUTS.nccl_poll
    pauses = poll_pauses(first, most)
    seen = [next(pauses) for _ in range(40)]
    assert seen[0] == 0.0 and seen[1] == first  # a short operation is re-checked at once
    assert seen == sorted(seen) and max(seen) == most == seen[-1]  # then backs off to the poll period
    assert most <= DEFAULT_TIMEOUTS.abort_poll  # an abort is still seen within its poll period


def test_a_polled_wait_returns_when_the_work_completes_and_leaves_on_the_failed_key() -> None:
    from oobleck_slurm.engine.abort import poll_work

    store = dist.HashStore()
    polled, aborted = threading.Event(), threading.Event()

    class Counted:
        """A real work, its `is_completed` reads counted: the peer joins once the poller has polled."""

        def __init__(self, work: dist.Work) -> None:
            self.work, self.reads = work, 0

        def is_completed(self) -> bool:
            self.reads += 1
            if self.reads == 3:
                polled.set()
            return self.work.is_completed()

        def wait(self) -> bool:
            return self.work.wait()

    def peer() -> None:
        pg = make_group(store, "poll", 1, 2, TIMEOUT, "gloo", TIMEOUT)
        assert polled.wait(JOIN_S)
        pg.allreduce([torch.ones(4)]).wait()
        assert aborted.wait(JOIN_S)  # the second work completes once the poller has left it
        pg.allreduce([torch.ones(4)]).wait()

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    pg = make_group(store, "poll", 0, 2, TIMEOUT, "gloo", TIMEOUT)
    t = torch.ones(4)
    work = Counted(pg.allreduce([t]))
    watch = FailureWatch(store, 0)
    poll_work(work, watch, JOIN_S, DEFAULT_TIMEOUTS, lambda: None)  # type: ignore[arg-type]
    assert work.reads >= 3 and torch.equal(t, torch.full((4,), 2.0))
    # a work whose peer has not posted its part: the failed key ends the wait, the abort hook runs
    pending = pg.allreduce([torch.ones(4)])
    store.set(keys.failed(0), "{}")
    with pytest.raises(GenerationAborted):
        poll_work(pending, watch, JOIN_S, DEFAULT_TIMEOUTS, aborted.set)
    assert aborted.is_set()
    pending.wait()
    thread.join(JOIN_S)
    assert not thread.is_alive()
