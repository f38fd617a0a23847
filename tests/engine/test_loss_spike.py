"""The loss-spike policy's pure decisions (engine/loss_spike.py): exhaustive over small windows and
loss sequences, and by hypothesis over any finite ones, against a plain restatement of the rule."""

from __future__ import annotations

import itertools
import math
import statistics as stats
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oobleck_slurm.engine.loss_spike import SpikePolicy, SpikeState, judge, stop_message


def reference(policy: SpikePolicy, losses: list[float]) -> list[tuple[str, float | None]]:
    """The rule restated, with each step's bar: the window is the last `window` accepted losses; judged
    once it holds `warmup`; a spike is a loss above mean + sigma * pstdev; the max_consecutive'th spike
    in a row stops."""
    window: list[float] = []
    run = 0
    out: list[tuple[str, float | None]] = []
    for loss in losses:
        if not math.isfinite(loss):
            out.append(("non_finite", None))
            continue
        bar = stats.fmean(window) + policy.sigma * stats.pstdev(window) if len(window) >= policy.warmup else None
        if bar is not None and loss > bar:
            run += 1
            out.append(("stop" if run >= policy.max_consecutive else "skip", bar))
            continue
        run = 0
        window = (window + [loss])[-policy.window:]
        out.append(("accept", bar))
    return out


def run(policy: SpikePolicy, losses: list[float]) -> tuple[list[str], SpikeState]:
    state = SpikeState()
    verdicts = []
    for step, loss in enumerate(losses):
        judgement, state = judge(policy, state, step, loss)
        verdicts.append(judgement.verdict)
        assert state.step == step + 1
        assert judgement.skips == (judgement.verdict != "accept")
    return verdicts, state


# Small losses whose spikes are unambiguous at sigma 1 (no loss lies within rounding of a bar).
VALUES = (1.0, 2.0, 50.0, math.nan)


@pytest.mark.parametrize("window,warmup,max_consecutive", [(2, 2, 1), (2, 2, 2), (3, 2, 2), (3, 3, 3), (4, 2, 1)])
def test_every_sequence_of_six_losses_is_judged_by_the_rule(window: int, warmup: int, max_consecutive: int) -> None:
    policy = SpikePolicy(sigma=1.0, window=window, warmup=warmup, max_consecutive=max_consecutive)
    for losses in itertools.product(VALUES, repeat=6):
        verdicts, state = run(policy, list(losses))
        assert verdicts == [v for v, _ in reference(policy, list(losses))], losses
        assert len(state.losses) <= window and len(state.spikes) <= len(losses)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=20.0), max_size=40), st.integers(2, 6), st.integers(1, 4),
       st.floats(min_value=0.5, max_value=6.0))
def test_any_finite_losses_are_judged_by_the_rule_and_the_state_round_trips(
        losses: list[float], window: int, max_consecutive: int, sigma: float) -> None:
    policy = SpikePolicy(sigma=sigma, window=window, warmup=2, max_consecutive=max_consecutive)
    state = SpikeState()
    for step, loss in enumerate(losses):
        # what a joining rank receives (a collective of float64) and a checkpoint's record hold: the same state
        assert SpikeState.from_floats(state.to_floats()) == state
        assert SpikeState.from_json(state.to_json()) == state
        assert len(state.to_floats()) <= SpikeState.floats_len(policy)
        _, state = judge(policy, state, step, loss)
    verdicts, _ = run(policy, losses)
    # the rule, up to rounding: the reference sums differently, so from a loss within rounding of its bar on
    # the two may part; every verdict before that one agrees
    for verdict, (expected, bar), loss in zip(verdicts, reference(policy, losses), losses):
        if bar is not None and abs(loss - bar) <= 1e-9 * (1 + abs(bar)):
            break
        assert verdict == expected


