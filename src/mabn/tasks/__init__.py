"""LightningModules for the two stages, and their lr schedules.

The tasks are imported when first named (``mabn.tasks.ClassificationTask``): they need the training's libraries
(segmentation_models_pytorch, albumentations), and the modules beside them, ``mabn.tasks.cudagraph`` among them, are
used where torch and Triton are the only ones (the GPU check's kernel tests)."""

import importlib

_MODULES = {"ClassificationTask": "classification", "SegmentationTask": "segmentation"}

__all__ = ["ClassificationTask", "SegmentationTask"]


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f".{_MODULES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
