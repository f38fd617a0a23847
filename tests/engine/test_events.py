"""The JSONL event log: flushed whole lines, readers that skip a partly written last line."""

import json
import multiprocessing as mp

from oobleck_slurm.protocol.events import EventLog, EventTail, events_path, read_events


def test_emit_and_read_back(tmp_path):
    path = events_path(tmp_path)
    with EventLog(path) as log:
        log.emit("plan", pipelines=[[0], [1, 2]])
        rec = log.emit("step", step=0, loss=5.5)
        # Visible before close: each line is flushed.
        assert read_events(path, "step") == [rec]
    records = read_events(path)
    assert [r["kind"] for r in records] == ["plan", "step"]
    assert all(isinstance(r["t"], float) for r in records)


def test_partial_last_line_is_skipped_then_seen_when_complete(tmp_path):
    path = tmp_path / "events.jsonl"
    EventLog(path).emit("step", step=1)
    tail = EventTail(path)
    assert [r["step"] for r in tail.poll()] == [1]
    line = json.dumps({"t": 1.0, "kind": "step", "step": 2})
    with open(path, "a") as f:
        f.write(line[:10])
    assert read_events(path) and len(read_events(path)) == 1
    assert tail.poll() == []
    with open(path, "a") as f:
        f.write(line[10:] + "\n")
    assert [r["step"] for r in tail.poll()] == [2]
    assert tail.poll() == []


def test_missing_file_reads_empty(tmp_path):
    assert read_events(tmp_path / "none.jsonl") == []
    assert EventTail(tmp_path / "none.jsonl").poll() == []


def _writer(path, who):
    log = EventLog(path)
    for i in range(200):
        log.emit("refused", peer=f"writer-{who}", reason=f"record {i} " + "x" * 300)  # long lines, schema fields


def test_concurrent_appenders_do_not_interleave(tmp_path):
    path = tmp_path / "events.jsonl"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert len(read_events(path)) == 600
    assert len(path.read_text().splitlines()) == 600
