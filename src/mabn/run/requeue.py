"""What the agreed saves of ``mabn.run.last.LastCheckpoint`` end in: SLURM's requeue after the requeue signal
(``scontrol requeue JOB_ID``, never through a shell) and ``Terminated`` (exit status 143) after SIGTERM."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence

from pytorch_lightning.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

TERMINATED_EXIT = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Terminated(SIGTERMException):
    """Raised by every process after the agreed SIGTERM checkpoint: leaves ``fit`` with exit status 143.
    A ``SystemExit`` (as Lightning's own ``SIGTERMException``): no error of this process, FailFast passes it."""


def slurm_job_id() -> str:
    """This job's id as ``scontrol requeue`` takes it: ``ARRAYJOB_TASK`` within a job array; a ``ValueError``
    unless it is digits, ``_`` and ``-`` only."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9][0-9_-]*", job):
        raise ValueError(f"SLURM job id {job!r} is not a job id (digits, '_' and '-' only)")
    return job


def requeue(command: Sequence[str], job_id: str) -> None:
    """Runs ``command job_id`` (``scontrol requeue``), never through a shell; a failure, or a command that is not
    on PATH, is logged, not raised: the checkpoint is saved either way."""
    if shutil.which(command[0]) is None:
        log.error(
            f"Cannot requeue SLURM job {job_id}: {command[0]!r} is not on PATH; the checkpoint is saved, "
            "requeue the job by hand (scontrol requeue) or resubmit it"
        )
        return
    result = subprocess.call([*command, job_id])
    if result == 0:
        log.info(f"Requeued SLURM job {job_id}")
    else:
        log.warning(f"Requeuing SLURM job {job_id} failed with exit code {result}")


def requeue_job(command: Sequence[str]) -> None:
    """Requeues this SLURM job with ``command`` (``scontrol requeue``); a job id that is not one is logged."""
    try:
        job_id = slurm_job_id()
    except ValueError as err:
        log.error(f"Cannot requeue: {err}; the checkpoint is saved")
    else:
        requeue(command, job_id)
