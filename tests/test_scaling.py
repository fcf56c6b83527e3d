"""Both stages on any device count: the per-device and global batch, the lr by the linear scaling rule, stage 1's
warm-up and the schedule in epochs, as ``--dry-run`` says them for 1 to 64 GPUs (docs/scaling.md)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from helpers.commands import run_mabn
from helpers.marks import default_suite_runs
from helpers.trainer import quiet_trainer
from mabn.cli.commands import stage as stage_command
from mabn.errors import ConfigError
from mabn.run import scaling
from mabn.tasks.base import NormTask
from mabn.tasks.classification import ClassificationTask

LAYOUTS = [(1, 1), (8, 1), (8, 2), (8, 4), (8, 8)]  # GPUs per node x nodes, as the users run them
CITYSCAPES_TRAIN = 2975  # the real split's size: the recipe's epochs are of it
IMAGENET_CLASSES, IMAGENET_PER_CLASS = 16, 300  # enough for one global batch of 2048 on 64 devices


@pytest.fixture(scope="session")
def layouts(tmp_path_factory) -> dict[str, Path]:
    """Dataset layouts of empty files: a dry run plans from file names and reads no image. Each file is a hard
    link to one empty file, which a scan sees as a file of its own: on the suite's ext4 disk a new inode costs
    0.5-0.75 ms (the allocator scans past recently freed inodes, and each suite run frees thousands), a link to an
    existing one about a twentieth of that."""
    root = tmp_path_factory.mktemp("layouts")
    empty = root / "empty"
    empty.touch()

    def files(folder: Path, names: list[str]) -> None:
        folder.mkdir(parents=True)
        for name in names:
            os.link(empty, folder / name)

    cityscapes = root / "cityscapes"
    for split, count in (("train", CITYSCAPES_TRAIN), ("val", 1)):
        files(
            cityscapes / "leftImg8bit" / split / "aachen",
            [f"aachen_000000_{i:06d}_leftImg8bit.png" for i in range(count)],
        )
        files(
            cityscapes / "gtFine" / split / "aachen",
            [f"aachen_000000_{i:06d}_gtFine_labelIds.png" for i in range(count)],
        )
    imagenet = root / "imagenet"
    for c in range(IMAGENET_CLASSES):
        files(imagenet / "val" / f"n{c:08d}", ["0.JPEG"])
        files(imagenet / "train" / f"n{c:08d}", [f"{i}.JPEG" for i in range(IMAGENET_PER_CLASS)])
    return {"cityscapes": cityscapes, "pretrain": imagenet}


def _dry_run(capsys, stage: str, data: Path, gpus: int, nodes: int, *more: str) -> dict[str, str]:
    capsys.readouterr()
    stage_command.main([stage, "--data", str(data), "--gpus", str(gpus), "--nodes", str(nodes), "--dry-run", *more])
    lines = capsys.readouterr().out.splitlines()
    said = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in lines if ":" in line}
    return said | {"command": next(line for line in lines if line.startswith("python -m mabn fit"))}


def _numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)]


def _stage2_per_device(devices: int) -> int:
    """The rule, stated apart from mabn.run.scaling: the most whole pairs per device whose global batch stays within
    the paper's 16, and never less than one pair (so beyond 8 devices the global batch is 2 x devices)."""
    pairs = [k for k in range(1, 9) if 2 * k * devices <= 16]
    return 2 * max(pairs, default=1)


STAGE2_LAYOUTS = [(d, 1) for d in range(1, 17)] + [(8, 4), (8, 8)]


