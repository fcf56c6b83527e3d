"""A first run that fits the machine it is on (docs/scaling.md, "Memory per device"): the estimate of the peak
memory per device at the run's crop, the largest per-device batch that fits the budget with gradients accumulated
to keep the global batch, a run that cannot fit even one normalization batch refused before it starts, and the
benchmark that holds the estimate against the measured peak."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from helpers import own_dataset
from helpers.commands import run_mabn
from helpers.own_dataset import line, segment
from helpers.trainer import fit_flags
from mabn.errors import ConfigError
from mabn.run import memory
from mabn.tasks import SegmentationTask

RECIPE_HP = {"norm": "mabn", "norm_batch_size": 2, "norm_options": {"mabn": {"momentum": 0.98, "buffer_size": 16}}}


@pytest.fixture(scope="module")
def small_images(tmp_path_factory) -> Path:
    return own_dataset.bands(tmp_path_factory.mktemp("memory") / "small")


class _Logged(logging.Handler):
    """The lines Lightning's logger writes (the task's plan at the start of a fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += record.getMessage().splitlines()


@pytest.fixture
def logged():
    handler = _Logged()
    logger = logging.getLogger("pytorch_lightning")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def _estimate(arch: str, crop: int, images: int) -> int:
    """The product's estimate of a step of ``images`` crops of ``crop`` of PSPNet on ``arch`` with MABN."""
    sizes = SegmentationTask.planned_sizes(SegmentationTask.settings({**RECIPE_HP, "arch": arch, "num_classes": 3}))
    return memory.estimate(sizes.params, sizes.buffers, memory.activation_bytes(arch, "mabn"), crop, images).total


def _linear(fixed: int, per_image: int):
    return lambda images: memory.Estimate(fixed, per_image * images, 96, images)


def test_the_largest_per_device_batch_of_whole_normalization_batches_dividing_the_recipes_is_taken():
    budget = memory.Budget(1000, "a test's")
    fit = memory.fit_batch(16, 2, _linear(100, 100), budget, "a network")
    # 16 (1700) and 8 (900 fits): 8 per device, 2 micro-batches per step.
    assert (fit.per_device, fit.accumulate, fit.estimate.total, fit.recipe_estimate.total) == (8, 2, 900, 1700)
    # 6 would fit 700 but does not divide 16: 4, accumulated 4 times, keeps the global batch.
    fit = memory.fit_batch(16, 2, _linear(100, 100), memory.Budget(700, "a test's"), "a network")
    assert (fit.per_device, fit.accumulate) == (4, 4)
    assert memory.fit_batch(12, 2, _linear(100, 100), memory.Budget(700, "a test's"), "n").per_device == 6
    assert memory.fit_batch(16, None, _linear(100, 100), memory.Budget(250, "a test's"), "n").per_device == 1
    unknown = memory.fit_batch(16, 2, _linear(100, 100), memory.Budget(None, "read later"), "n")
    assert (unknown.per_device, unknown.accumulate) == (16, 1)
    with pytest.raises(ConfigError) as refused:
        memory.fit_batch(16, 2, _linear(10**9, 10**9), memory.Budget(2 * 10**9, "MABN_MEMORY_BUDGET_GB=2"), "r101")
    assert str(refused.value) == (
        "one normalization batch of 2 (2 crop(s) of 96x96, r101) needs about 3.0 GB per device, above the budget of "
        "2.0 GB (MABN_MEMORY_BUDGET_GB=2): lower --data.init_args.crop_size, take a smaller encoder "
        "(--model.init_args.arch), or train on a device with more memory"
    )


