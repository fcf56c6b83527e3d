"""Lightning callbacks: the MABN/BRN phase policy and each device's statistic streams, random states for exact
resume, the SyncBatchNorm check, and the multi-process guards (a failing process stops them all; SLURM's requeue
saves at an agreed step)."""

from .failfast import FailFast
from .mabn import MABNCallback, norm_callbacks
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
    "PerDeviceStreams",
    "PhaseRule",
    "RandomStateCallback",
    "SyncBatchNormCheck",
    "norm_callbacks",
]