@pytest.mark.parametrize(
    ("gpus", "nodes"),
    default_suite_runs(
        STAGE2_LAYOUTS, keep=[(1, 1), (5, 1), (8, 1), (16, 1), (8, 8)], ids=[f"{g}x{n}" for g, n in STAGE2_LAYOUTS]
    ),  # fmt: skip
)
def test_stage2_takes_the_most_pairs_within_16_per_device_with_linear_lr_and_its_epochs(gpus, nodes, layouts, capsys):
    lines = _dry_run(capsys, "cityscapes", layouts["cityscapes"], gpus, nodes, "--backbone", "none")
    devices = gpus * nodes
    per_device = _stage2_per_device(devices)
    global_batch = per_device * devices
    assert f"{per_device} per device x {devices} device(s) = global batch {global_batch}" in lines["batch"]
    why = lines["global batch"]
    assert why.startswith(f"{global_batch}, ")
    if global_batch == 16:
        assert "the recipe's global_batch_size" in why
    elif global_batch < 16:
        assert "below the recipe's global_batch_size 16: 16 does not split" in why and f"over {devices} devices" in why
    else:
        assert f"above the recipe's global_batch_size 16: each of {devices} devices holds at least one" in why
    per_epoch = math.ceil(CITYSCAPES_TRAIN / devices) // per_device
    assert _numbers(lines["iterations"])[:3] == [per_epoch, CITYSCAPES_TRAIN, 200 * per_epoch]
    assert math.isclose(_numbers(lines["lr"])[3], 0.01 * global_batch / 16)
    warmup, power, end = _numbers(lines["schedule"])[1:]
    assert (warmup, end) == (round(3 * per_epoch), 200 * per_epoch)


@pytest.mark.parametrize(("gpus", "nodes"), LAYOUTS, ids=[f"{g}x{n}" for g, n in LAYOUTS])
def test_stage1_keeps_120_epochs_with_drops_at_30_60_90_on_any_device_count(gpus, nodes, layouts, capsys):
    lines = _dry_run(capsys, "pretrain", layouts["pretrain"], gpus, nodes)
    devices, samples = gpus * nodes, IMAGENET_CLASSES * IMAGENET_PER_CLASS
    assert f"32 per device x {devices} device(s) = global batch {32 * devices}" in lines["batch"]
    per_epoch = math.ceil(samples / devices) // 32
    assert _numbers(lines["iterations"])[:3] == [per_epoch, samples, 120 * per_epoch]
    assert math.isclose(_numbers(lines["lr"])[3], 0.1 * 32 * devices / 256)
    drops = _numbers(lines["schedule"])
    assert drops[-3:] == [30 * per_epoch, 60 * per_epoch, 90 * per_epoch]


def test_device_batch_rule():
    """Every device count gets a batch: the most whole pairs per device within the global batch of 16, at least
    one pair; without a normalization batch, single samples."""
    for devices in range(1, 65):
        assert scaling.device_batch(16, devices, 2) == _stage2_per_device(devices)
        assert scaling.device_batch(16, devices, None) == max(1, 16 // devices)
    with pytest.raises(ConfigError, match="global_batch_size=15 does not split into normalization batches"):
        scaling.device_batch(15, 4, 2)


def _pretrain_hparams(**override) -> dict:
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "pretrain.yaml").read_text())
    return config["model"]["init_args"] | override


def _lrs(hp: dict, shape: scaling.RunShape, steps: int) -> list[float]:
    """The lr the stage-1 plan gives at each of the first ``steps`` optimizer steps, set up as its fit sets it up."""
    plan = ClassificationTask.run_plan(hp, shape)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=plan.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.lr_factor)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def _shape(lines: dict[str, str], devices: int) -> scaling.RunShape:
    per_epoch, samples, total = (int(n) for n in _numbers(lines["iterations"])[:3])
    return scaling.RunShape(32, devices, 1, 2, samples, per_epoch, total)


def test_stage1_warms_up_over_5_epochs_from_base_lr_when_the_global_batch_exceeds_256(layouts, capsys):
    lines = _dry_run(capsys, "pretrain", layouts["pretrain"], 8, 8)
    per_epoch = math.ceil(IMAGENET_CLASSES * IMAGENET_PER_CLASS / 64) // 32
    warmup = 5 * per_epoch  # Goyal et al.: 5 epochs, from the lr of batch 256 (0.1) up to 0.1 x 2048 / 256
    assert lines["lr"] == "0.1 x 2048 / 256 = 0.8 (linear in the global batch)"
    assert lines["warm-up"].startswith(f"5 epochs ({warmup} iterations), from 0.1 to 0.8, as the global batch 2048")
    assert lines["schedule"].startswith(f"linear warm-up from 0.1 over 5 epochs ({warmup} iterations), then")
    lrs = _lrs(_pretrain_hparams(), _shape(lines, 64), warmup + 2)
    assert math.isclose(lrs[0], 0.1)
    assert all(math.isclose(lr, 0.1 + 0.7 * step / warmup) for step, lr in enumerate(lrs[:warmup]))
    assert math.isclose(lrs[warmup], 0.8) and math.isclose(lrs[warmup + 1], 0.8)


