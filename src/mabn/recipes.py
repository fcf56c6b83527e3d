"""Where the recipes live: ``configs/`` of the repository, linked into the package as package data, so that an
installed copy carries them. Its own module, importable with torch alone: the GPU check reads the recipes on a
machine that lacks the libraries the tasks need."""

from importlib import resources
from pathlib import Path

CONFIGS = Path(str(resources.files("mabn") / "configs")).resolve()
