"""templates_cache: atomic, checked by hash, safe with concurrent writer processes."""

from __future__ import annotations

import json
import multiprocessing as mp

from oobleck_slurm.planning.cache import TemplateCache


def _writer(root: str, worker: int, rounds: int) -> None:
    cache = TemplateCache(root)
    for i in range(rounds):
        # Every worker writes the shared entry and one of its own, interleaved with the others.
        cache.store("templates", {"shared": True}, {"value": list(range(2000))})
        cache.store("templates", {"worker": worker, "i": i % 3}, {"value": [worker, i % 3] * 500})
        data, status = cache.load("templates", {"shared": True})
        assert status == "hit" and data == {"value": list(range(2000))}


def test_concurrent_writer_processes(tmp_path):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    cache = TemplateCache(tmp_path)
    assert cache.load("templates", {"shared": True})[1] == "hit"
    for w in range(4):
        for i in range(3):
            data, status = cache.load("templates", {"worker": w, "i": i})
            assert status == "hit" and data == {"value": [w, i] * 500}
    index = cache.index()["entries"]
    assert len(index) == 1 + 4 * 3  # no lost update in the manifest
    assert not list(tmp_path.rglob("*.tmp"))  # no temp file left behind
    assert not cache.problems


def test_corrupt_and_stale_entries_are_reported_and_regenerated(tmp_path):
    cache = TemplateCache(tmp_path)
    inputs = {"model": "tiny", "nodes": 4}
    path = cache.store("profile", inputs, {"x": 1})
    assert cache.get_or_create("profile", inputs, lambda: {"x": 2}) == ({"x": 1}, "hit")

    entry = json.loads(path.read_text())
    entry["data"]["x"] = 5  # edited without updating the hash
    path.write_text(json.dumps(entry))
    assert cache.load("profile", inputs) == (None, "corrupt")
    assert cache.get_or_create("profile", inputs, lambda: {"x": 3}) == ({"x": 3}, "corrupt")
    assert cache.load("profile", inputs) == ({"x": 3}, "hit")

    path.write_text(path.read_text()[:40])  # truncated
    assert cache.load("profile", inputs)[1] == "corrupt"

    # An entry made for other inputs, copied under this key (the original's failure): never used.
    other = cache.store("profile", {"model": "tiny", "nodes": 2}, {"x": 9})
    path.write_text(other.read_text())
    assert cache.load("profile", inputs) == (None, "stale")
    assert len(cache.problems) == 4 and all(str(path) in p for p in cache.problems)


def test_other_inputs_get_other_keys(tmp_path):
    cache = TemplateCache(tmp_path)
    cache.store("templates", {"max_nodes": 4}, {"t": 4})
    assert cache.load("templates", {"max_nodes": 8}) == (None, "miss")