def test_the_budget_is_a_share_of_the_ram_available_and_the_setting_lowers_it(monkeypatch):
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    monkeypatch.setattr(memory, "mem_available", lambda: 20 * 10**9)
    assert memory.device_budget(cuda=False) == memory.Budget(16 * 10**9, "80% of the 20.0 GB of RAM available")
    assert memory.device_budget(cuda=False, processes=2).bytes == 8 * 10**9  # CPU processes of a node share it
    monkeypatch.setenv(memory.BUDGET_ENV, "3.5")
    assert memory.device_budget(cuda=False) == memory.Budget(35 * 10**8, "MABN_MEMORY_BUDGET_GB=3.5")
    monkeypatch.setenv(memory.BUDGET_ENV, "30")  # a setting never raises the budget
    assert memory.device_budget(cuda=False).bytes == 16 * 10**9
    for bad in ("lots", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(memory.BUDGET_ENV, bad)
        with pytest.raises(ConfigError, match=f"^MABN_MEMORY_BUDGET_GB='{bad}': give the memory per device in GB"):
            memory.device_budget(cuda=False)


def test_the_dry_run_prints_the_estimate_at_the_crop_from_the_data(small_images, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    code, lines, err = segment(small_images, tmp_path / "run", capsys, "--model.init_args.arch", "resnext50_32x4d")
    assert code == 0, err
    assert "batch: 16 per device x 1 device(s) = global batch 16, normalization batches of 2" in lines
    said = line(lines, "memory:")
    total = _estimate("resnext50_32x4d", 96, 16)
    assert said.startswith(f"memory: about {memory.gb(total)} per device (")
    assert "activations of 16 crops of 96x96, resnext50_32x4d with mabn), within the budget of " in said
    assert re.search(r"\(80% of the [\d.]+ GB of RAM available\)$", said), said


def test_a_budget_below_the_recipes_batch_lowers_the_per_device_batch_and_keeps_the_global_batch(
    small_images, tmp_path, capsys, monkeypatch
):
    # Between the estimates of 4 and of 8 crops per device: 4 per device, 4 micro-batches per optimizer step.
    setting = f"{(_estimate('resnet50', 96, 4) + _estimate('resnet50', 96, 8)) / 2e9:.4f}"
    monkeypatch.setenv(memory.BUDGET_ENV, setting)
    code, lines, err = segment(small_images, tmp_path / "run", capsys, "--model.init_args.arch", "resnet50")
    assert code == 0, err
    assert "batch: 4 per device x 1 device(s) x 4 accumulated = global batch 16, normalization batches of 2" in lines
    assert "lr: 0.01 x 16 / 16 = 0.01 for the encoder, x 10 for the heads (linear in the global batch)" in lines
    said = line(lines, "memory:")
    assert said.endswith(
        f"above the budget of {memory.gb(int(float(setting) * 1e9))} (MABN_MEMORY_BUDGET_GB={setting}): 4 images "
        f"per device (about {memory.gb(_estimate('resnet50', 96, 4))}) with accumulate_grad_batches 4 keep the "
        "global batch 16"
    ), said


@pytest.mark.slow  # builds the model at the recipe's crop
def test_a_run_that_cannot_fit_one_normalization_batch_is_refused_naming_what_to_lower(
    small_images, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv(memory.BUDGET_ENV, "0.1")
    code, lines, err = segment(small_images, tmp_path / "run", capsys, "--model.init_args.arch", "resnet50")
    assert code == 2 and not [said for said in lines if said.startswith(("batch:", "memory:"))]
    assert err.startswith("error: one normalization batch of 2 (2 crop(s) of 96x96, resnet50 with mabn) needs about ")
    assert "lower --data.init_args.crop_size, take a smaller encoder (--model.init_args.arch)" in err
    assert len(err.strip().splitlines()) == 1
    # The run itself stops there too, before a step: no checkpoint.
    code, _, err = segment(small_images, tmp_path / "fit", capsys, "--model.init_args.arch", "resnet50", dry_run=False)
    assert code == 2 and "error: one normalization batch of 2" in err
    assert not list((tmp_path / "fit").rglob("*.ckpt"))


@pytest.mark.slow  # two steps of 16 images of 96x96 through ResNet-50: 15 s to a minute on 2 shared CPU cores
def test_the_fit_takes_the_lowered_batch_and_its_effective_global_batch_is_the_recipes(
    small_images, tmp_path, capsys, monkeypatch, logged
):
    import torch

    budget = (_estimate("resnet50", 96, 4) + _estimate("resnet50", 96, 8)) / 2
    monkeypatch.setenv(memory.BUDGET_ENV, f"{budget / 1e9:.4f}")
    run = tmp_path / "run"
    flags = [*fit_flags(2, num_sanity_val_steps=0, limit_val_batches=1), "--data.init_args.num_workers", "0"]
    code, lines, err = segment(small_images, run, capsys, "--model.init_args.arch", "resnet50", *flags, dry_run=False)
    assert code == 0, err
    assert "batch: 4 per device x 1 device(s) x 4 accumulated = global batch 16, normalization batches of 2" in logged
    assert line(lines, "memory:").endswith("with accumulate_grad_batches 4 keep the global batch 16")
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"]
    # 2 optimizer steps took 8 loader batches of 4: 16 images per step, the recipe's global batch.
    assert (saved["global_step"], progress) == (2, 8)


@pytest.mark.slow  # two steps of 16 images of 96x96 through ResNeXt-50: 14 s to a minute on 2 shared CPU cores
def test_resnext50_trains_two_steps_at_the_crop_from_the_data(small_images, tmp_path, capsys, monkeypatch, logged):
    import torch

    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    run = tmp_path / "run"
    flags = [*fit_flags(2, num_sanity_val_steps=0, limit_val_batches=1), "--data.init_args.num_workers", "0"]
    arch = ("--model.init_args.arch", "resnext50_32x4d")
    code, lines, err = segment(small_images, run, capsys, *arch, *flags, dry_run=False)
    assert code == 0, err
    assert line(lines, "crop:").startswith("crop: 96x96, from the data")
    assert "batch: 16 per device x 1 device(s) = global batch 16, normalization batches of 2" in logged
    assert line(lines, "memory:").startswith(f"memory: about {memory.gb(_estimate('resnext50_32x4d', 96, 16))} ")
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 2 and saved["datamodule_hyper_parameters"]["crop_size"] == 96


@pytest.mark.slow  # measures the peak of real training steps
def test_the_memory_benchmark_holds_the_estimate_against_the_measured_peak(tmp_path, capsys):
    # One point, one step, a tiny crop: the command's path, not its numbers (docs/bench-memory-cpu.md has those).
    out = tmp_path / "memory.md"
    tiny = ["--archs", "resnet18", "--crops", "32", "--steps", "1", "--threads", "1"]
    code, printed, err = run_mabn(["bench", "memory", *tiny, "--out", str(out)], capsys)
    assert code == 0, err
    text = out.read_text()
    assert text.startswith("## Peak training memory against its estimate (CPU)\n\n`python -m mabn bench memory --archs")
    number = r"([\d.]+)"
    cells = rf"{number} \+ {number} = {number} MB \| {number} MB \| {number}"
    row = re.search(rf"^\| resnet18 \| 32 \| 2 \| 16\.8 M \| {cells} \|$", text, re.M)
    assert row, text
    fixed, activations, total, measured, ratio = (float(g) for g in row.groups())
    assert fixed + activations == pytest.approx(total, abs=1) and measured > 0
    assert ratio == pytest.approx(total / measured, abs=0.01)
    assert f"wrote {out}" in printed
