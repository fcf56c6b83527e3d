"""The settings of the tests' short fits, as ``pl.Trainer`` keywords and as LightningCLI flags."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl

QUIET = {"enable_progress_bar": False, "enable_model_summary": False}
# A fit that leaves nothing behind: no logger, no checkpoints.
BARE = {**QUIET, "logger": False, "enable_checkpointing": False}


def quiet_trainer(root: Path, **kwargs) -> pl.Trainer:
    """A deterministic Trainer in ``root`` with the BARE settings; ``kwargs`` add to them or override them."""
    return pl.Trainer(**{**BARE, "default_root_dir": root, "deterministic": True, **kwargs})


def flags(section: str, **settings) -> list[str]:
    """``--<section>.<key> <value>`` for each setting, booleans as LightningCLI spells them."""
    out: list[str] = []
    for key, value in settings.items():
        out += [f"--{section}.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def fit_flags(steps: int, **settings) -> list[str]:
    """--trainer.* flags of a quiet fit of ``steps`` optimizer steps, with further trainer ``settings``."""
    return flags("trainer", max_steps=steps, **QUIET, **settings)


# Stage 1 on the tiny ImageNet layout: 2 steps of 8 images at 32 px, one validation batch at the end.
STAGE1_FIT = [
    *fit_flags(2, val_check_interval=2, limit_val_batches=1),
    *flags("data.init_args", batch_size=8, num_workers=0, image_size=32, val_resize=36),
]
# Stage 2 on the tiny Cityscapes layout: 2 steps of 4 images (1 per epoch) at crop 32, one validation at the end.
STAGE2_FIT = [
    *fit_flags(2, check_val_every_n_epoch=2, limit_val_batches=1, num_sanity_val_steps=0),
    *flags("data.init_args", global_batch_size=4, num_workers=0, crop_size=32),
]
