"""LightningModules for the two stages, and their lr schedules."""

from .classification import ClassificationTask
from .segmentation import SegmentationTask

__all__ = ["ClassificationTask", "SegmentationTask"]
