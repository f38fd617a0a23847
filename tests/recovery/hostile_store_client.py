"""A process without the job secret that writes into a running job's store: another user of the cluster
who found the store's port (tests/recovery/test_hostile_store.py). It knows no secret and imports nothing
of the package: it is given the names and values to write.

    python hostile_store_client.py HOST PORT PLAN.json SECONDS

PLAN.json: {"once": [[name, value_hex], ...], "add": [name, ...], "repeat": [[name, value_hex], ...]}.
It writes "once" and adds 1 to each "add" name at once, then writes "repeat" every REPEAT_S until
SECONDS have passed or the store went away (the job ended). Prints the number of writes made.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time

import torch.distributed as dist

REPEAT_S = 0.1


def main() -> int:
    host, port, plan_path, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    plan = json.loads(open(plan_path).read())
    store = dist.TCPStore(host, port, is_master=False, timeout=dt.timedelta(seconds=10))
    writes = 0
    for name, value in plan["once"]:
        store.set(name, bytes.fromhex(value))
        writes += 1
    for name in plan["add"]:
        store.add(name, 1)
        writes += 1
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for name, value in plan["repeat"]:
                store.set(name, bytes.fromhex(value))
                writes += 1
            time.sleep(REPEAT_S)
    except RuntimeError:  # the store went away with the job
        pass
    print(writes, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
