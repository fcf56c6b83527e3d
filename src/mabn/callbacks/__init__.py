"""Lightning callbacks: the MABN/BRN policy owner."""

from .mabn import MABNCallback, PhaseRule, norm_callbacks

__all__ = ["MABNCallback", "PhaseRule", "norm_callbacks"]
