"""Lightning callbacks: the MABN/BRN phase policy and each device's statistic streams, random states for exact
resume, the SyncBatchNorm check, the multi-process guards (a failing process stops them all; SLURM's requeue
saves at an agreed step), the one line for CUDA running out of memory in a training step, and the progress
lines that replace the progress bar in logs that are files."""

from .failfast import FailFast
from .mabn import MABNCallback, norm_callbacks
from .oom import OutOfMemoryReport
from .policy import NormPolicy, PhaseRule
from .progress import LineProgress, use_line_progress
from .requeue import AgreedRequeue
from .rng import RandomStateCallback
from .streams import PerDeviceStreams
from .syncbn import SyncBatchNormCheck

__all__ = [
    "AgreedRequeue",
    "FailFast",
    "LineProgress",
    "MABNCallback",
    "NormPolicy",
    "OutOfMemoryReport",
    "PerDeviceStreams",
    "PhaseRule",
    "RandomStateCallback",
    "SyncBatchNormCheck",
    "norm_callbacks",
    "use_line_progress",
]
