"""The Slurm job's state for the header, asked from squeue (or sacct once the job has left the queue).

Best effort: no Slurm client, a slow controller or an unknown job give None, never an error.
"""

from __future__ import annotations

import shutil
import subprocess


def slurm_job_state(slurm_job_id: str, timeout: float = 5.0) -> str | None:
    """`RUNNING`, `PENDING`, `COMPLETED`, ... or None when it cannot be found out."""
    for cmd in (["squeue", "-h", "-j", slurm_job_id, "-o", "%T"],
                ["sacct", "-n", "-X", "-P", "-j", slurm_job_id, "-o", "State"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        words = out.split()
        if words:
            return words[0]  # sacct: "CANCELLED by 0" -> CANCELLED
    return None
