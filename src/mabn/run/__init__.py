"""A run's plumbing, blind to models and data: files written atomically, the run folder, its lock and resume plan,
the loggers, how a global batch maps onto devices, and the guards every fit installs (a failing process stops
them all, last.ckpt the latest state at every end, SIGTERM and SLURM's requeue saved at an agreed step, CUDA out
of memory as one line, random states for an exact resume, progress lines for logs that are files)."""

from . import folder, lock
from .failfast import FailFast
from .files import (
    TMP_SUFFIX,
    AtomicCheckpointIO,
    atomic_path,
    file_identity,
    first_line,
    load_weights_file,
    write_atomic,
    write_faults,
    write_text_atomic,
)
from .last import LastCheckpoint
from .loggers import CSVLogger, WandbLogger
from .oom import OutOfMemoryReport
from .perdevice import PerDeviceState
from .progress import LineProgress, LogCadence, use_line_progress
from .rng import RandomStateCallback
from .scaling import (
    RunPlan,
    RunShape,
    auto_warmup_epochs,
    device_batch,
    device_batch_reason,
    iterations_per_epoch,
    linear_lr,
    loader_batches,
    per_device_batch,
    plan_shape,
    total_iterations,
)

__all__ = [
    "TMP_SUFFIX",
    "AtomicCheckpointIO",
    "CSVLogger",
    "FailFast",
    "LastCheckpoint",
    "LineProgress",
    "LogCadence",
    "OutOfMemoryReport",
    "PerDeviceState",
    "RandomStateCallback",
    "RunPlan",
    "RunShape",
    "WandbLogger",
    "atomic_path",
    "file_identity",
    "auto_warmup_epochs",
    "device_batch",
    "device_batch_reason",
    "first_line",
    "folder",
    "iterations_per_epoch",
    "linear_lr",
    "load_weights_file",
    "loader_batches",
    "lock",
    "per_device_batch",
    "plan_shape",
    "total_iterations",
    "use_line_progress",
    "write_atomic",
    "write_faults",
    "write_text_atomic",
]
