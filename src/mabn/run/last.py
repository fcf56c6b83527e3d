"""LastCheckpoint: ``checkpoints/last.ckpt`` is the run's latest state at every end of a fit.

ModelCheckpoint's ``save_last`` writes ``last.ckpt`` only in a step where it also saved a top-k checkpoint, so a
run whose last validations did not improve ends with ``last.ckpt`` far behind its last step. This callback owns
that file instead and writes it (atomically, through the trainer's CheckpointIO):

- after every validation of the fit, after ModelCheckpoint so that the file holds its new best (a validation at
  an epoch's end: at the epoch's end, where ModelCheckpoint saves it by default);
- every ``every_minutes`` of training, at the end of a training batch;
- when SLURM's requeue signal or SIGTERM arrived (see below), or SIGHUP (a dropped ssh session) or SIGUSR1
  outside SLURM's requeue, which stop the run as SIGTERM does (exit status 128 + the signal's number) where they
  are not ignored (``nohup``);
- at the end of the fit (``max_steps``, ``max_epochs``, early stopping), unless the file already holds that step;
- when the fit raises (an error, Ctrl-C) in a single process, unless the model holds non-finite values or the
  error was a refused write. Under DDP the other processes may be anywhere, and a save is a collective (random
  states and norm streams are gathered from every device), so there ``last.ckpt`` keeps the last agreed save.

Signals. Lightning's own handlers act inside the signal handler: on the requeue signal
(``_SignalConnector._slurm_sigusr_handler_fn``) it calls ``trainer.save_checkpoint``, on SIGTERM it broadcasts a
flag from rank 0 and writes no checkpoint. The handler runs wherever each process happens to be when its signal
arrives (in a gradient all-reduce on one device, between two steps on another), so collectives there pair up
wrongly or wait forever. These handlers only record the signal; at the end of every training batch the processes
agree by one all-reduce of three flags (SIGTERM, the requeue signal, the timer) whether to save, and then save
together. The cost is one all-reduce of three numbers per batch in host memory, over a gloo group
(``mabn.distributed.agree``): it waits for the other processes' hosts, never for a device's queued kernels. A
single process reads its own flags: no collective.

After the requeue signal's save (``--signal=SIGUSR1@120``), global rank 0 runs ``scontrol requeue JOB_ID`` once
and the run goes on until SLURM ends it. After SIGTERM's save (``scancel``, preemption, the time limit: SLURM
signals every process of the job, loader workers included, which ignore it: ``mabn.data.loading``) the run goes
on only to the next hook: the step's metrics are logged, a validation due after that batch runs and is saved
with it, and then every process leaves ``fit`` with ``Terminated`` (exit status 143, 128 + SIGTERM), without
``scontrol``: a preempted job with ``--requeue`` is requeued by SLURM itself, and a cancelled one must stay
cancelled. A SIGTERM during validation is acted on at its end. ``--resume auto`` continues from ``last.ckpt``.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.callbacks import Checkpoint, ModelCheckpoint
from pytorch_lightning.trainer.states import TrainerFn

from ..compat import cluster_environment, record_sigterm
from ..distributed import agree, world_size
from ..errors import WriteError
from .folder import CHECKPOINTS, LAST
from .requeue import Terminated, requeue_job


def _finite(module: torch.nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


class LastCheckpoint(Checkpoint):
    """Writes ``<dirpath>/last.ckpt`` (ModelCheckpoint's ``dirpath``, else ``<default_root_dir>/checkpoints``)
    at each end of a fit and on the way (the module's doc). ``every_minutes``: the training time between two
    saves besides validations (None or 0: none); ``requeue_command``: run with the job id after the requeue
    signal's save.

    A ``Checkpoint`` callback, so Lightning runs its hooks after every other callback's (the norm callbacks'
    included) and after ModelCheckpoint's when it is listed after it (the CLI appends it)."""

    def __init__(
        self, every_minutes: float | None = 30.0, requeue_command: Sequence[str] = ("scontrol", "requeue")
    ) -> None:
        if every_minutes is not None and not (math.isfinite(every_minutes) and every_minutes >= 0):
            raise ValueError(f"every_minutes must be a finite number of minutes (0: off), got {every_minutes}")
        self.every_minutes = every_minutes
        self.requeue_command = list(requeue_command)
        self.dirpath: Path | None = None
        self._previous: dict[int, Any] = {}  # signal -> the handler ours replaced
        self._recording = False  # our handlers installed and in force
        self._term = self._requeue = self._requeued = self._stopping = False
        self._stop_signal = signal.SIGTERM  # the signal that stops the run: SIGTERM, or SIGHUP or SIGUSR1 (below)
        self._requeue_signal: int | None = None  # SLURM's, where it requeues the job
        self._epoch_end = self._validated = False  # the batch ended an epoch; its validation awaits the save
        self._saved_step: int | None = None
        self._start_step: int | None = None
        self._saved_at = time.monotonic()

    @property
    def path(self) -> Path:
        assert self.dirpath is not None, "set up by the fit"
        return self.dirpath / LAST

    # -- signals -----------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        best = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None)
        own = Path(trainer.default_root_dir) / CHECKPOINTS
        self.dirpath = Path(best.dirpath) if best is not None and best.dirpath else own
        self._term = self._requeue = self._requeued = self._stopping = False
        self._stop_signal = signal.SIGTERM
        self._epoch_end = self._validated = False
        self._saved_step = self._start_step = None
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there (Lightning then keeps its own)
        # SIGTERM: Lightning installs its handler (after setup, in Trainer._run) whatever is there, and calls the
        # one that was there from it as well. Its own part (broadcast, forwarding the signal) is replaced by the
        # recording, on this trainer's connector only: the handler it installs then records and nothing else.
        record_sigterm(trainer, self._record)
        self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._record)}
        environment = cluster_environment(trainer)  # what Lightning's handler consults
        self._requeue_signal = None
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            # Installed before Lightning registers its handlers: Lightning keeps a requeue-signal handler that is
            # already there instead of adding its own.
            self._requeue_signal = environment.requeue_signal
            self._previous[self._requeue_signal] = signal.signal(self._requeue_signal, self._record)
        # SIGHUP (a dropped ssh session) and SIGUSR1 (outside SLURM's requeue) end a process by default, without a
        # save: they stop the run as SIGTERM does. Where they are ignored (nohup), they stay ignored.
        for stop in (signal.SIGHUP, signal.SIGUSR1):
            if stop != self._requeue_signal and signal.getsignal(stop) != signal.SIG_IGN:
                self._previous[stop] = signal.signal(stop, self._record)
        self._recording = True

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._recording:  # nothing else: the main thread may be inside a collective or holding any lock
            if signum == self._requeue_signal:
                self._requeue = True
            else:  # SIGTERM, SIGHUP, SIGUSR1 outside SLURM's requeue
                self._term, self._stop_signal = True, signal.Signals(signum)
            return
        # Left installed after the fit (Lightning restores the handlers it found, ours, after an exception):
        # behave as the handler that was there before.
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _restore(self) -> None:
        if self._recording:
            self._recording = False
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)

    # -- saves -------------------------------------------------------------------------------------------------
    def save(self, trainer: pl.Trainer) -> None:
        """Writes the trainer's state to ``last.ckpt`` (every process of a DDP run calls it together)."""
        for logger in trainer.loggers:  # the metrics so far reach the logger's files, as the checkpoint's step
            logger.save()
        trainer.save_checkpoint(self.path, weights_only=False)  # the whole state; said, so Lightning says nothing
        self._saved_step, self._saved_at = trainer.global_step, time.monotonic()

    def _due(self) -> bool:
        return bool(self.every_minutes) and time.monotonic() - self._saved_at >= 60 * self.every_minutes

    def _fitting(self, trainer: pl.Trainer) -> bool:
        return trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and self.dirpath is not None

    def _terminate(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero:
            print(
                f"{self._stop_signal.name}: checkpoint saved at step {self._saved_step} in {self.path}; the run stops "
                "here, and --resume auto goes on from it",
                file=sys.stderr,
                flush=True,
            )
        raise Terminated(128 + self._stop_signal)  # what a shell reports for a process ended by the signal

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._saved_at = time.monotonic()
        self._start_step = trainer.global_step  # a fit resumed at step N holds nothing new until it trains

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._epoch_end = batch_idx + 1 >= trainer.num_training_batches  # a validation now is the epoch's
        # Every process runs the same training batches, so all reach this collective together.
        term, requeued, due = agree([self._term, self._requeue and not self._requeued, self._due()])
        if not (term or requeued or due):
            return
        self.save(trainer)
        self._stopping = term  # leave at the next hook: this step's metrics are logged, a due validation runs
        if requeued:
            self._requeued = True  # once per fit: SLURM ends the job soon after
            if trainer.is_global_zero:
                requeue_job(self.requeue_command)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._stopping:
            self._terminate(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._fitting(trainer):
            return
        (term,) = agree([self._term])  # every process ends the validation
        self._stopping = self._stopping or term
        if self._epoch_end:
            # ModelCheckpoint saves an epoch's last validation at the epoch's end by default: this save comes
            # after it there, so the file holds its new best.
            self._validated = True
            return
        self.save(trainer)
        if self._stopping:
            self._terminate(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validated:
            self._validated = False
            self.save(trainer)
        if self._stopping:
            self._terminate(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._saved_step != trainer.global_step:
            self.save(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()  # teardown hooks do not run after an exception
        if isinstance(exception, Terminated) or not self._fitting(trainer):
            return
        if self._start_step is None or trainer.global_step in (self._saved_step, self._start_step):
            # Nothing trained since the last save, or since the fit started (or resumed), or the fit stopped before
            # training started (a run refused in a setup hook, such as a batch that does not fit the memory).
            return
        if world_size() > 1 or isinstance(exception, WriteError):
            return  # see the module's doc: a save is a collective; a refused write would be refused again
        where = f"{type(exception).__name__} at step {trainer.global_step}"
        if not _finite(pl_module):
            print(f"{where}: the model holds non-finite values, {self.path} is left as it was", flush=True)
            return
        # On stdout: stderr ends with the error itself, one line for a user's mistake.
        try:
            self.save(trainer)
        except Exception as err:  # the fit's own error is the one to report
            print(f"{where}: could not save {self.path} ({err})", flush=True)
        else:
            print(f"{where}: state saved in {self.path}; --resume auto goes on from it", flush=True)
