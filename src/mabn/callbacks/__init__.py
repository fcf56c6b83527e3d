"""Lightning callbacks: the MABN/BRN policy owner, random states for exact resume, the SyncBatchNorm check."""

from .mabn import MABNCallback, PhaseRule, norm_callbacks
from .rng import RandomStateCallback
from .syncbn import SyncBatchNormCheck

__all__ = ["MABNCallback", "PhaseRule", "RandomStateCallback", "SyncBatchNormCheck", "norm_callbacks"]
