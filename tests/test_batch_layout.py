"""A resume keeps the batch layout its checkpoint recorded (``mabn.tasks.batch_layout.BatchLayout``): the
session's short stage-2 fit (4 crops per device, no accumulation) resumed where 4 crops no longer fit the memory
budget stops in one line instead of training on as 2 x 2 accumulated (other batches, other steps an epoch, another
schedule); a fit of 2 x 2 resumed where 4 crops fit keeps 2 x 2."""

from __future__ import annotations

import pytest
import torch

from helpers.commands import run_mabn
from helpers.fits import TINY, copy_run
from mabn.run.memory import BUDGET_ENV, GB, estimate
from mabn.tasks import memory
from mabn.tasks.batch_layout import LAYOUT_KEY
from mabn.tasks.segmentation import SegmentationTask


def test_a_resume_where_its_recorded_batch_does_not_fit_is_refused_in_one_line(
    stage2_run, tmp_path, monkeypatch, capsys
):
    folder = copy_run(stage2_run.folder, tmp_path / "run")
    (folder / ".lock").unlink()  # a link to the shared run's: its own is made at the launch
    saved = torch.load(stage2_run.checkpoint, weights_only=True)
    assert saved[LAYOUT_KEY] == {"per_device": 4, "accumulate": 1, "processes": 1}
    hp = {k: v for k, v in saved["hyper_parameters"].items() if not k.startswith("_")}  # the task's arguments
    sizes = SegmentationTask.planned_sizes(hp)
    params, buffers = sizes.params, sizes.buffers
    per_pixel = memory.per_pixel(hp)
    four, two = (estimate(params, buffers, per_pixel, 32, n).total for n in (4, 2))
    monkeypatch.setenv(BUDGET_ENV, str((four + two) / 2 / GB))  # 2 crops fit, 4 do not
    monkeypatch.chdir(tmp_path)
    argv = ["cityscapes", "--data", str(stage2_run.data), "--norm", "mabn", "--backbone", "none"]
    argv += ["--run-dir", str(folder), "--resume", "auto", "--", *TINY, "--trainer.max_steps", "4"]
    code, out, err = run_mabn(argv, capsys)
    assert code == 2 and "Traceback" not in err, (out[-3000:], err[-3000:])
    last = err.strip().splitlines()[-1]
    last_ckpt = folder / "checkpoints" / "last.ckpt"
    assert last.startswith(f"error: {last_ckpt} was trained with a batch of 4 per device x 1 accumulated"), last
    assert "resume where it fits" in last
    assert torch.load(last_ckpt, weights_only=True)["global_step"] == 2


@pytest.mark.slow
def test_a_resume_keeps_its_recorded_batch_where_the_memory_would_take_another(
    stage2_run, tmp_path, monkeypatch, capsys
):
    """A fit of 2 steps under a budget of 2 crops (2 x 2 accumulated), resumed to 4 steps where 4 crops fit: the
    resume keeps 2 x 2, says so, and its checkpoint records it."""
    saved = torch.load(stage2_run.checkpoint, weights_only=True)
    hp = {k: v for k, v in saved["hyper_parameters"].items() if not k.startswith("_")}  # the task's arguments
    sizes = SegmentationTask.planned_sizes(hp)
    params, buffers = sizes.params, sizes.buffers
    four, two = (estimate(params, buffers, memory.per_pixel(hp), 32, n).total for n in (4, 2))
    folder = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    argv = ["cityscapes", "--data", str(stage2_run.data), "--norm", "mabn", "--backbone", "none"]
    argv += ["--run-dir", str(folder), "--resume", "auto", "--", *TINY]
    monkeypatch.setenv(BUDGET_ENV, str((four + two) / 2 / GB))
    code, _, err = run_mabn(argv, capsys)
    assert code == 0, err[-3000:]
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)[LAYOUT_KEY]["accumulate"] == 2
    monkeypatch.delenv(BUDGET_ENV)
    code, out, err = run_mabn([*argv, "--trainer.max_steps", "4"], capsys)
    assert code == 0, err[-3000:]
    assert f"batch: 2 per device x 2 accumulated, as {folder / 'checkpoints' / 'last.ckpt'} was trained" in out + err
    resumed = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 4
    assert resumed[LAYOUT_KEY] == {"per_device": 2, "accumulate": 2, "processes": 1}
