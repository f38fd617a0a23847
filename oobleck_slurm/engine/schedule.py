"""The 1F1B (one-forward-one-backward) action list of one pipeline stage.

Stage i of S first runs min(S - i - 1, M) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. So stage i never holds the activations of more than
S - i microbatches, and backwards run in microbatch order (the last action is always B(M-1), after
which the stage's gradients are final and can be all-reduced).
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Action(NamedTuple):
    op: Literal["F", "B"]
    microbatch: int  # index within this pipeline's microbatches, 0-based


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Actions of stage `stage` (0-based) of `num_stages` for `num_microbatches` microbatches."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"one_f_one_b: stage {stage} is not in [0, {num_stages})")
    if num_microbatches < 0:
        raise ValueError(f"one_f_one_b: num_microbatches must be >= 0, got {num_microbatches}")
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [Action("F", m) for m in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < num_microbatches:
        actions.append(Action("F", fwd))
        fwd += 1
        actions.append(Action("B", bwd))
        bwd += 1
    actions.extend(Action("B", m) for m in range(bwd, num_microbatches))
    return actions
