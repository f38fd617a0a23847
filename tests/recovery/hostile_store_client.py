"""A process without the job secret that writes into a running job's store: another user of the cluster
who found the store's port (tests/recovery/test_hostile_store.py). It knows no secret and imports nothing
of the package: it is given the names and values to write.

    python hostile_store_client.py ADDRESS.json PLAN.json SECONDS

ADDRESS.json: the job folder's elastic.json, where the supervisor publishes its store's host and port;
the client imports torch first and then waits for it (started with the job, it is ready when the store
is: on a loaded machine, started only once the address was there, it came too late for a short job).

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
ADDRESS_WAIT_S = 300.0


def main() -> int:
    address_path, plan_path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    plan = json.loads(open(plan_path).read())
    deadline = time.monotonic() + ADDRESS_WAIT_S
    while True:
        try:
            address = json.loads(open(address_path).read())
            break
        except (OSError, ValueError):  # not published yet, or being written
            if time.monotonic() > deadline:
                print(f"no store address in {address_path} after {ADDRESS_WAIT_S} s", file=sys.stderr)
                return 1
            time.sleep(0.01)
    store = dist.TCPStore(address["host"], int(address["port"]), is_master=False, timeout=dt.timedelta(seconds=10))
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
