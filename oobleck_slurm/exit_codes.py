"""Process exit codes, defined once: the CLI's commands and the supervisor (whose code Slurm records
and `submit` reports) use these and no other numbers. Each exception class of the package says which
one it ends a process with (errors.py: `OobleckError.exit_code`)."""

EXIT_OK = 0
EXIT_FAILED = 1  # anything else: a run failed, Slurm refused, the supervisor is unreachable
EXIT_BAD_INPUT = 2  # bad recipe, bad arguments, missing files: fix the input and run again
EXIT_UNRECOVERABLE = 3  # the supervisor's coordinator gave up (no replica, no checkpoint): do not requeue