def test_a_spike_after_warmup_is_skipped_and_kept_out_of_the_window() -> None:
    policy = SpikePolicy(sigma=3.0, window=4, warmup=3, max_consecutive=2)
    verdicts, state = run(policy, [2.0, 2.1, 1.9, 9.0, 2.0, 9.0, 9.0])
    assert verdicts == ["accept", "accept", "accept", "skip", "accept", "skip", "stop"]
    assert state.losses == (2.0, 2.1, 1.9, 2.0) and state.spikes == (5, 6)


def test_a_spike_before_warmup_is_accepted() -> None:
    policy = SpikePolicy(sigma=1.0, window=4, warmup=3, max_consecutive=1)
    assert run(policy, [1.0, 100.0, 1.0])[0] == ["accept"] * 3


def test_a_non_finite_loss_changes_nothing_but_the_step() -> None:
    policy = SpikePolicy(sigma=1.0, window=3, warmup=2, max_consecutive=2)
    _, state = run(policy, [1.0, 2.0, 9.0])
    judgement, after = judge(policy, state, 3, math.inf)
    assert judgement.verdict == "non_finite" and after.losses == state.losses and after.spikes == state.spikes


def test_a_state_for_another_step_is_refused() -> None:
    with pytest.raises(ValueError, match="state is for step 0, asked to judge step 3"):
        judge(SpikePolicy(), SpikeState(), 3, 1.0)


@pytest.mark.parametrize("bad,message", [
    ([], "is a mapping"),
    ({"step": -1, "losses": [], "spikes": []}, "'step' must be an integer >= 0"),
    ({"step": 1, "losses": [float("nan")], "spikes": []}, "'losses' must be a list of finite numbers"),
    ({"step": 1, "losses": [], "spikes": ["x"]}, "'spikes' must be a list of step numbers"),
])
def test_a_bad_saved_state_is_named(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpikeState.from_json(bad)


@pytest.mark.parametrize("kwargs,key", [({"sigma": 0.0}, "sigma"), ({"sigma": math.inf}, "sigma"),
                                        ({"window": 1, "warmup": 1}, "window"), ({"warmup": 1}, "warmup"),
                                        ({"window": 5, "warmup": 6}, "warmup"), ({"max_consecutive": 0}, "max_consecutive"),
                                        ({"on_consecutive": "restart"}, "on_consecutive"), ({"max_rollbacks": 0}, "max_rollbacks")])
def test_a_bad_policy_is_refused_naming_its_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=f"training.loss_spike.{key}"):
        SpikePolicy(**kwargs)


def judged(policy: SpikePolicy, losses: list[float]) -> tuple[Any, SpikeState]:
    """The last judgement and the state after `losses`, judged in order from step 0."""
    state, judgement = SpikeState(), None
    for step, loss in enumerate(losses):
        judgement, state = judge(policy, state, step, loss)
    return judgement, state


def test_the_stop_message_names_the_steps_the_checkpoint_and_what_to_do() -> None:
    policy = SpikePolicy(sigma=3.0, window=4, warmup=3, max_consecutive=2, on_consecutive="stop")
    judgement, state = judged(policy, [2.0, 2.1, 1.9, 9.0, 9.5])
    assert judgement is not None and judgement.verdict == "stop"
    text = stop_message(policy, state.spikes, judgement, 2)
    assert "steps 3, 4" in text and "checkpoint is step 2" in text and "max_consecutive is 2" in text
    assert "no complete checkpoint" in stop_message(policy, state.spikes, judgement, None)


def test_the_rollback_message_names_the_steps_and_what_the_job_does() -> None:
    policy = SpikePolicy(sigma=3.0, window=4, warmup=3, max_consecutive=2)
    assert policy.on_consecutive == "rollback" and policy.rollbacks == 3
    assert SpikePolicy(on_consecutive="stop").rollbacks == 0
    judgement, state = judged(policy, [2.0, 2.1, 1.9, 9.0, 9.5])
    assert judgement is not None and judgement.verdict == "stop"
    text = stop_message(policy, state.spikes, judgement, 2)
    assert "steps 3, 4" in text and "at or before step 3" in text and "up to step 4" in text
