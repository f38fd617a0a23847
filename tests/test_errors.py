"""The exception hierarchy (errors.py): every exception class of the package is an OobleckError, whose
class says the exit code and whether a requeue may help; a timeout is not "unrecoverable"."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import oobleck_slurm
from oobleck_slurm.errors import (
    BadInputError,
    InfrastructureError,
    InternalError,
    JobTimeoutError,
    OobleckError,
    UnrecoverableError,
    exit_code_for,
    requeue_for,
    status_for,
)
from oobleck_slurm.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_UNRECOVERABLE


def package_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package, by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(oobleck_slurm.__path__, "oobleck_slurm."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


EXCEPTIONS = package_exceptions()


def test_the_walk_finds_the_package_exceptions() -> None:
    names = {name.rpartition(".")[2] for name in EXCEPTIONS}
    assert {"RecipeError", "ProfileError", "PlanningError", "FactoryError", "HFError", "CheckpointError",
            "TokenFileError", "TokenizerError", "ProtocolError", "CoordinatorError", "SlurmError",
            "JobNotFound", "CollectiveError", "GenerationAborted"} <= names
    assert len(EXCEPTIONS) >= 30


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_every_exception_class_is_an_oobleck_error_with_an_exit_code(name: str) -> None:
    cls = EXCEPTIONS[name]
    assert issubclass(cls, OobleckError), f"{name} derives from {[b.__name__ for b in cls.__mro__[1:]]}"
    assert cls.exit_code in (EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNRECOVERABLE) and cls.exit_code != EXIT_OK
    assert isinstance(cls.requeue, bool)
    assert cls.status in ("failed", "unrecoverable")


def test_the_kinds() -> None:
    assert (BadInputError.exit_code, BadInputError.requeue) == (EXIT_BAD_INPUT, False)
    assert (UnrecoverableError.exit_code, UnrecoverableError.requeue) == (EXIT_UNRECOVERABLE, False)
    assert (JobTimeoutError.exit_code, JobTimeoutError.requeue) == (EXIT_FAILED, True)
    assert (InfrastructureError.exit_code, InfrastructureError.requeue) == (EXIT_FAILED, True)
    assert (InternalError.exit_code, InternalError.requeue) == (EXIT_FAILED, False)
    assert UnrecoverableError.status == "unrecoverable" and JobTimeoutError.status == "failed"
    # Not an OSError: the control plane's `except OSError` must not swallow a timeout.
    assert not issubclass(JobTimeoutError, OSError)


def test_a_coordinator_timeout_requeues_and_cannot_continue_does_not() -> None:
    from oobleck_slurm.supervisor.coordinator import CannotContinue, CoordinatorError, CoordinatorTimeout

    timeout, cannot = CoordinatorTimeout("run exceeded its timeout"), CannotContinue("cannot continue: ...")
    assert isinstance(timeout, CoordinatorError) and isinstance(timeout, JobTimeoutError)
    assert (exit_code_for(timeout), requeue_for(timeout), status_for(timeout)) == (EXIT_FAILED, True, "failed")
    assert isinstance(cannot, CoordinatorError) and isinstance(cannot, UnrecoverableError)
    assert (exit_code_for(cannot), requeue_for(cannot), status_for(cannot)) == (
        EXIT_UNRECOVERABLE, False, "unrecoverable")


def test_the_former_builtin_bases_are_kept() -> None:
    """`except ValueError` / `except RuntimeError` / `except LookupError` sites keep catching them."""
    from oobleck_slurm.engine.comm import CollectiveError, is_collective_error
    from oobleck_slurm.models import FactoryError
    from oobleck_slurm.planning import PlanningError
    from oobleck_slurm.planning.gpus import UnknownGPU
    from oobleck_slurm.planning.profile import ProfileError
    from oobleck_slurm.planning.reconfigure import RecoveryImpossible
    from oobleck_slurm.supervisor.coordinator import CoordinatorError

    assert all(issubclass(c, ValueError) for c in (FactoryError, PlanningError, ProfileError, RecoveryImpossible))
    assert issubclass(CoordinatorError, RuntimeError) and issubclass(CollectiveError, RuntimeError)
    assert issubclass(UnknownGPU, LookupError)
    assert is_collective_error(CollectiveError("peer gone"))
    # A recovery that is impossible is still a PlanningError, and the unrecoverable kind.
    impossible = RecoveryImpossible("no_replica", "layer 3 lost every copy", (3,))
    assert isinstance(impossible, PlanningError) and exit_code_for(impossible) == EXIT_UNRECOVERABLE


def test_any_other_exception_is_a_failed_run_that_may_be_requeued() -> None:
    error = RuntimeError("boom")
    assert (exit_code_for(error), requeue_for(error), status_for(error)) == (EXIT_FAILED, True, "failed")
