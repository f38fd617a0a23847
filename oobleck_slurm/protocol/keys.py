"""Every key of the job's TCPStore, built here and nowhere else; the JSON values' types are in
records.py (each record class names its key), the rest are plain integers or timestamps.

The store is hosted by the supervisor (it never trains, so no worker death takes it down). Workers
are named `worker_id(node, local)`: a node runs `workers_per_node` workers, one per device, and the
node is the unit of membership (a plan places pipelines on nodes; a lost worker loses its node).

    current_gen                  the newest published generation
    gen{g}/config                members (node ids in rank order), ExecPlan, transfers, resume step, source
    gen{g}/failed                set by the coordinator: leave generation g now (abortable waits see it)
    gen{g}/report/{worker}       a worker's step and valid layers after aborting g (for the next plan)
    gen{g}/rebuilt/{worker}      group-build and state-copy seconds and bytes (recovery events)
    gen{g}/progress              the last completed step (rank 0)
    gen{g}/compute               that step's compute-only seconds per rank (rank 0; stragglers)
    gen{g}/first_step            the first completed step of g and its time (recovery events)
    gen{g}/errors                count of collective errors in g; gen{g}/error/{worker}: each one
    gen{g}/oom/{worker}          the worker ran out of device memory in g: what it was doing (it then exits)
    gen{g}/mismatch              replicas of a layer disagreed at a check: the nodes to evict (rank 0)
    gen{g}/{group}               the prefix under which a process group of g is built
    eval_logged                  the last step whose evaluation rank 0 logged (not repeated at a resume)
    worker/{worker}/step         the last step in which the worker reached a collective (names a hung rank)
    worker/{worker}/ready        the worker process is up (imports, model code) and can join
    fault/{i}                    a drill's fault i fired (fired once, even across restarts)
    fault/killed_at/{node}       when a drill injected a fault into a node (detection times)
    health/{node}/{nonce}        the prefix of a joining node's health-check collective

In the store each key is hidden under a name derived from it with the job secret and each value,
counters included, is signed (signed_store.py).
"""

from __future__ import annotations

CURRENT_GEN = "current_gen"
EVAL_LOGGED = "eval_logged"


def worker_id(node: str, local: int) -> str:
    """The name of worker `local` (0 .. workers_per_node - 1) of `node`."""
    return f"{node}:{local}"


def node_workers(node: str, workers_per_node: int) -> list[str]:
    return [worker_id(node, i) for i in range(workers_per_node)]


def config(g: int) -> str:
    return f"gen{g}/config"


def failed(g: int) -> str:
    return f"gen{g}/failed"


def report(g: int, worker: str) -> str:
    return f"gen{g}/report/{worker}"


def rebuilt(g: int, worker: str) -> str:
    return f"gen{g}/rebuilt/{worker}"


def progress(g: int) -> str:
    return f"gen{g}/progress"


def step_compute(g: int) -> str:
    return f"gen{g}/compute"


def first_step(g: int) -> str:
    return f"gen{g}/first_step"


def replica_mismatch(g: int) -> str:
    return f"gen{g}/mismatch"


def errors(g: int) -> str:
    return f"gen{g}/errors"


def error(g: int, worker: str) -> str:
    return f"gen{g}/error/{worker}"


def out_of_memory(g: int, worker: str) -> str:
    return f"gen{g}/oom/{worker}"


def loss_spike_stop(g: int, worker: str) -> str:
    return f"gen{g}/loss_spikes/{worker}"


def group_prefix(g: int, group: str) -> str:
    return f"gen{g}/{group}"


def worker_step(worker: str) -> str:
    return f"worker/{worker}/step"


def worker_ready(worker: str) -> str:
    return f"worker/{worker}/ready"


def fault_fired(index: int) -> str:
    return f"fault/{index}"


def fault_time(node: str) -> str:
    return f"fault/killed_at/{node}"


def health_prefix(node: str, nonce: int) -> str:
    return f"health/{node}/{nonce}"
