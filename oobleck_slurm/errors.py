"""One exception hierarchy: every error the package raises is an `OobleckError`, whose class says the
process's exit code (exit_codes.py) and whether a Slurm requeue of the job may help.

    OobleckError            exit 1, requeue    a run failed (what no subclass below says more about)
    ├── BadInputError       exit 2, no requeue the recipe, a profile, a model factory, data, a plan that
    │                                          cannot fit, arguments, a job folder: fix the input first
    ├── UnrecoverableError  exit 3, no requeue training cannot go on: a layer lost every replica and no
    │                                          complete checkpoint exists, or too few nodes are left
    ├── JobTimeoutError     exit 1, requeue    a run, a reconfiguration or a checkpoint timed out: a new
    │                                          allocation may well finish it
    ├── InfrastructureError exit 1, requeue    Slurm, the job's store or control plane, a peer's process
    │                                          or network failed: a new allocation may not
    └── InternalError       exit 1, no requeue a bug: a state or transition the code does not allow

The package's classes derive from one of these and keep their former builtin base as a second base
(`class RecipeError(BadInputError, ValueError)`), so that `except ValueError` sites keep working. The
supervisor (supervisor/main.py) ends with `exit_code_for(error)` and records `requeue_for(error)` in
the job's meta, which decides whether the job is requeued on a preemption or time-limit notice. Any
other exception is a failed run: exit 1, requeue allowed (what it was before this hierarchy).

This module imports nothing but exit_codes.py: any module may import it.
"""

from __future__ import annotations

from typing import ClassVar

from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_UNRECOVERABLE


class OobleckError(Exception):
    """The base of every error of the package: a run failed; a requeue may help."""

    exit_code: ClassVar[int] = EXIT_FAILED
    requeue: ClassVar[bool] = True
    status: ClassVar[str] = "failed"  # the job's status in meta.json and `job_finished`


class BadInputError(OobleckError):
    """What the user gave cannot be used (the message says which file, key or argument): running the
    same input again fails the same way."""

    exit_code = EXIT_BAD_INPUT
    requeue = False


class UnrecoverableError(OobleckError):
    """Training cannot go on from what is left: no replica and no checkpoint, or too few nodes."""

    exit_code = EXIT_UNRECOVERABLE
    requeue = False
    status = "unrecoverable"


class JobTimeoutError(OobleckError):
    """A run, a reconfiguration or a checkpoint did not complete within its timeout (JobTimeouts). Not
    a builtin TimeoutError: that is an OSError, which the control plane's `except OSError` would swallow."""

    exit_code = EXIT_FAILED
    requeue = True


class InfrastructureError(OobleckError):
    """Something the job runs on failed or could not be reached: Slurm, the job's store or control
    plane, a peer's process or network."""

    exit_code = EXIT_FAILED
    requeue = True


class InternalError(OobleckError):
    """A bug: a state or a transition that the code does not allow. Requeueing would repeat it."""

    exit_code = EXIT_FAILED
    requeue = False


def exit_code_for(error: BaseException) -> int:
    """The exit code a process ends with after `error`: its class's, or EXIT_FAILED."""
    return error.exit_code if isinstance(error, OobleckError) else EXIT_FAILED


def requeue_for(error: BaseException) -> bool:
    """Whether a requeue of the job may help after `error`: its class's, or True (a failed run)."""
    return error.requeue if isinstance(error, OobleckError) else True


def status_for(error: BaseException) -> str:
    """The job's status after `error`: "unrecoverable" or "failed"."""
    return error.status if isinstance(error, OobleckError) else "failed"
