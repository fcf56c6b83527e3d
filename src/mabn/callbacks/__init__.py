"""Lightning callbacks: the MABN/BRN policy owner, random states for exact resume, the SyncBatchNorm check, and
the multi-process guards (a failing process stops them all; SLURM's requeue saves at an agreed step)."""

from .failfast import FailFast
from .mabn import MABNCallback, PhaseRule, norm_callbacks
from .requeue import AgreedRequeue
from .rng import RandomStateCallback
from .syncbn import SyncBatchNormCheck

__all__ = [
    "AgreedRequeue",
    "FailFast",
    "MABNCallback",
    "PhaseRule",
    "RandomStateCallback",
    "SyncBatchNormCheck",
    "norm_callbacks",
]
