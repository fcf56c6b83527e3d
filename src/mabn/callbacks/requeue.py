"""AgreedRequeue: SLURM's requeue signal saves the HPC checkpoint at a step every process agrees on.

Lightning's own handler (``_SignalConnector._slurm_sigusr_handler_fn``) calls ``trainer.save_checkpoint``
inside the signal handler. A checkpoint is a collective here (random states and norm streams are gathered
from every device), and the handler runs wherever each process happens to be when its signal arrives: in a
gradient all-reduce on one device, between two steps on another. The collectives then pair up wrongly or
wait forever. This handler only records the request; every ``every_n_batches`` training batches all
processes agree, by one all-reduce, whether any of them got it, and then save and requeue together.

The host reads the all-reduce's result, so it waits there until the device has run the step: at every batch that
would keep the host from running ahead of the GPU. The agreement therefore comes every 50 batches by default, and a
signal is acted on up to ``every_n_batches - 1`` batches after the one it arrived in: the checkpoint is written that
many steps later, out of SLURM's lead time (``--signal=SIGUSR1@120`` in scripts/slurm/train.sbatch). A single
process reads its own flag at the end of every batch: no collective, no wait.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.plugins.environments import SLURMEnvironment

from ..process import any_device, world_size

log = logging.getLogger(__name__)


def slurm_job_id() -> str:
    """This job's id as ``scontrol requeue`` takes it: ``ARRAYJOB_TASK`` within a job array."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.match(r"[0-9_-]+", job):  # Lightning's check
        raise ValueError(f"SLURM job id {job!r} does not start with a number")
    return job


def requeue(command: Sequence[str], job_id: str) -> None:
    """Runs ``command job_id`` (``scontrol requeue``), through a shell if it is not found directly, as
    Lightning does; a failure is logged, not raised: the checkpoint is saved either way."""
    try:
        result = subprocess.call([*command, job_id])
    except FileNotFoundError:
        result = subprocess.call(" ".join([*command, job_id]), shell=True)
    if result == 0:
        log.info(f"Requeued SLURM job {job_id}")
    else:
        log.warning(f"Requeuing SLURM job {job_id} failed with exit code {result}")


class AgreedRequeue(pl.Callback):
    """Replaces Lightning's SLURM auto-requeue handler (fit under ``SLURMEnvironment`` with
    ``auto_requeue``) by one that saves ``hpc_ckpt_N.ckpt`` in ``default_root_dir``, where Lightning's own
    resume looks. Several processes check for a pending signal at the end of every ``every_n_batches``-th
    training batch, one process at the end of every batch; after the save global rank 0 runs
    ``requeue_command JOB_ID``. Once per fit: SLURM ends the job soon after."""

    def __init__(self, every_n_batches: int = 50, requeue_command: Sequence[str] = ("scontrol", "requeue")) -> None:
        if every_n_batches < 1:
            raise ValueError(f"every_n_batches must be at least 1, got {every_n_batches}")
        self.every_n_batches = every_n_batches
        self.requeue_command = list(requeue_command)
        self._signum: signal.Signals | None = None
        self._previous: Any = None
        self._requested = False
        self._done = False
        self._batches = 0  # training batches ended in this fit, across epochs (one may hold fewer than n)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        environment = trainer._accelerator_connector.cluster_environment  # what Lightning's handler consults
        if stage != "fit" or not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there (Lightning then keeps its own)
        # Installed before Lightning registers its handlers (after setup, in Trainer._run): Lightning keeps
        # a requeue-signal handler that is already there instead of adding its own.
        self._signum = environment.requeue_signal
        self._previous = signal.signal(self._signum, self._record)
        self._requested = self._done = False
        self._batches = 0

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # Nothing else: the main thread may be inside a collective or holding any lock.
        self._requested = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._signum is None or self._done:
            return
        # Every process runs the same training batches, so all reach this collective together.
        self._batches += 1
        if world_size() > 1 and self._batches % self.every_n_batches:
            return
        if not any_device(self._requested, pl_module.device):
            return
        self._done = True
        # Rank 0 writes the file, so its numbering counts (a peer could see the new file already).
        path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        for logger in trainer.loggers:  # as Lightning's handler: the metrics so far reach the logger's files
            logger.finalize("finished")
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            requeue(self.requeue_command, slurm_job_id())

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()  # teardown hooks do not run after an exception

    def _restore(self) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous)
            self._signum = None
