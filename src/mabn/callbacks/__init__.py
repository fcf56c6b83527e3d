"""Lightning callbacks of the norm side: the MABN/BRN phase policy per module group, each device's statistic
streams, and the SyncBatchNorm check. The guards every fit installs, norm or not, are in ``mabn.run``."""

from .norms import MABNCallback, norm_callbacks
from .policy import NormPolicy, PhaseRule
from .streams import PerDeviceStreams
from .syncbn import SyncBatchNormCheck

__all__ = ["MABNCallback", "NormPolicy", "PerDeviceStreams", "PhaseRule", "SyncBatchNormCheck", "norm_callbacks"]