def test_stage1_at_256_has_no_warm_up_and_an_explicit_warmup_epochs_wins(layouts, capsys):
    recipe = _dry_run(capsys, "pretrain", layouts["pretrain"], 8, 1)
    assert recipe["warm-up"].startswith("none, as the global batch 256 does not exceed base_batch_size 256")
    assert recipe["schedule"].startswith("lr x 0.1 at epochs 30, 60, 90")
    assert _lrs(_pretrain_hparams(), _shape(recipe, 8), 3) == pytest.approx([0.1] * 3)
    off = _dry_run(capsys, "pretrain", layouts["pretrain"], 8, 8, "--", "--model.init_args.warmup_epochs", "0")
    assert off["warm-up"] == "none, as set (warmup_epochs: 0)"
    assert _lrs(_pretrain_hparams(warmup_epochs=0), _shape(off, 64), 3) == pytest.approx([0.8] * 3)


@pytest.mark.parametrize(("samples", "per_device", "devices"), [(10, 3, 3), (48, 4, 1), (2975, 2, 6), (7, 2, 4)])
def test_loader_batches_are_those_of_a_distributed_sampler_dropping_the_last_batch(samples, per_device, devices):
    data = torch.utils.data.TensorDataset(torch.zeros(samples))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=devices, rank=devices - 1, shuffle=True)
    loader = torch.utils.data.DataLoader(data, per_device, sampler=sampler, drop_last=True)
    assert scaling.loader_batches(samples, per_device, devices) == len(loader)
    # limit_train_batches, as Lightning reads it: an int at most that many, a float that share rounded down
    assert scaling.loader_batches(samples, per_device, devices, 1) == min(len(loader), 1)
    assert scaling.loader_batches(samples, per_device, devices, 0.5) == len(loader) // 2


def test_every_epoch_ends_its_partial_accumulation_window():
    assert scaling.iterations_per_epoch(7, accumulate=2) == 4  # 2 + 2 + 2 + 1 batches
    # 3 epochs of 4 steps (Lightning's fit loop steps at the end of each epoch), not ceil(7 x 3 / 2) = 11
    assert scaling.total_iterations(7, 3, -1, 2) == 12
    assert scaling.total_iterations(7, 3, 5, 1) == 5
    assert scaling.total_iterations(7, None, 5, 1) == 5


