"""A WandbLogger that never hangs or crashes for want of a network or a login."""

from __future__ import annotations

import netrc
import os
from typing import Any

from pytorch_lightning.loggers import WandbLogger as _WandbLogger


def wandb_ready() -> bool:
    """True when this machine can log online: an API key in the environment or a saved ``wandb login``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger(_WandbLogger):
    """Lightning's WandbLogger, offline unless wandb is set up, so a run without network or login still
    finishes (``wandb sync runs/<stage>/wandb/offline-run-*`` uploads it later). ``WANDB_MODE`` (offline,
    online, disabled) always wins. Summary metrics: the best ``val/miou`` and ``val/top1`` of the run."""

    def __init__(self, project: str = "mabn", save_dir: str = "runs", offline: bool | None = None, **kwargs: Any):
        if offline is None:
            offline = "WANDB_MODE" not in os.environ and not wandb_ready()
        super().__init__(project=project, save_dir=save_dir, offline=offline, **kwargs)

    @property
    def experiment(self):
        run = super().experiment
        if getattr(run, "define_metric", None) is not None and not getattr(self, "_summaries_defined", False):
            for key in ("val/miou", "val/top1"):
                run.define_metric(key, summary="max")
            self._summaries_defined = True
        return run
