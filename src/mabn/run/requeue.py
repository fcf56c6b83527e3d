"""AgreedRequeue: SLURM's requeue signal and SIGTERM save the HPC checkpoint at a step every process agrees on.

Lightning's own handlers act inside the signal handler: on the requeue signal
(``_SignalConnector._slurm_sigusr_handler_fn``) it calls ``trainer.save_checkpoint``, on SIGTERM
(``_sigterm_notifier_fn``) it broadcasts a flag from rank 0 and writes no checkpoint. A checkpoint and a broadcast
are collectives here (random states and norm streams are gathered from every device), and the handler runs
wherever each process happens to be when its signal arrives: in a gradient all-reduce on one device, between two
steps on another. The collectives then pair up wrongly or wait forever. These handlers only record the signal;
at the end of a training batch all processes agree, by an all-reduce, whether any of them got it, and then save
together.

The requeue signal (``--signal=SIGUSR1@120``, sent SLURM's lead time before the time limit) is agreed on every
``every_n_batches`` batches (default 50): the host reads the all-reduce's result, so it waits there until the
device has run the step, and the lead time leaves room for the up to ``every_n_batches - 1`` steps before the
checkpoint. After the save rank 0 runs ``scontrol requeue JOB_ID`` and the run goes on until SLURM ends it.

SIGTERM (``scancel``, preemption, a plain ``kill``) leaves only SLURM's KillWait (30 s by default) before
SIGKILL, so it is agreed on at the end of every training batch: at 0.5 s a step, 49 steps of waiting would take
most of that. The cost is one all-reduce of one number per batch and no new wait: Lightning 2.6 itself broadcasts
its SIGTERM flag and reads it on the host at the start of every training batch in DDP
(``_TrainingEpochLoop._broadcast_sigterm_tensor``), so the host already waits for the device there. After the
save every process leaves ``fit`` with ``Terminated`` (exit status 143, 128 + SIGTERM) and no ``scontrol``: a
preempted job with ``--requeue`` is requeued by SLURM itself, and a cancelled one must stay cancelled. Resume with
``--resume auto``: it finds ``hpc_ckpt_<n>.ckpt``. A SIGTERM during validation is acted on after the first
training batch that follows it.

A single process reads its own flags at the end of every batch: no collective, no wait.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ..distributed import any_device, world_size

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


class AgreedRequeue(pl.Callback):
    """Replaces Lightning's SLURM auto-requeue handler (fit under ``SLURMEnvironment`` with ``auto_requeue``) and
    its SIGTERM handler (every fit) by ones that save ``hpc_ckpt_N.ckpt`` in ``default_root_dir``, where
    ``--resume auto`` and Lightning's own resume look. Several processes agree on the requeue signal at the end of
    every ``every_n_batches``-th training batch and on SIGTERM at the end of every batch, one process looks at its
    flags at the end of every batch. After the requeue signal's save global rank 0 runs ``requeue_command JOB_ID``
    (once per fit: SLURM ends the job soon after); after SIGTERM's every process raises ``Terminated``."""

    def __init__(self, every_n_batches: int = 50, requeue_command: Sequence[str] = ("scontrol", "requeue")) -> None:
        if every_n_batches < 1:
            raise ValueError(f"every_n_batches must be at least 1, got {every_n_batches}")
        self.every_n_batches = every_n_batches
        self.requeue_command = list(requeue_command)
        self._signum: signal.Signals | None = None
        self._previous: Any = None
        self._previous_term: Any = None
        self._terminating = False  # SIGTERM handled: ours installed
        self._requested = False
        self._terminate = False
        self._done = False
        self._batches = 0  # training batches ended in this fit, across epochs (one may hold fewer than n)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there (Lightning then keeps its own)
        self._requested = self._terminate = self._done = False
        self._batches = 0
        # SIGTERM: Lightning installs its handler (after setup, in Trainer._run) whatever is there, and calls the
        # one that was there from it as well. Its own part (broadcast, forwarding the signal) is replaced by the
        # recording, on this trainer's connector only: the handler it installs then records and nothing else.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            connector._sigterm_notifier_fn = self._record_term
            connector._sigterm_handler_fn = self._record_term
        self._previous_term = signal.signal(signal.SIGTERM, self._record_term)
        self._terminating = True
        environment = trainer._accelerator_connector.cluster_environment  # what Lightning's handler consults
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return
        # Installed before Lightning registers its handlers: Lightning keeps a requeue-signal handler that is
        # already there instead of adding its own.
        self._signum = environment.requeue_signal
        self._previous = signal.signal(self._signum, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # Nothing else: the main thread may be inside a collective or holding any lock.
        self._requested = True

    def _record_term(self, signum: int, frame: FrameType | None) -> None:
        if self._terminating:
            self._terminate = True  # nothing else, as _record
            return
        # Left installed after the fit (Lightning restores the handlers it found after ours on an exception):
        # behave as the handler that was there before.
        previous = self._previous_term
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Every process runs the same training batches, so all reach these collectives together.
        self._batches += 1
        several = world_size() > 1
        if self._terminating and (any_device(self._terminate, pl_module.device) if several else self._terminate):
            path = self._save(trainer)
            message = (
                f"SIGTERM: checkpoint saved at step {trainer.global_step} in {path}; the run stops here, "
                "and --resume auto goes on from it"
            )
            if trainer.is_global_zero:
                print(message, file=sys.stderr, flush=True)
            raise Terminated(TERMINATED_EXIT)
        if self._signum is None or self._done:
            return
        if several and self._batches % self.every_n_batches:
            return
        if not any_device(self._requested, pl_module.device):
            return
        self._done = True
        self._save(trainer)
        if trainer.is_global_zero:
            try:
                job_id = slurm_job_id()
            except ValueError as err:
                log.error(f"Cannot requeue: {err}; the checkpoint is saved")
            else:
                requeue(self.requeue_command, job_id)

    @staticmethod
    def _save(trainer: pl.Trainer) -> str:
        # Rank 0 writes the file, so its numbering counts (a peer could see the new file already).
        path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        for logger in trainer.loggers:  # as Lightning's handler: the metrics so far reach the logger's files
            logger.finalize("finished")
        trainer.save_checkpoint(path)
        return path

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()  # teardown hooks do not run after an exception

    def _restore(self) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous)
            self._signum = None
        if self._terminating:
            self._terminating = False
            signal.signal(signal.SIGTERM, self._previous_term)
