"""Where the recipes live: ``configs/`` of the repository, linked into the package as package data, so that an
installed copy carries them, and the classes they name by class path. Its own module, importable with torch alone:
the GPU check reads the recipes on a machine that lacks the libraries the tasks need."""

import importlib
from importlib import resources
from pathlib import Path
from typing import Any

CONFIGS = Path(str(resources.files("mabn") / "configs")).resolve()


def class_at(class_path: str) -> Any:
    """The object a class path (``package.module.Name``, as the recipes and checkpoints name classes) names: its
    module imported, the name read from it (ImportError, AttributeError or ValueError where there is none)."""
    module, _, name = str(class_path).rpartition(".")
    return getattr(importlib.import_module(module), name)
