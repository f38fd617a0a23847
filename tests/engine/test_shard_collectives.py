"""The collectives of a wide stage (engine/shard.py) in their flat forms give the bits the list forms
gave, and both ways of reduce-scattering a stage's gradients (comm.SCATTER_BY_ALLREDUCE: NCCL's
reduce-scatter, gloo's all-reduce in place) give the same bits on gloo, whose reduce_scatter_tensor is
an all-reduce of a copy of its input. The NCCL ordering mode takes NCCL's branch, so that the CPU
suite runs it. Ranks are threads of this process, each with its own real gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from exec_plans import make_plan
from test_nccl_order import client, run_ranks, store
from torch import nn

from oobleck_slurm.engine import nccl_order
from oobleck_slurm.engine.comm import Generation, make_group
from oobleck_slurm.engine.nccl_order import OrderedGroup, Slots
from oobleck_slurm.engine.shard import ShardedLayer, gather_bucket, reduce_scatter_bucket
from oobleck_slurm.engine.spec import OptimSpec
from oobleck_slurm.timeouts import JobTimeouts

WIDTH = 4
TIMEOUTS = JobTimeouts()


def layers_of(rank: int) -> list[ShardedLayer]:
    """Three layers of one stage, rank `rank`'s shards, with a gradient of the rank's own."""
    torch.manual_seed(0)
    layers = [ShardedLayer(nn.Linear(96, 80 + 16 * k), WIDTH, rank, OptimSpec("adamw", lr=1e-3)) for k in range(3)]
    g = torch.Generator().manual_seed(100 + rank)
    for layer in layers:
        layer.begin_step(keep=True)
        layer.grad_full.copy_(torch.randn(layer.grad_full.shape, generator=g, dtype=layer.grad_full.dtype))
    return layers


def group_of(s: dist.Store, prefix: str, rank: int) -> OrderedGroup:
    pg = make_group(client(s), prefix, rank, WIDTH, TIMEOUTS.td("step_timeout"), "gloo", TIMEOUTS.td("connect_timeout"))
    return OrderedGroup(pg, prefix, Slots(1))


def test_flat_gathers_give_the_list_forms_bits() -> None:
    s = store()

    def gathered(rank: int) -> list[torch.Tensor]:
        group, layers = group_of(s, "gather", rank), layers_of(rank)
        out = []
        for positions in ([0], [0, 1, 2]):
            gather_bucket(layers, positions, group).complete(lambda work: work.wait())
            out += [layers[p].full.clone() for p in positions]
        for layer in layers:  # the list form, as shard.py posted it before
            listed = torch.empty_like(layer.full)
            group.allgather([list(listed.chunk(WIDTH))], [layer.shard]).wait()
            out.append(listed)
        return out

    for got in run_ranks(WIDTH, gathered):
        assert not isinstance(got, BaseException), got
        one, bucket, listed = got[:1], got[1:4], got[4:]
        assert torch.equal(one[0], listed[0])
        assert all(torch.equal(a, b) for a, b in zip(bucket, listed, strict=True))


def test_both_reduce_scatter_branches_give_the_same_bits_on_gloo() -> None:
    s = store()

    def scattered(rank: int) -> dict[str, list[torch.Tensor]]:
        group = group_of(s, "scatter", rank)
        out: dict[str, list[torch.Tensor]] = {}
        for by_allreduce in (False, True):
            for positions in ([1], [2, 1, 0]):
                layers = layers_of(rank)
                reduce_scatter_bucket(layers, positions, group, by_allreduce).complete(lambda work: work.wait())
                out[f"{by_allreduce}{positions}"] = [layers[p].grad_shard.clone() for p in positions]
            layers = layers_of(rank)  # resharded: one microbatch's gradient, added to the shard
            work, unpack = layers[0].scatter_microbatch(group, by_allreduce)
            work.wait()
            unpack()
            out[f"{by_allreduce} microbatch"] = [layers[0].grad_shard.clone()]
        return out

    results = run_ranks(WIDTH, scattered)
    for rank, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        for case in ("[1]", "[2, 1, 0]", " microbatch"):
            nccl_way, gloo_way = got[f"False{case}"], got[f"True{case}"]
            assert all(torch.equal(a, b) for a, b in zip(nccl_way, gloo_way, strict=True)), (rank, case)
    # and they are the sums: rank j's shard of the sum of every rank's gradient
    whole = sum(layers_of(r)[1].grad_full for r in range(WIDTH))
    for rank, got in enumerate(results):
        size = whole.numel() // WIDTH
        torch.testing.assert_close(got["False[1]"][0], whole[rank * size : (rank + 1) * size], rtol=1e-6, atol=1e-6)


def test_the_ordering_mode_takes_nccls_reduce_scatter(monkeypatch) -> None:
    s = store()
    plan = make_plan(6, [[0, 6]], [2])

    def choice(ordered: str) -> bool:
        monkeypatch.setenv(nccl_order.ENV, ordered)
        gen = Generation(client(s), int(ordered), 0, 1, plan, TIMEOUTS)
        gen.release()
        return gen.scatter_by_allreduce

    assert choice("1") is False  # NCCL's branch: the one a GPU runs
    assert choice("0") is True  # plain gloo: its all-reduce in place
