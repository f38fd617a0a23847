"""Pure engine logic: 1F1B schedule, plan validation and roles, layer groups, lr."""

import math

import pytest
from exec_plans import make_plan
from hypothesis import given
from hypothesis import strategies as st

from oobleck_slurm.engine.layout import (
    ExecPlan,
    PipelineSpec,
    PlanError,
    edge_pieces,
    layer_groups,
    pass_slices,
    reduce_pieces,
    sample_range,
)
from oobleck_slurm.engine.lr import lr_at
from oobleck_slurm.engine.schedule import one_f_one_b
from oobleck_slurm.engine.shard import bucket_runs
from oobleck_slurm.planning.cost import stage_fold


@given(st.integers(1, 6), st.integers(0, 12), st.data())
def test_1f1b_runs_every_microbatch_once_in_order_with_bounded_memory(num_stages, num_mb, data):
    stage = data.draw(st.integers(0, num_stages - 1))
    actions = one_f_one_b(stage, num_stages, num_mb)
    fwd = [m for op, m in actions if op == "F"]
    bwd = [m for op, m in actions if op == "B"]
    assert fwd == list(range(num_mb)) and bwd == list(range(num_mb))
    in_flight = 0
    for op, m in actions:
        in_flight += 1 if op == "F" else -1
        assert 0 <= in_flight <= num_stages - stage
        if op == "B":
            assert ("F", m) in actions[: actions.index(("B", m))]
    if num_mb:
        assert actions[-1] == ("B", num_mb - 1)


def test_1f1b_warmup_shape():
    assert [a.op for a in one_f_one_b(0, 3, 4)] == list("FFFBFBBB")
    assert [a.op for a in one_f_one_b(2, 3, 4)] == list("FBFBFBFB")


def test_roles_holders_and_groups():
    plan = make_plan(6, [[0, 6], [0, 3, 6], [0, 2, 4, 6]], [2, 3, 3])
    assert plan.ranks == [0, 1, 2, 3, 4, 5]
    r = plan.role(4)
    assert (r.pipeline, r.stage, r.layers, r.prev_rank, r.next_rank) == (2, 1, range(2, 4), 3, 5)
    assert (r.mb_start, r.mb_count) == (5, 3)
    assert plan.role(7) is None  # spare
    assert plan.holders(2) == (0, 1, 4)
    groups = layer_groups(plan)
    assert groups[(0, 1, 3)] == [0, 1] and groups[(0, 2, 5)] == [4, 5]
    assert sum(len(v) for v in groups.values()) == 6
    assert ExecPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    "pipelines, match",
    [
        ([PipelineSpec((0,), (0, 6), 0, 4), PipelineSpec((0, 1), (0, 3, 6), 4, 4)], "already used"),
        ([PipelineSpec((0,), (0, 5), 0, 8)], "must run from 0 to 6"),
        ([PipelineSpec((0, 1), (0, 3, 3, 6), 0, 8)], "needs 3 layer bounds"),
        ([PipelineSpec((0, 1), (0, 0, 6), 0, 8)], "strictly increasing"),
        ([PipelineSpec((0,), (0, 6), 0, 3), PipelineSpec((1,), (0, 6), 4, 4)], "expected a slice starting at 3"),
        ([PipelineSpec((0,), (0, 6), 0, 7)], "cover 7 microbatches, the step has 8"),
    ],
)
def test_bad_plans_are_clear_errors(pipelines, match):
    with pytest.raises(PlanError, match=match):
        ExecPlan(6, 8, tuple(pipelines))


