"""Shared pytest fixtures.

Slurm: tests marked ``@pytest.mark.slurm`` (or asking for ``slurm_cluster``) run against the local
multi-node Slurm lab of tests/slurm/. The lab is started once per session, only when such a test is
collected and run, and stopped at the end only if this session started it. It never skips: a lab
that cannot start fails those tests with the daemons' logs, because CI must run them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SLURM_DIR = Path(__file__).resolve().parent / "slurm"

# Every job of the suite runs its gloo groups under NCCL's ordering rules (engine/nccl_order.py), in
# this process and in every worker it starts (they inherit the environment, through Slurm too): a
# schedule that would deadlock on a GPU then fails here. One operation at a time per rank: a posting
# order that differs between ranks across groups deadlocks, as kernels that fill a device would.
os.environ.setdefault("OOBLECK_NCCL_ORDER", "1")
os.environ.setdefault("OOBLECK_NCCL_ORDER_SLOTS", "1")


def _slurm_module(stem: str) -> ModuleType:
    """tests/slurm/{stem}.py (lab, drill), imported by path: tests/ is not a package."""
    name = f"oobleck_slurm_tests_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SLURM_DIR / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Any]:
    """The running lab (a tests/slurm/lab.py ``SlurmLab``): ``folder``, ``conf``, ``nodes``,
    ``spare_nodes``, ``kill_node``, ``start_node``, ``start_spare``, ``stop_spare``, ``set_down``,
    ``resume``, ``node_state``, ``wait_node``, ``reset``. SLURM_CONF is set in os.environ.

    The lab is held one *test* at a time (`_slurm_lab_held`), not one session at a time: a session
    that holds it only while one of its tests runs never makes another wait for the whole of its run.
    Under pytest-xdist the lab's tests share one worker (`xdist_group`), but if they ever do not (a
    crashed worker's tests handed to another, a test that asks for the lab at run time), they take
    turns instead of one waiting 600 s for a lab its own run holds (seen once in CI)."""
    lab = _slurm_module("lab").SlurmLab()
    script_env = {**os.environ, "OOBLECK_SLURM_SESSION_HELD": "1"}  # start.sh: the lock is ours now
    with lab.exclusive(holder=f"starting the lab for {_session_name()}"):
        done = subprocess.run(
            ["bash", str(SLURM_DIR / "start.sh")],
            env=script_env, capture_output=True, text=True, timeout=900, check=False,
        )
        if done.returncode != 0:
            pytest.fail(
                f"tests/slurm/start.sh failed (exit {done.returncode}):\n{done.stderr}", pytrace=False
            )
        started = "# started" in done.stdout
        if not started:
            lab.reset()  # a reused lab may hold what an interrupted session left behind
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(lab.conf)
    try:
        yield lab
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        # Only a lone session stops a lab it started: an xdist worker cannot know whether another
        # worker of its run still needs it (tests/run_all.sh starts the lab before pytest anyway).
        if started and not os.environ.get("PYTEST_XDIST_WORKER"):
            subprocess.run(["bash", str(SLURM_DIR / "stop.sh")], env=dict(os.environ), timeout=700, check=False)


def _session_name() -> str:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"pytest pid {os.getpid()}" + (f" (xdist {worker})" if worker else "")


@pytest.fixture(scope="session")
def slurm_drill() -> ModuleType:
    """tests/slurm/drill.py: inject a fault into a lab job's node and measure what follows."""
    return _slurm_module("drill")


def _uses_the_lab(item: pytest.Item) -> bool:
    return item.get_closest_marker("slurm") is not None or "slurm_cluster" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)  # before xdist's, which names each test's group from these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (tests/run_all.sh: `-n 2 --dist loadgroup`) every test of the Slurm lab runs
    in one worker: the lab is one cluster, held by one test session at a time (`SlurmLab.exclusive`).
    They come first, so that this longest group starts at once while the other worker takes the rest
    (handed out in collection order); started last, it ran alone for its ~6 minutes. A module's tests
    that share a module-scoped fixture (a measurement made once for all of them) run in one worker."""
    for item in items:
        if _uses_the_lab(item):
            item.add_marker(pytest.mark.xdist_group("slurm_lab"))
        elif _shares_a_module_fixture(item):  # made once, not once per worker
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    # stable: then the slow tests (real jobs), so that the short ones fill the workers' ends
    items.sort(key=lambda item: (not _uses_the_lab(item), item.get_closest_marker("slow") is None))


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs[-1].scope in ("module", "class", "package")
                                    for defs in info.name2fixturedefs.values() if defs)


@pytest.fixture(autouse=True)
def _slurm_lab_held(request: pytest.FixtureRequest) -> Iterator[None]:
    """For Slurm tests: start the lab if needed, hold it for this test alone (`SlurmLab.exclusive`:
    tests kill and reset nodes, which would break another test's jobs), and afterwards put it back as
    start.sh left it (no jobs, node1..node4 idle, spares stopped), so that tests do not depend on each
    other."""
    if not _uses_the_lab(request.node):
        yield
        return
    lab = request.getfixturevalue("slurm_cluster")
    with lab.exclusive(holder=f"{request.node.nodeid} in {_session_name()}"):
        try:
            yield
        finally:
            lab.reset()


@pytest.fixture(scope="session")
def templates_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One templates cache for the session's jobs (profiles and templates are made once per input),
    shared by the xdist workers: the cache is safe with concurrent writers (planning/test_cache.py)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's base folder, above each worker's own
    path = root / "templates_cache"
    path.mkdir(exist_ok=True)
    return path
