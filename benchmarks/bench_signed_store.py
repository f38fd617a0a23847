"""The signed store's cost (protocol/signed_store.py): each store request through `SignedStore` against
the same request on the raw TCPStore client, and a gloo group of two processes formed over each.

    python benchmarks/bench_signed_store.py [--ops 2000] [--value-bytes 64] [--groups 10] [--json PATH]

A server in this process (as the supervisor hosts it), a raw client and a signed one, loopback. Per
request kind, `--ops` requests of a `--value-bytes` value on each (interleaved: a drifting load hits
both alike; a step number is a few bytes, a plan kilobytes: try 4096), median and 90th percentile in
microseconds:

    set           one write
    get           one read of an existing key (signed: verified)
    wait          a wait on an existing key (signed: the store's wait, then one read to verify it)
    check         an existing key (signed: the check, then one read to verify it)
    multi_get     four existing keys in one request (the observer's read each period)
    add           a counter (signed: a compare-and-set of the sealed integer; two requests after the first)

Then the signer's own CPU per request (a name, a seal, an open: no store), and `--groups` times each
(interleaved, both ranks released together): a ProcessGroupGloo of 2 ranks (two spawned processes, a
generation's world group: set, wait, get per rank) built over the raw client and over a signed one, the
slower rank's seconds from the constructor's call to its return, median. Writes
benchmarks/results/bench_signed_store.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oobleck_slurm.protocol.signed_store import SignedStore, StoreSigner

RESULTS = Path(__file__).parent / "results" / "bench_signed_store.json"
SECRET = bytes(range(32))
TIMEOUT = dt.timedelta(seconds=60)


def quantiles(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"median_us": round(statistics.median(times) * 1e6, 1), "p90_us": round(times[int(0.9 * len(times))] * 1e6, 1)}


def per_request(raw: dist.Store, signed: SignedStore, n: int, value: bytes) -> dict[str, dict[str, Any]]:
    """Each request kind `n` times on both stores, interleaved (raw, signed, raw, ...): a machine whose
    load drifts (2 shared cores) loads both alike."""
    many = [f"bench/k{i}" for i in range(4)]
    requests: dict[str, Callable[[dist.Store], Any]] = {
        "set": lambda s: s.set("bench/set", value),
        "get": lambda s: s.get(many[0]),
        "wait": lambda s: s.wait([many[0]], TIMEOUT),
        "check": lambda s: s.check([many[0]]),
        "multi_get": lambda s: s.multi_get(many),
        "add": lambda s: s.add("bench/counter", 1),
    }
    for store in (raw, signed):
        for k in many:
            store.set(k, value)
    rows = {}
    for op, request in requests.items():
        times: dict[str, list[float]] = {"raw": [], "signed": []}
        for i in range(n + 1):
            for kind, store in (("raw", raw), ("signed", signed)):
                t0 = time.perf_counter()
                request(store)
                if i:  # the first is a warm-up (a new key, the name cache)
                    times[kind].append(time.perf_counter() - t0)
        rows[op] = {kind: quantiles(t) for kind, t in times.items()}
    return rows


def local_cpu(n: int, value: bytes) -> dict[str, float]:
    """The signer's own work per request, without the store: a name, a seal, an open (microseconds)."""
    signer = SignedStore.with_secret(dist.HashStore(), SECRET).signer
    sealed = signer.seal("gen1/progress", value)
    out = {}
    for what, fn in (("name (cached)", lambda: signer.name("gen1/progress")),
                     ("name (new)", lambda: StoreSigner(SECRET).name("gen1/progress")),
                     ("seal", lambda: signer.seal("gen1/progress", value)),
                     ("open", lambda: signer.open("gen1/progress", sealed))):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[what] = round((time.perf_counter() - t0) / n * 1e6, 2)
    return out


def _rank(port: int, rank: int, rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    stores = {"raw": raw, "signed": SignedStore.with_secret(
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT), SECRET)}
    times: dict[str, list[float]] = {"raw": [], "signed": []}
    for r in range(rounds + 1):
        for kind, store in stores.items():  # interleaved, as the requests
            raw.add(f"bench/go/{kind}{r}", 1)  # both ranks start each build together
            if rank == 0:
                _release(raw, f"{kind}{r}")
            raw.wait([f"bench/ready/{kind}{r}"], TIMEOUT)
            t0 = time.perf_counter()
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{kind}{r}/world", store), rank, 2, TIMEOUT)
            if r:  # the first build of each kind is a warm-up (imports, first connections)
                times[kind].append(time.perf_counter() - t0)
            pg.allreduce([torch.zeros(1)]).wait()
            del pg
    out.put((rank, times))


def _release(raw: dist.TCPStore, name: str) -> None:
    """Rank 0: once both ranks arrived, let them go."""
    while int(raw.add(f"bench/go/{name}", 0)) < 2:
        time.sleep(0.0005)
    raw.set(f"bench/ready/{name}", b"1")


def group_build(server: dist.TCPStore, rounds: int) -> dict[str, dict[str, float]]:
    """A 2-rank gloo group built `rounds` times on each store, in two spawned processes: the slower
    rank's build time, median and max (seconds)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(server.port, r, rounds, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    rows = {}
    for kind in ("raw", "signed"):
        both = [max(a, b) for a, b in zip(results[0][kind], results[1][kind])]
        rows[kind] = {"median_s": round(statistics.median(both), 4), "max_s": round(max(both), 4)}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--value-bytes", type=int, default=64)
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
    signed = SignedStore.with_secret(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT), SECRET)
    value = b"x" * args.value_bytes
    rows = per_request(raw, signed, args.ops, value)
    print(f"{'request':12}{'raw median':>12}{'signed median':>15}{'raw p90':>10}{'signed p90':>12}   (us)")
    for op, row in rows.items():
        r, s = row["raw"], row["signed"]
        print(f"{op:12}{r['median_us']:>12.1f}{s['median_us']:>15.1f}{r['p90_us']:>10.1f}{s['p90_us']:>12.1f}")
    cpu = local_cpu(args.ops * 10, value)
    print("the signer alone (us): " + ", ".join(f"{k} {v}" for k, v in cpu.items()))
    groups = group_build(server, args.groups)
    print(f"gloo group of 2 built: raw {groups['raw']['median_s']:.4f} s, signed {groups['signed']['median_s']:.4f} s "
          f"(median of {args.groups})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "ops": args.ops, "value_bytes": args.value_bytes, "torch": torch.__version__, "python": platform.python_version(),
        "cpus": mp.cpu_count(), "load_average": list(os.getloadavg()), "requests": rows, "signer_us": cpu,
        "group_build": groups}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