def test_lr_warmup_then_cosine_to_min():
    kw = dict(lr=1.0, warmup_steps=4, total_steps=14, min_lr=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(100, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw, decay="constant") == 1.0
    with pytest.raises(ValueError, match="decay must be one of"):
        lr_at(0, lr=1.0, warmup_steps=0, total_steps=1, decay="step")


def test_wide_stages_roles_pieces_and_json():
    # pipeline 0: one stage of 4 ranks (0-3); pipeline 1: a stage of 2 ranks (4, 5), then 2 of 1 (6, 7)
    plan = ExecPlan(6, 8, (PipelineSpec((0,), (0, 6), 0, 4, (4,)), PipelineSpec((4, 6, 7), (0, 3, 5, 6), 4, 4, (2, 1, 1))))
    assert plan.ranks == list(range(8)) and plan.sharded and plan.max_width == 4
    r = plan.role(5)
    assert (r.stage, r.stage_ranks, r.index, r.width, r.next_ranks, r.prev_ranks) == (0, (4, 5), 1, 2, (6,), ())
    assert plan.role(6).prev_ranks == (4, 5) and plan.role(2).index == 2
    assert plan.holders(1) == (0, 4) and plan.holder_stages(1) == ((0, 1, 2, 3), (4, 5))
    # layer 1: cut at the 4-wide stage's shards; shards 0-1 of it lie in shard 0 of the 2-wide stage
    assert reduce_pieces(plan, 1) == [(0, 4, (0, 4)), (1, 4, (1, 4)), (2, 4, (2, 5)), (3, 4, (3, 5))]
    assert reduce_pieces(plan, 5) == [(i, 4, (i, 7)) for i in range(4)]
    assert edge_pieces(4, (4, 5), (6,)) == [(4, 6, 0, 2), (5, 6, 2, 4)]
    assert edge_pieces(8, (0, 1), (2, 3, 4, 5)) == [(0, 2, 0, 2), (0, 3, 2, 4), (1, 4, 4, 6), (1, 5, 6, 8)]
    assert ExecPlan.from_json(plan.to_json()) == plan
    one = make_plan(6, [[0, 6]], [8])
    assert "widths" not in one.to_json()["pipelines"][0]  # width-1 plans keep their JSON
    assert one.pipelines[0] == PipelineSpec((0,), (0, 6), 0, 8, (1,))
    with pytest.raises(PlanError, match="powers of two"):
        ExecPlan(6, 8, (PipelineSpec((0,), (0, 6), 0, 8, (3,)),))
    with pytest.raises(PlanError, match="already used"):
        ExecPlan(6, 8, (PipelineSpec((0,), (0, 6), 0, 4, (2,)), PipelineSpec((1,), (0, 6), 4, 4)))
    kept = ExecPlan(6, 8, (PipelineSpec((0, 2), (0, 3, 6), 0, 8, (2, 2), (True, False)),))
    assert ExecPlan.from_json(kept.to_json()) == kept and kept.role(1).keep and not kept.role(3).keep
    assert "keep" not in plan.to_json()["pipelines"][0]  # plans with no kept stage keep their JSON
    with pytest.raises(PlanError, match="kept only where wider than 1"):
        ExecPlan(6, 8, (PipelineSpec((0, 1), (0, 3, 6), 0, 8, (1, 1), (True, False)),))


def test_slice_moves_recut_shards_on_a_node_and_copy_whole_replicas_across():
    from oobleck_slurm.engine.shard import slice_moves

    # layer 0 held at width 4 on ranks 0-3 and at width 1 on rank 4
    held = {0: {0: (4, 0)}, 1: {0: (4, 1)}, 2: {0: (4, 2)}, 3: {0: (4, 3)}, 4: {0: (1, 0)}}
    # ranks 0, 1 take it at width 2 (no copy named: the same node re-cuts), rank 6 at width 1 from rank 4
    moves = slice_moves([((0, 1), range(0, 1)), ((6,), range(0, 1))], held, [(0, 4, 6)])
    assert moves == [(0, 0, 0, 0, 16), (0, 1, 0, 16, 32), (0, 2, 1, 32, 48), (0, 3, 1, 48, 64), (0, 4, 6, 0, 64)]
    # a shard already held whole stays (a move to itself); a lost replica part is refused
    assert slice_moves([((4,), range(0, 1))], held, []) == [(0, 4, 4, 0, 64)]
    with pytest.raises(RuntimeError, match="no whole replica"):
        slice_moves([((5,), range(0, 1))], {0: {0: (2, 0)}}, [(0, 0, 5)])


@given(st.lists(st.integers(1, 100), min_size=1, max_size=30), st.integers(1, 300), st.booleans())
def test_bucket_runs_cut_layers_in_order_at_the_cap(sizes, cap, first_alone):
    runs = bucket_runs(sizes, cap, first_alone)
    assert [p for run in runs for p in run] == list(range(len(sizes)))  # every layer once, in order
    if first_alone:
        assert runs[0] == [0]
    for k, run in enumerate(runs):
        body = run if not (first_alone and k == 0) else []
        # a run closes at the first layer that brings it to the cap, never earlier; only the last may be short
        assert all(sum(sizes[p] for p in body[:j]) < cap for j in range(1, len(body)))
        if body and k < len(runs) - 1:
            assert sum(sizes[p] for p in body) >= cap


@given(st.integers(1, 8), st.sampled_from([1, 2, 4, 8]), st.integers(0, 9))
def test_pass_slices_give_every_sample_to_one_rank(b, width, mb_count):
    k = stage_fold(b, width)
    per_rank = [pass_slices(b, width, index, mb_count) for index in range(width)]
    assert all(len(passes) == math.ceil(mb_count / k) for passes in per_rank)
    seen = [[0] * b for _ in range(mb_count)]
    for index, passes in enumerate(per_rank):
        for p, slices in enumerate(passes):
            assert sum(hi - lo for _, lo, hi in slices) <= b * k // width  # the most a pass gives a rank
            for m, lo, hi in slices:
                assert p * k <= m < (p + 1) * k and 0 <= lo < hi <= b
                for sample in range(lo, hi):
                    seen[m][sample] += 1
            if k == 1 and mb_count:  # the width divides b: the rank's slice of every microbatch
                assert slices == [(p, *sample_range(b, width, index))]
    assert all(count == 1 for row in seen for count in row)

