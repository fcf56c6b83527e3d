"""``--ckpt_path auto``: find the checkpoint a restarted run continues from.

A run that was killed, preempted or requeued is restarted with the same command; ``auto`` makes that command
resume from the newest checkpoint the stage wrote (``last.ckpt``, a best-k checkpoint, or the checkpoint
Lightning saves on SLURM's requeue signal), and start afresh when there is none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

AUTO = "auto"


def _read_meta(path: Path) -> dict[str, Any] | None:
    """The checkpoint's hyperparameters and counters, without reading its tensors; None if unreadable
    (e.g. a file cut short by the kill)."""
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # any unreadable file is skipped, and reported by the caller
        return None
    return {
        "hparams": dict(ckpt.get("hyper_parameters") or {}),
        "epoch": ckpt.get("epoch"),
        "global_step": ckpt.get("global_step"),
    }


def find_resume_checkpoint(root: str | Path, hparams: dict[str, Any], keys: tuple[str, ...] = ("norm",)) -> Path | None:
    """The newest ``*.ckpt`` under ``root`` whose hyperparameters agree with ``hparams`` on ``keys``.

    The key check keeps a run with another norm (the stages write every norm's runs under one folder) from
    being picked. Unreadable files are skipped with a message.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = sorted(root.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        meta = _read_meta(path)
        if meta is None:
            print(f"Skipping unreadable checkpoint {path}")
            continue
        if all(meta["hparams"].get(k) == hparams.get(k) for k in keys if k in hparams):
            return path
    return None


def resolve(ckpt_path: str | None, root: str | Path, hparams: dict[str, Any]) -> str | None:
    """``ckpt_path`` unless it is ``auto``, which becomes the checkpoint to resume from, or None (a new run)."""
    if ckpt_path != AUTO:
        return ckpt_path
    found = find_resume_checkpoint(root, hparams)
    if found is None:
        print(f"No checkpoint to resume under {root}: starting a new run.")
        return None
    meta = _read_meta(found) or {}
    print(f"Resuming from {found} (epoch {meta.get('epoch')}, step {meta.get('global_step')}).")
    return str(found)
