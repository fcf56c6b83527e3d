"""Lightning callbacks: the MABN/BRN phase policy and each device's statistic streams, random states for exact
resume, the SyncBatchNorm check, the multi-process guards (a failing process stops them all; SLURM's requeue
saves at an agreed step), and the one line for CUDA running out of memory in a training step."""

from .failfast import FailFast
from .mabn import MABNCallback, norm_callbacks
from .oom import OutOfMemoryReport
from .policy import NormPolicy, PhaseRule
from .requeue import AgreedRequeue
from .rng import RandomStateCallback
from .streams import PerDeviceStreams
from .syncbn import SyncBatchNormCheck

__all__ = [
    "AgreedRequeue",
    "FailFast",
    "MABNCallback",
    "NormPolicy",
    "OutOfMemoryReport",
    "PerDeviceStreams",
    "PhaseRule",
    "RandomStateCallback",
    "SyncBatchNormCheck",
    "norm_callbacks",
]
