"""An elastic worker process: `python -m oobleck_slurm.engine.elastic_process JOB_DIR NODE LOCAL`.

A node agent starts one per device of its node (`cluster.workers_per_node`: one per GPU, or that many
CPU workers); this is worker LOCAL of node NODE, and its rank in a generation is
`members.index(NODE) * workers_per_node + LOCAL`, the planner's device numbering. On a GPU node the
agent pins it to GPU LOCAL before CUDA initialises (see agent/main.py). It follows the
coordinator through the store (keys: oobleck_slurm/protocol/keys.py).

A config with `stop` ends the worker; with `save` {root, step} it first writes its layers (those it
writes in its plan: `_writes`) as the checkpoint of `step`, completing its pending step if it is one behind
(an on-demand checkpoint at preemption: the requeued job resumes from it). After the last step every
worker writes its share of the layers as the final checkpoint (`checkpoints/step{steps}`): the
trained model.

Survivors never restart: they keep their process, their layers and optimizer state, and build the
next generation's groups under a new store prefix; once those have formed, every member has left the
previous generation and its groups are released.

A frozen supervisor (SIGSTOPped, or cut off without its connections breaking) must not stall training:
the writes a worker makes every step (its step, rank 0's progress and compute times) go through one
background thread on a connection of its own (`StepWriter`), coalesced by key, so the training loop
never blocks on the store; and a thread watches the job folder's elastic.json for a higher supervisor
epoch, which aborts the generation as a failure would. The worker then follows the new supervisor.

Fault injection (drills, tests, benchmarks: the job
folder's faults.json) is engine/faults.py's `FaultHooks`, called at its hook points.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from oobleck_slurm.cluster.jobdir import CHECKPOINTS_DIR, ELASTIC_FILE, JOB_SPEC_FILE, TRACES_DIR, JobDir, load_secret
from oobleck_slurm.cluster.lease import PublishedEpoch, read_lease
from oobleck_slurm.engine.abort import AbortableGeneration, GenerationAborted, build_generation, clone_store
from oobleck_slurm.engine.checkpoint import CheckpointWriter, latest_complete, layer_file
from oobleck_slurm.engine.comm import connect_store, is_collective_error
from oobleck_slurm.engine.faults import FaultHooks
from oobleck_slurm.engine.integrity import CORRUPT_BIT, ReplicaMismatchError, flip_bit
from oobleck_slurm.engine.layout import ExecPlan
from oobleck_slurm.engine.loss_spike import stop_message
from oobleck_slurm.engine.recovery import can_complete, reach_step
from oobleck_slurm.engine.requests import RequestWatcher, StepTracer, enable_flight_recorder
from oobleck_slurm.engine.spec import JobSpec
from oobleck_slurm.engine.worker import Worker
from oobleck_slurm.errors import OobleckError
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED
from oobleck_slurm.protocol import keys, records
from oobleck_slurm.protocol.events import EventLog, events_path
from oobleck_slurm.protocol.records import (
    FirstStep,
    GenerationConfig,
    LastStep,
    LossSpikeStop,
    OutOfMemory,
    Rebuilt,
    ReplicaMismatch,
    StepCompute,
    WorkerError,
    WorkerReport,
    read_launch_config,
)
from oobleck_slurm.protocol.wire import ProtocolError
from oobleck_slurm.timeouts import JobTimeouts


class StepWriter:
    """The per-step store writes of a worker, made by one daemon thread on its own store connection:
    `set` never blocks, the latest value of each key wins (a stalled store costs memory for one value
    per key, not one per step). `retire` abandons a writer whose store went away; a write blocked on it
    ends with the store's timeout, in the background."""

    def __init__(self, store: object) -> None:
        import torch.distributed as dist

        self.store = clone_store(store) if isinstance(store, dist.Store) else store
        self._pending: dict[str, str] = {}
        self._cv = threading.Condition()
        self._retired = False
        threading.Thread(target=self._run, name="step-writer", daemon=True).start()

    def set(self, key: str, value: str) -> None:
        with self._cv:
            self._pending.pop(key, None)  # re-inserted last: writes keep the order of their latest values
            self._pending[key] = value
            self._cv.notify()

    def retire(self) -> None:
        with self._cv:
            self._retired = True
            self._pending.clear()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._retired:
                    self._cv.wait()
                if self._retired:
                    return
                key = next(iter(self._pending))
                value = self._pending.pop(key)
            try:
                self.store.set(key, value)  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - the store went away: the worker learns it on its own path
                return