def test_missing_stage1_backbone_is_an_error_and_none_is_random_weights_on_purpose(
    layouts, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # no pretrain/ folder here
    code, _, err = run_mabn(["cityscapes", "--data", str(layouts["cityscapes"]), "--dry-run"], capsys)
    assert code == 2
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert error == [
        "error: no stage-1 backbone pretrain/resnet101-mabn.pt: run stage 1 first (make pretrain NORM=mabn "
        "DATA=<imagenet>), give one with BACKBONE=<file>, start from BN weights (BACKBONE=<a torchvision or timm "
        "ResNet state dict, or a stage-1 bn file>: converted to mabn; or NORM=bn with them as they are), or "
        "BACKBONE=none (--backbone none) to train the encoder from random weights"
    ]
    random = _dry_run(capsys, "cityscapes", layouts["cityscapes"], 1, 1, "--backbone", "none")
    assert random["Backbone"] == "none (BACKBONE=none): the encoder starts from random weights"
    assert "--model.init_args.backbone" not in random["command"]


def test_dry_run_names_the_backbone_it_will_load(layouts, backbones, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = backbones.place(backbones.stage1("mabn"), Path("pretrain/resnet101-mabn.pt"))
    lines = _dry_run(capsys, "cityscapes", layouts["cityscapes"], 8, 1)
    assert lines["Backbone"] == f"{path}, stage 1's export for NORM=mabn (BACKBONE=... picks another)"
    pending = _dry_run(capsys, "cityscapes", layouts["cityscapes"], 8, 1, "--backbone-pending")
    assert pending["Backbone"] == lines["Backbone"]  # a file that is there is used
    path.unlink()
    pending = _dry_run(capsys, "cityscapes", layouts["cityscapes"], 8, 1, "--backbone-pending")
    assert pending["Backbone"].endswith("to be written by the stage-1 job this one waits for")


def _spy(monkeypatch, name: str, change=lambda value: value) -> list[tuple]:
    """Wrap ``mabn.run.scaling.<name>``: record each call's arguments and result, and return ``change`` of it."""
    calls, function = [], getattr(scaling, name)

    def spy(*args):
        result = change(function(*args))
        calls.append((args, result))
        return result

    monkeypatch.setattr(scaling, name, spy)
    return calls


def test_the_fit_runs_the_plan_its_dry_run_prints(tiny_cityscapes, tmp_path, monkeypatch):
    """Stage 2 on 4 training images, 1 per device with 3 accumulated, for 2 epochs: each epoch steps after its
    3rd and 4th batch, so 2 steps an epoch and 4 in all; the warm-up is 1 epoch. The dry run's lines, computed
    from the configuration, hold the fit's live values: its steps, batch, accumulation, lr and schedule."""
    from mabn.cli import launch
    from mabn.cli import lightning as cli

    monkeypatch.chdir(tmp_path)
    # Both sides must take the lr from the one rule and the length from the one computation: the rule is given a
    # factor of 1.5 it does not have, and the computation's inputs and results are recorded.
    lrs = _spy(monkeypatch, "linear_lr", lambda lr: 1.5 * lr)
    lengths = _spy(monkeypatch, "total_iterations")
    extra = [
        *("--trainer.max_steps", "-1", "--trainer.max_epochs", "2", "--trainer.accumulate_grad_batches", "3"),
        *("--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false"),
        *("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"),
        *("--data.init_args.global_batch_size", "1", "--data.init_args.num_workers", "0"),
        *("--data.init_args.crop_size", "32", "--model.init_args.norm_batch_size", "1"),
        *("--model.init_args.arch", "resnet18", "--model.init_args.base_lr", "0.02"),
        *("--model.init_args.warmup_epochs", "1"),
    ]
    args = launch.build_args("cityscapes", tiny_cityscapes, "gn", gpus=0, nodes=1, extra=extra, backbone="none")
    said = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in cli.check(args) if ":" in line}
    planned = {"lr": lrs[:], "length": lengths[:]}
    lrs.clear(), lengths.clear()
    fit = cli.run_cli(args)
    trainer, lr = fit.trainer, 1.5 * 0.02 * 3 / 16
    assert said["batch"].startswith("1 per device x 1 device(s) x 3 accumulated = global batch 3")
    assert (fit.datamodule.batch_size, trainer.accumulate_grad_batches) == (1, 3)
    assert said["iterations"] == "2 per epoch (4 training samples), 4 in total"
    assert trainer.global_step == 4
    assert said["lr"].startswith(f"0.02 x 3 / 16 = {lr:g} for the encoder")
    assert trainer.optimizers[0].param_groups[0]["initial_lr"] == pytest.approx(lr, rel=1e-12)
    assert said["schedule"] == "linear warm-up over 1 epochs (2 iterations), then poly 0.9 to iteration 4"
    factor = trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0]
    assert [factor(step) for step in range(5)] == pytest.approx([0.5, 1.0, 0.5**0.9, 0.25**0.9, 0.0])
    # The one rule and the one computation, made by the dry run and by the fit from the same inputs to the same
    # values.
    assert planned["lr"] and lrs and set(planned["lr"] + lrs) == {lrs[0]} and lrs[0][0] == (0.02, 3, 16)
    assert planned["length"] == lengths == [((4, 2, -1, 3), 4)]


