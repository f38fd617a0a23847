"""Synthetic profiles for planner tests: any shape, no torch, no measurement."""

from __future__ import annotations

import random

from oobleck_slurm.planning.profile import LayerProfile, Link, Profile


def make_profile(
    times: list[float],
    *,
    devices_per_node: int = 1,
    memory: float = 1e12,
    state: list[int] | None = None,
    act: list[int] | None = None,
    out: list[int] | None = None,
    workspace: list[int] | None = None,
    intra: Link = Link(1e-5, 1e10),
    inter: Link = Link(5e-5, 1e9),
) -> Profile:
    n = len(times)
    state = state or [1000] * n
    act = act or [100] * n
    out = out or [10_000] * n
    workspace = workspace or [0] * n
    layers = tuple(
        LayerProfile(f"l{i}", t / 3, 2 * t / 3, s // 4, s // 4, s - 2 * (s // 4), o, a, w)
        for i, (t, s, a, o, w) in enumerate(zip(times, state, act, out, workspace))
    )
    links = {"intra_node": intra, "inter_node": inter, "allreduce_intra": intra, "allreduce_inter": inter}
    return Profile(layers, "test-device", int(memory), devices_per_node, 1, "fp32", "adamw", links, "test", None, "k")


def random_profile(rng: random.Random, n_layers: int, devices_per_node: int, tight_memory: bool) -> Profile:
    times = [rng.uniform(0.001, 0.1) for _ in range(n_layers)]
    state = [rng.randint(100, 5000) for _ in range(n_layers)]
    act = [rng.randint(10, 2000) for _ in range(n_layers)]
    out = [rng.randint(1_000, 5_000_000) for _ in range(n_layers)]
    # Tight: half the model's state per device, plus room for three of the largest layer outputs (a
    # stage keeps its output per microbatch in flight and a boundary gradient each way: cost.stage_memory)
    # and the largest workspace, so that in-flight counts, boundaries and workspaces decide as well as the
    # state (about a third of the cases differ from unlimited memory, a quarter fit on no node count).
    # Only tight profiles draw workspaces: the others (and what their callers draw next) stay as they were.
    workspace = [rng.randint(0, 2_000_000) for _ in range(n_layers)] if tight_memory else None
    memory = (sum(state) / 2 + 2000 + 3 * max(out) + max(workspace)) / 0.9 if workspace else 1e12
    return make_profile(
        times, devices_per_node=devices_per_node, memory=memory, state=state, act=act, out=out, workspace=workspace,
        intra=Link(rng.uniform(0, 1e-4), rng.uniform(1e8, 1e10)), inter=Link(rng.uniform(0, 1e-3), rng.uniform(1e7, 1e9)),
    )