ERROR_CHARS = 400  # a reported collective error is cut to this length (the event log keeps it)
FOLLOW_POLL_S = 0.05  # elastic.json is read this often while a new supervisor is awaited


class LossSpikesStopped(OobleckError, RuntimeError):
    """training.loss_spike judged `max_consecutive` steps in a row spikes: the worker stops (every rank
    does, at the same step) after reporting why (records.LossSpikeStop); the coordinator stops the job."""


class WorkerOutOfMemory(OobleckError, RuntimeError):
    """A worker ran out of device memory (reported first: `_report_out_of_memory`); it exits with
    EXIT_FAILED like any failed worker, its node is lost, and the coordinator reads the report."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory error (the CUDA caching allocator's, or a fault drill's on the CPU),
    raised directly or as the cause of the error that ends the worker."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


class ElasticWorker:
    def __init__(self, job_dir: Path, node: str, local: int) -> None:
        self.job_dir, self.node, self.local = job_dir, node, local
        self.name = keys.worker_id(node, local)
        self.job = JobSpec.from_json((job_dir / JOB_SPEC_FILE).read_text())
        self.launch = launch = read_launch_config(job_dir / ELASTIC_FILE)
        self.per_node = launch.workers_per_node
        if not 0 <= local < self.per_node:
            raise ValueError(f"worker index {local} out of range: the job runs {self.per_node} worker(s) per node")
        self.timeouts = JobTimeouts(**launch.timeouts)
        self.checkpoint_interval = launch.checkpoint_interval
        self.checkpoint_root = launch.checkpoint_dir or str(job_dir / CHECKPOINTS_DIR)
        self.log = EventLog(events_path(job_dir))
        self.secret = load_secret(job_dir)  # signs the store (protocol/signed_store.py)
        self.store = connect_store(launch.host, launch.port, self.timeouts, self.secret, self.log, self.name)
        self.step_writer = StepWriter(self.store)
        # Set when elastic.json names a supervisor of a higher epoch than the one this worker follows.
        self.superseded = threading.Event()
        if launch.failover_s > 0:
            threading.Thread(target=self._watch_epoch, args=(PublishedEpoch(job_dir / ELASTIC_FILE),),
                             name="epoch-watch", daemon=True).start()
        device = torch.device("cuda", torch.cuda.current_device()) if self.job.backend == "nccl" else None
        enable_flight_recorder(self.job.flight_recorder)  # before any process group: torch reads it then
        self.worker = Worker(self.job, 0, device)
        # profile-steps and a hang's dumps (engine/requests.py): a thread looks at the job folder
        self.requests = RequestWatcher(job_dir, self.name, self.timeouts.request_poll, lambda: self.worker.rank)
        self.tracer = StepTracer(job_dir / TRACES_DIR, self.name, device is not None, self._trace_written)
        self.faults = FaultHooks(self.job.extra.get("faults", []), self.store, node, local, self.timeouts)
        self.worker.before_update = self.faults.before_update
        self.worker.before_scatter = self.faults.before_scatter
        if self.faults.spikes:
            self.worker.loss_factor = self.faults.loss_factor
        self.faults.on_corrupt = self._corrupt
        self.gen: AbortableGeneration | None = None  # the generation this worker last built
        self.last_step: LastStep | None = None  # the last step it completed
        self.members: tuple[str, ...] = ()  # the current generation's nodes, in rank order
        self.step_reported = False  # this step's progress is in the store (at its first wait)
        self.writer: CheckpointWriter | None = None
        self.eval_logged: int | None = None  # the step of the last evaluation this worker logged (as rank 0)
        self.phase = "groups"  # what it does now, for a report of running out of device memory

    def _trace_written(self, path: Path, start: int, stop: int) -> None:
        self.log.emit("trace_written", node=self.node, worker=self.local, rank=self.worker.rank, start=start,
                      stop=stop, path=str(path))

    def _on_wait(self) -> None:
        self.faults.before_wait(self.worker.step)
        if not self.step_reported:
            self._report_step()
            self.step_reported = True

    def _report_step(self) -> None:
        """Per-rank progress for the supervisor: this worker reached a collective of step s (it did its
        compute up to there). A rank hung before its first collective of s stays at s-1 while every
        peer waits for it in a collective of s: that names it. Once per step: one store write."""
        self.step_writer.set(keys.worker_step(self.name), str(self.worker.step))

    def _watch_epoch(self, published: PublishedEpoch) -> None:
        while True:
            time.sleep(self.timeouts.epoch_poll)
            if published.read() > self.launch.epoch:
                self.superseded.set()

    def _report_out_of_memory(self, g: int, error: BaseException) -> None:
        """Name the failure before this worker exits: an `out_of_memory` event with what it was doing
        and its device's bytes, and the store record the coordinator reads when its node is lost (it
        then runs no plan that would fail the same way: supervisor/decisions.py). Best effort: the
        worker exits anyway, and its exit alone is a node loss."""
        device = self.worker.device
        allocated = peak = capacity = -1  # no device: the CPU
        if device.type == "cuda":
            allocated, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
            capacity = torch.cuda.get_device_properties(device).total_memory
        message = f"{type(error).__name__}: {error}"[:ERROR_CHARS]
        try:
            self.log.emit("out_of_memory", node=self.node, worker=self.local, generation=g, step=self.worker.step,
                          phase=self.phase, error=message, allocated=allocated if allocated >= 0 else None,
                          peak=peak if peak >= 0 else None, capacity=capacity if capacity >= 0 else None)
            records.put(self.store, OutOfMemory(step=self.worker.step, phase=self.phase, error=message,
                                                allocated=allocated, peak=peak, capacity=capacity, t=time.time()),
                        g, self.name)
        except Exception:  # noqa: BLE001 - the store or the log went away: the exit still reports the loss
            traceback.print_exc()

    def _report_error(self, g: int, error: BaseException) -> None:
        """Tell the coordinator that a collective of generation g failed here (see coordinator.py)."""
        message = f"{type(error).__name__}: {error}"[:ERROR_CHARS]
        records.put(self.store, WorkerError(step=self.worker.step, error=message, t=time.time()), g, self.name)
        self.store.add(keys.errors(g), 1)

    # ---- the generation loop -----------------------------------------------------------------------

    def _wait_key(self, key: str, seconds: float) -> bool:
        try:
            self.store.wait([key], dt.timedelta(seconds=seconds))
            return True
        except Exception:  # noqa: BLE001 - the store's timeout error type varies between versions
            return False

    def run(self) -> None:
        self.store.set(keys.worker_ready(self.name), repr(time.time()))
        g = int(self.store.get(keys.CURRENT_GEN))
        while True:
            try:
                g = self._next(g)
            except Exception as e:  # noqa: BLE001 - sorted below: the store's loss, or not ours to handle
                if is_out_of_memory(e):
                    self._report_out_of_memory(g, e)
                    raise WorkerOutOfMemory(f"worker {self.name} ran out of device memory ({self.phase} at step "
                                            f"{self.worker.step}, generation {g})") from e
                if self._store_alive():
                    raise
                g = self._follow_new_supervisor(e)
                continue
            if g < 0:
                return

    def _next(self, g: int) -> int:
        """Run generation g (or skip it, or stop): the next generation to wait for, or -1 once done."""
        if not self._wait_key(keys.config(g), self.timeouts.run_timeout):
            if not self._store_alive():
                raise ConnectionError(f"the store went away while waiting for {keys.config(g)}")
            raise TimeoutError(f"no configuration for generation {g} within {self.timeouts.run_timeout} s")
        cfg = records.get(self.store, GenerationConfig, g)
        if cfg.stop:
            if cfg.save is not None:
                self.phase = "groups"
                self._groups_to_save(g, cfg)
                self.phase = "checkpoint"
                self.save_checkpoint(cfg.save.root, cfg.save.step)
            return -1
        if self.node not in cfg.members:
            return g + 1
        try:
            self.run_generation(g, cfg)
            return -1
        except Exception as e:
            if not self._store_alive():
                raise
            if not isinstance(e, GenerationAborted):
                if is_out_of_memory(e) or not is_collective_error(e):
                    raise  # a bug or this device full, not a peer's failure: fail loudly (run() names it)
                # A peer's death shows up as a gloo error before the coordinator's key: report the
                # error (with no loss to explain it the coordinator re-forms the members) and wait.
                self._report_error(g, e)
                if not self._wait_key(keys.failed(g), self.timeouts.reconfiguration_timeout):
                    raise
            self._report(g)
            return g + 1

    def _groups_to_save(self, g: int, cfg: GenerationConfig) -> None:
        """A stop generation that saves a plan with a wide stage: every member forms the generation's
        groups, so that the stage can gather its layers to its first rank. The previous generation's
        were given up when the coordinator failed it to stop the workers (on NCCL its communicators
        are aborted), so a gather through them raised GenerationAborted and no checkpoint was written."""
        if cfg.plan is None or self.node not in cfg.members:
            return
        plan = ExecPlan.from_json(cfg.plan)
        if not plan.sharded:
            return
        w = self.worker
        w.rank = cfg.members.index(self.node) * self.per_node + self.local
        gen = build_generation(self.store, g, w.rank, len(cfg.members) * self.per_node, plan, self.timeouts,
                               self.job.backend, None, w.device, superseded=self.superseded, previous=self.gen)
        if self.gen is not None:
            self.gen.release()
        self.gen = w.gen = gen

    def _report(self, g: int) -> None:
        """This worker's step and valid layers after leaving generation g: what the next plan starts from."""
        self.faults.before_report(self.worker.step)
        shards = tuple((i, s.width, s.index) for i, s in sorted(self.worker.shards.items()) if i in self.worker.layers)
        records.put(self.store, WorkerReport(step=self.worker.step, layers=tuple(sorted(self.worker.layers)),
                                             completable=can_complete(self.worker), last_step=self.last_step,
                                             shards=shards),
                    g, self.name)

    def _store_alive(self) -> bool:
        """Whether the job's store still answers. Asked in a thread: a store whose supervisor's machine
        froze (or lost power) never answers (measured on the Slurm lab: `check` blocked for minutes),
        and a standby's takeover (`superseded`) must not wait for it."""
        answer: list[bool] = []
        done = threading.Event()

        store = self.store

        def ask() -> None:
            try:
                store.check([keys.CURRENT_GEN])
                answer.append(True)
            except Exception:  # noqa: BLE001 - whatever the client raises once its server is gone
                answer.append(False)
            done.set()

        threading.Thread(target=ask, name="store-alive", daemon=True).start()
        deadline = time.monotonic() + self.timeouts.store_timeout
        while not done.wait(FOLLOW_POLL_S):
            if self.superseded.is_set() or time.monotonic() > deadline:
                return False  # its supervisor was replaced: the store may be frozen, not gone
        return answer[0] and not self.superseded.is_set()


    def _follow_new_supervisor(self, error: BaseException) -> int:
        """The store went away with its supervisor: wait for a supervisor of a higher epoch to publish
        its store (elastic.json), connect to it and report this worker's step and layers for the
        generation it resumes from (its `current_gen`, set before it published the address); the
        generation after it is the next to wait for. Without failover, or past the wait, the error."""
        launch = self.launch
        deadline = time.monotonic() + launch.failover_s
        while time.monotonic() < deadline:
            lease = read_lease(JobDir.at(self.job_dir))
            if lease is not None and lease.done and lease.epoch >= launch.epoch:
                break  # the job ended (or was stopped) under its supervisor: nothing to take over
            try:
                newer = read_launch_config(self.job_dir / ELASTIC_FILE)
            except (OSError, ProtocolError):
                newer = launch  # being replaced: read it again
            if newer.epoch > launch.epoch:
                self.step_writer.retire()
                self.store = connect_store(newer.host, newer.port, self.timeouts, self.secret, self.log, self.name)
                self.step_writer = StepWriter(self.store)
                self.launch = newer
                self.superseded.clear()
                self.faults.store = self.store
                g = int(self.store.get(keys.CURRENT_GEN))
                self._report(g)
                return g + 1
            time.sleep(FOLLOW_POLL_S)
        raise ConnectionError(f"the job's store went away ({type(error).__name__}: {error}) and no supervisor "
                              f"took over within {launch.failover_s:g} s") from error

    def run_generation(self, g: int, cfg: GenerationConfig) -> None:
        w = self.worker
        if cfg.plan is None:
            raise ProtocolError(f"{keys.config(g)}: a generation to run needs a plan")
        plan = ExecPlan.from_json(cfg.plan)
        w.rank = cfg.members.index(self.node) * self.per_node + self.local
        self.members = cfg.members
        world_size = len(cfg.members) * self.per_node
        self.phase = "step"  # a pending step completed here is the previous generation's
        if cfg.source != "checkpoint":  # a checkpoint (a loss-spike rollback, in this process) sets the step
            reach_step(w, cfg.resume_step)
        self.faults.generation = g
        self.phase = "groups"
        self.faults.before_groups(w.step)
        t0 = time.perf_counter()
        gen = build_generation(self.store, g, w.rank, world_size, plan, self.timeouts,
                               self.job.backend, self._on_wait, w.device, superseded=self.superseded,
                               previous=self.gen)  # released once g's world has formed
        if self.gen is not None:  # (already released by the build; harmless)
            self.gen.release()
        self.gen = gen
        t1 = time.perf_counter()
        self.phase = f"adopt:{cfg.source}"
        self.faults.at_adopt(w.step)  # a failure during recovery: groups built, copies not done
        ckpt = cfg.checkpoint
        received = w.adopt(plan, gen, cfg.source, list(cfg.transfers), (ckpt.root, ckpt.step) if ckpt else None)
        t2 = time.perf_counter()
        records.put(self.store, Rebuilt(groups_s=t1 - t0, copy_s=t2 - t1, bytes=received, t=time.time()), g, self.name)
        if w.rank == 0:  # every rank knows the copies fetched again (one all-reduce decided them)
            for layer, sender, receiver, retry in w.refetches:
                self.log.emit("transfer_refetch", layer=layer, sender=sender, receiver=receiver, retry_from=retry,
                              generation=g)
        try:
            self._train(g, gen)
        finally:  # leaving the generation (done, failed or aborted): its reader thread stops with it
            w.stop_reads(self.timeouts.prefetch_stop)
            self.tracer.finish(w.rank)  # a trace cut short by a failure: the steps it holds

    def _train(self, g: int, gen: AbortableGeneration) -> None:
        """Generation g's steps, from the worker's step on; then the final checkpoint."""
        w = self.worker
        gen.align()
        self._check_spikes(g, gen)  # a stop verdict on a step completed in the recovery (reach_step)
        if g > 0:  # what the step it resumes at is owed, as the loop does after a step
            if self._eval_due(w.step) and not self._eval_logged(gen, w.step):  # cut short, or not reached
                self._evaluate(g)
            self._complete_checkpoint(gen)
        first = True
        while w.step < self.job.train.steps:
            self.phase = "step"
            if first and g > 0:
                self.faults.before_replay(w.step)
            self.faults.at_step_start(w.step)
            if self.requests.take_corrupt():  # `kill-node --how corrupt`
                self._corrupt("start")
            self.step_reported = False
            self.tracer.before_step(w.step, self.requests.trace)
            try:
                result = w.train_step()
            except ReplicaMismatchError as err:
                self._replica_mismatch(g, err)
            self.tracer.after_step(result.step, w.rank)
            self.faults.at_step_end()
            self.last_step = LastStep(result=result, generation=g, global_batch_size=self.job.train.global_batch_size)
            if w.rank == 0:
                self.log.emit("step", **result.event(g, self.job.train.global_batch_size))
                self.step_writer.set(keys.progress(g), str(result.step))
                records.put(self.step_writer, StepCompute(step=result.step, compute_seconds=result.compute_seconds), g)
                if first:
                    records.put(self.step_writer, FirstStep(step=result.step, t=time.time()), g)
            first = False
            self._check_spikes(g, gen)
            if self._eval_due(w.step) or self._checkpoint_due(w.step):
                gen.expect_long_step()  # a peer busy between steps: the next waits (eval's too) include it
            if self._eval_due(w.step):
                self._evaluate(g)
            self._maybe_checkpoint()
            if gen.watch.failed():  # a join (or a failure seen between steps): leave at the boundary
                raise GenerationAborted(f"{keys.failed(g)} after step {result.step}")
        self.save_checkpoint(self.checkpoint_root, w.step)  # the trained model
        gen.wait(gen.world.barrier())  # nobody leaves while a peer may still need a group

    def _check_spikes(self, g: int, gen: AbortableGeneration) -> None:
        """After `max_consecutive` loss spikes in a row (training.loss_spike; every rank judges the same
        at the same step): finish the checkpoint writes under way, report why (rank 0 also logs it),
        and stop; the coordinator stops the job instead of recovering it (supervisor/decisions.py).
        With `on_consecutive: rollback` the worker stays: it flags the report as a generation error
        (the coordinator looks for the report then), leaves g once the coordinator fails it and follows
        the next generation, a restart from a checkpoint, or the job's stop."""
        w = self.worker
        verdict, policy = w.spike_stop, self.job.train.loss_spike
        if verdict is None or policy is None or w.spike is None:
            return
        if self.writer is not None:
            self.writer.flush(())  # a failed write was reported (_write_failed): the newest complete one is named
        gen.wait(gen.world.barrier())  # every rank's writes are on disk: all name the same newest checkpoint
        checkpoint = latest_complete(self.checkpoint_root, w.keys)
        message = stop_message(policy, w.spike.spikes, verdict, checkpoint)
        if w.rank == 0:
            self.log.emit("loss_spike_stop", step=w.step - 1, spikes=list(w.spike.spikes), loss=verdict.loss,
                          threshold=verdict.threshold, checkpoint=checkpoint, message=message)
        records.put(self.store, LossSpikeStop(step=w.step - 1, message=message, t=time.time(),
                                              spikes=tuple(w.spike.spikes)), g, self.name)
        if policy.on_consecutive == "rollback":
            self.store.add(keys.errors(g), 1)
            if self._wait_key(keys.failed(g), self.timeouts.reconfiguration_timeout):
                raise GenerationAborted(f"{keys.failed(g)}: training.loss_spike rollback after step {w.step - 1}")
        raise LossSpikesStopped(f"worker {self.name}: {message}")

    def _corrupt(self, point: str) -> None:
        """A "corrupt" fault (engine/faults.py): at a step's start one bit of the first parameter of the
        first held layer flips; at an adoption, the copies this worker sends carry one."""
        w = self.worker
        if point == "adopt":
            w.corrupt_sends = True
        elif w.layers:
            w.settle_copies([min(w.layers)])  # a checkpoint's copy still under way holds the step's bits
            flip_bit(w.holding_tensors(min(w.layers))[0], 0, CORRUPT_BIT)

    def _replica_mismatch(self, g: int, err: ReplicaMismatchError) -> None:
        """Replicas disagreed at this step's integrity check (every rank raised the same verdict; the
        step is withheld everywhere): rank 0 names the nodes to evict (keys.replica_mismatch, read by the
        supervisor's node backend), and every rank waits for the generation to fail, then leaves it as
        after any failure. Not failed within the reconfiguration timeout: the error stands."""
        v = err.verdict
        nodes = tuple(dict.fromkeys(self.members[r // self.per_node] for r in v.suspects))
        if self.worker.rank == 0:
            self.log.emit("replica_mismatch", step=err.step, nodes=list(nodes), attributed=list(v.attributed),
                          unresolved=list(v.unresolved), detail=v.detail, generation=g)
            records.put(self.store, ReplicaMismatch(step=err.step, nodes=nodes, attributed=v.attributed,
                                                    unresolved=v.unresolved, detail=v.detail, t=time.time()), g)
        if not self._wait_key(keys.failed(g), self.timeouts.reconfiguration_timeout):
            raise err
        raise GenerationAborted(f"{keys.failed(g)} after the replica mismatch at step {err.step}") from err

    def _eval_due(self, step: int) -> bool:
        """The validation loss is measured after every `eval_interval` steps and after the last."""
        t = self.job.train
        return t.eval_interval > 0 and step > 0 and (step % t.eval_interval == 0 or step == t.steps)

    def _evaluate(self, g: int) -> None:
        self.phase = "evaluate"
        t0 = time.perf_counter()
        loss, samples = self.worker.evaluate()
        if self.worker.rank == 0:
            step = self.worker.step
            self.log.emit("eval", step=step, loss=loss, samples=samples,
                          seconds=time.perf_counter() - t0, generation=g)
            # Marked after the event, so that an evaluation is never lost: a death between the two
            # repeats it. The store outlives this worker; the background writer keeps a stalled store
            # off the training path.
            self.eval_logged = step
            self.step_writer.set(keys.EVAL_LOGGED, str(step))

    def _eval_logged(self, gen: AbortableGeneration, step: int) -> bool:
        """Whether the evaluation after `step` steps was logged (in an earlier generation): a survivor
        that logged it says so, else the store's mark (its rank 0 may be lost). Every member calls this:
        one world all-reduce, so that all of them evaluate, or none."""
        w = self.worker
        told = self.eval_logged == step or (w.rank == 0 and records.get_int(self.store, keys.EVAL_LOGGED) == step)
        flag = torch.tensor([1 if told else 0], dtype=torch.int64, device=w.device)
        gen.wait(gen.world.allreduce([flag]))
        return int(flag.item()) > 0

    def save_checkpoint(self, root: str, step: int) -> None:
        """Write this worker's share of the checkpoint of `step` (`_writes`) and wait for it."""
        w = self.worker
        reach_step(w, step)
        self.phase = "checkpoint"
        if w.plan is None or not w.layers:
            return
        if self.writer is None or str(self.writer.root) != root:
            if self.writer is not None:
                self.writer.flush(())  # its periodic writes that failed were reported (_write_failed)
            self.writer = self._new_writer(root)
        for i in self._writes(w):
            if (snapshot := w.snapshot(i)) is not None:
                self.writer.submit(w.step, w.keys[i], snapshot)
        self.writer.flush([w.step])  # the trained model or the requeue's checkpoint: its failure fails the run

    def _new_writer(self, root: str) -> CheckpointWriter:
        return CheckpointWriter(root, self.worker.data_record, on_error=self._write_failed)

    def _write_failed(self, step: int, error: Exception) -> None:
        """A checkpoint write failed (the writer's thread): said in the event log and the worker's log;
        training goes on, and the next interval writes a checkpoint afresh. Every failure is reported,
        with this worker's count, so that a disk that stays full is seen (dashboard, `status`)."""
        failures = self.writer.failures if self.writer is not None else 1
        detail = f"{type(error).__name__}: {error}"
        print(f"worker {self.name}: the checkpoint of step {step} was not written ({detail}); training goes on",
              file=sys.stderr, flush=True)
        self.log.emit("checkpoint", step=step, ok=False, worker=self.name, failures=failures, detail=detail)

    @staticmethod
    def _writes(w: Worker) -> list[int]:
        """The layers this worker helps write: layer i is written by its holder in pipeline i mod the
        number of pipelines (a wide stage gathers it, its first rank writes). Every rank derives the
        same choice from the plan alone, and the copy each checkpoint costs the training path is spread
        over the replicas instead of all falling on the first pipeline's ranks."""
        if w.plan is None:
            return []
        mine = []
        for i in sorted(w.layers):
            holders = w.plan.holder_stages(i)
            if w.rank in holders[i % len(holders)]:
                mine.append(i)
        return mine

    def _checkpoint_due(self, step: int) -> bool:
        """A periodic checkpoint is written after every `checkpoint_interval` steps (the last step's is
        the final checkpoint)."""
        i = self.checkpoint_interval
        return i > 0 and 0 < step < self.job.train.steps and step % i == 0

    def _maybe_checkpoint(self) -> None:
        if self._checkpoint_due(self.worker.step):
            self.phase = "checkpoint"
            self._submit_layers(self._writes(self.worker))

    def _submit_layers(self, layers: list[int]) -> None:
        """Queue `layers` for the checkpoint of the worker's step: copied and serialised in the
        background (Worker.snapshot; the next update waits for the copy, not for the write)."""
        w = self.worker
        if not layers:
            return
        if self.writer is None:
            self.writer = self._new_writer(self.checkpoint_root)
        for i in layers:
            if (snapshot := w.snapshot(i)) is not None:
                self.writer.submit(w.step, w.keys[i], snapshot)

    def _complete_checkpoint(self, gen: AbortableGeneration) -> None:
        """At the step a recovery resumes at, write the layers its checkpoint lacks. The step's writers
        may be lost, or may have held the step pending when the generation failed (its commit completed
        on other ranks only): they completed it in the recovery, after their loop's checkpoint. Every
        member calls this: one world all-reduce of what each sees written or queued, so that the ranks
        of a wide stage, which gather a layer together, agree on what to write."""
        w = self.worker
        if not self._checkpoint_due(w.step):
            return
        self.phase = "checkpoint"
        mine = self._writes(w)
        seen = torch.zeros(len(w.keys), dtype=torch.int64, device=w.device)
        queued = self.writer.submitted if self.writer is not None else set()
        for i in mine:
            if (w.step, w.keys[i]) in queued or layer_file(self.checkpoint_root, w.step, w.keys[i]).exists():
                seen[i] = 1
        gen.wait(gen.world.allreduce([seen]))
        written = seen.cpu().tolist()
        self._submit_layers([i for i in mine if not written[i]])


def _log_ready(name: str) -> None:
    """One line in the worker's log: how long after its agent was told to start it (OOBLECK_START_T,
    agent/main.py) it is ready to join; bench_recovery reads it (a warm start: well under 1 s)."""
    told = os.environ.get("OOBLECK_START_T")
    if told is not None:
        print(f"worker {name}: ready {time.time() - float(told):.3f} s after its agent's start at {told} "
              f"(pid {os.getpid()}, parent {os.getppid()})", flush=True)


def main(argv: list[str] | None = None) -> int:
    """A worker's entry: `python -m` runs it, or the agent's warm server calls it in a forked child
    (agent/warm.py: torch and the engine already imported, the environment already the worker's)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not args[2].isdigit():
        print("usage: python -m oobleck_slurm.engine.elastic_process JOB_DIR NODE LOCAL", file=sys.stderr)
        return EXIT_BAD_INPUT
    # The agent sets the thread budget (cores / workers per node) and, on GPUs, the device: before
    # anything touches CUDA, so the worker's context lives on its own GPU only.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if os.environ.get("OOBLECK_DEVICE") == "cuda":
        torch.cuda.set_device(int(args[2]))
    code = 0
    try:
        worker = ElasticWorker(Path(args[0]), args[1], int(args[2]))
        _log_ready(worker.name)
        worker.run()  # sets its worker_ready key first
    except Exception:
        traceback.print_exc()
        code = EXIT_FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    # Never return through the interpreter's exit, failed or not: the destructors of live groups (an
    # NCCL communicator with a peer gone, a gloo group with a stuck operation) could hang it.
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