class _LinearTask(NormTask):
    """The least task that plans its fit: a constant lr of 0.1."""

    def __init__(self) -> None:
        super().__init__(norm="bn", norm_batch_size=None, cuda_graph=False)
        self.model = torch.nn.Linear(1, 1)

    @classmethod
    def run_plan(cls, hp, shape: scaling.RunShape) -> scaling.RunPlan:
        return scaling.RunPlan(shape, 0.1, 0, tuple(shape.lines()), lambda step: 1.0)

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.fit_plan().lr)


class _FiveSamples(pl.LightningDataModule):
    batch_size = 2

    def __init__(self, drop_last: bool) -> None:
        super().__init__()
        self.drop_last = drop_last

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.zeros(5, 1))
        return torch.utils.data.DataLoader(data, self.batch_size, drop_last=self.drop_last)


def test_a_fit_whose_loader_runs_another_length_than_its_plan_stops_naming_both(tmp_path):
    """5 samples in batches of 2: the plan counts the loader that drops its last partial batch (2 an epoch); one that
    keeps it runs 3, off the schedule's iterations."""
    trainer = quiet_trainer(tmp_path, max_epochs=2, limit_val_batches=0)
    trainer.fit(task := _LinearTask(), _FiveSamples(drop_last=True))
    assert trainer.global_step == task.planned.shape.total_iterations == 4
    with pytest.raises(ConfigError, match=r"the training loader gives 3 iterations per epoch and 6 in total, the "
                       r"plan of 5 samples in batches of 2 on 1 device\(s\) 2 and 4"):  # fmt: skip
        quiet_trainer(tmp_path, max_epochs=2, limit_val_batches=0).fit(_LinearTask(), _FiveSamples(drop_last=False))


@pytest.mark.slow  # two DDP processes on the CPU: ~40 s
def test_two_devices_run_the_plan_their_dry_run_prints(tiny_cityscapes, tmp_path, capsys):
    """Stage 2 on 2 CPU processes, 1 image each with 3 accumulated, for 3 epochs: the sampler gives each device 2 of
    the 4 images, so each epoch is 2 batches and one step over its partial window, 3 steps in all. The fit's plan,
    computed on each device from its Trainer, says the dry run's lines and runs them."""
    extra = [
        *("--trainer.max_epochs", "3", "--trainer.accumulate_grad_batches", "3", "--trainer.limit_val_batches", "0"),
        *("--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
        *("--data.init_args.global_batch_size", "2", "--data.init_args.num_workers", "0"),
        *("--data.init_args.crop_size", "32", "--model.init_args.norm_batch_size", "1"),
        *("--model.init_args.arch", "resnet18", "--model.init_args.warmup_epochs", "1"),
    ]
    stage = ["cityscapes", "--data", str(tiny_cityscapes), "--norm", "gn", "--gpus", "2", "--backbone", "none",
             "--run-dir", str(tmp_path / "run")]  # fmt: skip
    # GroupNorm normalizes no batch: the batch line names no normalization batches.
    planned = ["batch: 1 per device x 2 device(s) x 3 accumulated = global batch 6",
               "iterations: 1 per epoch (4 training samples), 3 in total",
               "lr: 0.01 x 6 / 16 = 0.00375 for the encoder, x 10 for the heads (linear in the global batch)",
               "schedule: linear warm-up over 1 epochs (1 iterations), then poly 0.9 to iteration 3"]  # fmt: skip
    capsys.readouterr()
    stage_command.main([*stage, "--dry-run", "--", *extra])
    dry = capsys.readouterr().out.splitlines()
    fit = subprocess.run([sys.executable, "-m", "mabn", *stage, "--", *extra], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    said = (fit.stdout + fit.stderr).splitlines()
    for line in planned:
        assert line in dry and line in said, line
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 3
    assert checkpoint["lr_schedulers"][0]["base_lrs"] == pytest.approx([0.00375, 0.0375], rel=1e-12)
