"""Labelled synthetic metric traces of one training job, for the detector's tests and benchmark.

Healthy rhythm (what must never raise a flag):
- training steps of period P (3-8 s): a compute phase (GPU busy, high power, little traffic) and a
  communication phase (all-reduce: network busy, GPU half idle); sampled every second, each sample
  the average over the past second (as psutil and NVML report), so phase edges give fractions;
- pipeline stages: nodes of stage s run their phases s x 0.15 s late, plus a little per-node jitter;
- lasting per-node differences: host memory per stage (+-2%), GPU temperature by position (+-1.5 C);
- data loading (steady disk reads with a burst at each step start), a checkpoint every 60 s (disk
  writes on every node, each starting 0-1 s late at its own rate), no link errors, noise on everything, and rare single-sample glitches (0.1% of readings);
- one recovery per trace: a node disappears, every node idles for 5-15 s (GPU near 0, power low,
  CPU busy copying), a quarter of them receive state for one second, the rhythm restarts in a new
  phase, and a replacement node appears 10 s later.

Faults (on one node, or two in a quarter of the traces; onset `t0`; label = node and t0):
    cpu_hog      host CPU +25..45 points, compute 8% slower, GPU a little less busy
    mem_leak     host memory grows 0.3-1 GiB/s from t0 (slow onset, one metric)
    net_flap     the link goes down for 1-3 s (throughput 5%, 20-200 link errors/s), then up for
                 1-4 s, again and again (intermittent, network metrics only)
    thermal      GPU temperature rises 20 C with a 15 s time constant; past +8 C the GPU throttles
                 (clock -25%, power -20%, compute +20%) (slow onset)
    power_cap    GPU power capped 35% lower at once, clock -15%, compute +10%
    disk_stall   the data loader's reads stop (disk read ~0): one metric
    degrading    GPU utilisation and power sink 40% over 60 s, compute grows to 1.5x (slow onset)
    straggler    compute-only time per microbatch 1.15-1.5x, GPU a little busier; the step time is
                 the same as everyone's (the all-reduce waits for it): MegaScale's compute-only case
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METRICS = ("gpu.util", "gpu.power_w", "gpu.temp_c", "gpu.sm_mhz", "cpu.util", "mem.used_gib", "net.rx_mbps",
           "net.tx_mbps", "net.errors_ps", "disk.read_mbps", "disk.write_mbps", "compute_s", "step_s")
FAULT_KINDS = ("cpu_hog", "mem_leak", "net_flap", "thermal", "power_cap", "disk_stall", "degrading", "straggler")
KINDS = ("healthy", *FAULT_KINDS)
_M = {name: i for i, name in enumerate(METRICS)}
SUB = 10  # sub-samples per second for phase averaging


@dataclass
class SynthTrace:
    kind: str
    nodes: list[str]  # column names; the last one is the replacement node
    values: np.ndarray  # time x node x metric, NaN where a node does not report
    times: np.ndarray
    faulty: dict[str, float]  # node -> fault onset time
    recovery: tuple[float, float]  # the healthy recovery dip [start, end)

    def samples(self):
        """(t, {node: {metric: value}}) as the agents would report them."""
        for ti, t in enumerate(self.times):
            sample = {}
            for ni, node in enumerate(self.nodes):
                row = self.values[ti, ni]
                if not np.isnan(row[0]):
                    sample[node] = {m: float(v) for m, v in zip(METRICS, row)}
            yield float(t), sample


def make_trace(kind: str, n_nodes: int, seed: int, duration: int = 240) -> SynthTrace:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    rng = np.random.default_rng(seed)
    T, N = duration, n_nodes + 1  # one extra column: the replacement node
    t = np.arange(T, dtype=float)
    period = rng.uniform(3.0, 8.0)
    comm_frac = rng.uniform(0.2, 0.4)
    stages = min(4, n_nodes)
    stage = np.arange(N) % stages
    lag = stage * 0.15 + rng.normal(0, 0.05, N)

    # The recovery: [r0, r1) everyone idles; `lost` disappears at r0; the replacement joins at r1 + 10.
    r0 = float(rng.integers(40, T - 60))
    r1 = r0 + float(rng.integers(5, 16))
    lost = int(rng.integers(0, n_nodes))
    restart_shift = rng.uniform(0, period)

    # Fraction of each second spent computing, per node: phase averaged over SUB sub-samples.
    tau = (t[:, None] - 1 + (np.arange(SUB)[None, :] + 0.5) / SUB)  # T x SUB
    tau = tau[:, None, :] - lag[None, :, None]  # T x N x SUB
    tau = np.where(tau >= r1, tau + restart_shift, tau)
    phase = np.mod(tau, period) / period
    comp = np.mean(phase >= comm_frac, axis=2)  # T x N: comm phase first, then compute
    step_start = np.mean(phase < 1.0 / period, axis=2)  # the first second of each step
    idle = ((t >= r0) & (t < r1))[:, None]  # T x 1

    noise = lambda scale: rng.normal(0, scale, (T, N))  # noqa: E731
    v = np.zeros((T, N, len(METRICS)))
    util = 35 + 60 * comp + noise(2.0)
    power = 250 + 420 * comp + noise(12.0)
    v[..., _M["gpu.util"]] = np.where(idle, 2 + noise(1.0), util)
    v[..., _M["gpu.power_w"]] = np.where(idle, 90 + noise(5.0), power)
    # Temperature follows power with a 20 s lag, plus each node's cooling position.
    p = v[..., _M["gpu.power_w"]]
    temp = np.empty_like(p)
    temp[0] = 40 + 0.05 * p[0]
    for i in range(1, T):
        temp[i] = temp[i - 1] + (40 + 0.05 * p[i] - temp[i - 1]) / 20.0
    v[..., _M["gpu.temp_c"]] = temp + rng.normal(0, 1.5, N)[None, :] + noise(0.3)
    v[..., _M["gpu.sm_mhz"]] = 1980 - 60 * comp + noise(10.0)
    v[..., _M["cpu.util"]] = np.where(idle, 60 + noise(4.0), 25 + 20 * (1 - comp) + noise(2.5))
    stage_mem = rng.uniform(-0.02, 0.02, stages)[stage]
    v[..., _M["mem.used_gib"]] = 180 * (1 + stage_mem)[None, :] + noise(0.3)
    net = np.where(idle, 150 + noise(20.0), 200 + 3000 * (1 - comp) + noise(60.0))
    v[..., _M["net.rx_mbps"]] = net
    v[..., _M["net.tx_mbps"]] = net * 0.98 + noise(40.0)
    receivers = rng.random(N) < 0.25  # state copy during the recovery: one second on a quarter of nodes
    copy_t = int(r0) + 2
    v[copy_t, receivers, _M["net.rx_mbps"]] = rng.uniform(2000, 4000, int(receivers.sum()))
    v[..., _M["net.errors_ps"]] = 0.0  # a healthy fabric: no link errors
    v[..., _M["disk.read_mbps"]] = np.where(idle, 10 + noise(2.0), 120 + 300 * step_start + noise(10.0))
    # Checkpoint: every node writes for 4 s at about 800 MB/s; each write starts 0-1 s late and its
    # rate differs by up to 10% from node to node and from one checkpoint to the next.
    start = 50 + rng.integers(0, 2, (T // 60 + 1, N))
    into = np.mod(t, 60.0)[:, None] - start[(t // 60).astype(int)]
    ckpt = (into >= 0) & (into < 4)
    rate = 800 * rng.uniform(0.9, 1.1, (T // 60 + 1, N))[(t // 60).astype(int)]
    v[..., _M["disk.write_mbps"]] = np.where(ckpt, rate, 5) + noise(1.0)
    compute = 0.120 * (1 + rng.normal(0, 0.01, N))[None, :] * (1 + noise(0.01))
    v[..., _M["compute_s"]] = compute
    v[..., _M["step_s"]] = period + rng.normal(0, 0.01, (T, 1)) + noise(0.002)

    # Rare glitches: a reading that is 2-4x off or zero.
    glitch = rng.random(v.shape) < 0.001
    v = np.where(glitch, v * rng.choice([0.0, 2.0, 3.0, 4.0], v.shape), v)

    faulty: dict[str, float] = {}
    if kind != "healthy":
        count = 2 if rng.random() < 0.25 and n_nodes >= 8 else 1
        candidates = [n for n in range(n_nodes) if n != lost]
        for n in rng.choice(candidates, size=count, replace=False):
            t0 = float(rng.integers(70, T - 80))
            _inject(kind, v, int(n), int(t0), t, rng)
            faulty[f"node{n}"] = t0

    v[int(r0):, lost, :] = np.nan  # the lost node reports nothing from the recovery on
    v[: int(r1) + 10, n_nodes, :] = np.nan  # the replacement reports from r1 + 10 on
    names = [f"node{i}" for i in range(n_nodes)] + ["r1"]
    return SynthTrace(kind, names, v, t, faulty, (r0, r1))


def _inject(kind: str, v: np.ndarray, n: int, t0: int, t: np.ndarray, rng: np.random.Generator) -> None:
    after = t >= t0
    since = np.maximum(t - t0, 0.0)
    col = lambda name: (slice(None), n, _M[name])  # noqa: E731
    if kind == "cpu_hog":
        v[col("cpu.util")] += np.where(after, rng.uniform(25, 45), 0.0)
        v[col("compute_s")] *= np.where(after, 1.08, 1.0)
        v[col("gpu.util")] -= np.where(after, 5.0, 0.0)
    elif kind == "mem_leak":
        v[col("mem.used_gib")] += rng.uniform(0.3, 1.0) * since
    elif kind == "net_flap":
        down = np.zeros(len(t), dtype=bool)
        i = t0
        while i < len(t):
            on = int(rng.integers(1, 4))
            down[i:i + on] = True
            i += on + int(rng.integers(1, 5))
        for name in ("net.rx_mbps", "net.tx_mbps"):
            v[col(name)] = np.where(down, v[col(name)] * 0.05, v[col(name)])
        v[col("net.errors_ps")] = np.where(down, rng.uniform(20, 200, len(t)), v[col("net.errors_ps")])
    elif kind == "thermal":
        excess = 20 * (1 - np.exp(-since / 15.0)) * after
        v[col("gpu.temp_c")] += excess
        hot = excess > 8
        v[col("gpu.sm_mhz")] *= np.where(hot, 0.75, 1.0)
        v[col("gpu.power_w")] *= np.where(hot, 0.8, 1.0)
        v[col("compute_s")] *= np.where(hot, 1.2, 1.0)
    elif kind == "power_cap":
        v[col("gpu.power_w")] *= np.where(after, 0.65, 1.0)
        v[col("gpu.sm_mhz")] *= np.where(after, 0.85, 1.0)
        v[col("compute_s")] *= np.where(after, 1.1, 1.0)
    elif kind == "disk_stall":
        v[col("disk.read_mbps")] = np.where(after, rng.uniform(0, 2, len(t)), v[col("disk.read_mbps")])
    elif kind == "degrading":
        frac = np.minimum(since / 60.0, 1.0)
        v[col("gpu.util")] *= 1 - 0.4 * frac
        v[col("gpu.power_w")] *= 1 - 0.4 * frac
        v[col("compute_s")] *= 1 + 0.5 * frac
    elif kind == "straggler":
        v[col("compute_s")] *= np.where(after, rng.uniform(1.15, 1.5), 1.0)
        v[col("gpu.util")] += np.where(after, 3.0, 0.0)
