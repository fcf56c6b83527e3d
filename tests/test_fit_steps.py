"""``mabn.cli.fit.fit``: a fit runs its steps in the order its body lists them (every check, then the run folder's
lock, then the resume's plan, then the build, then training), a dry run runs the same steps up to the plan and
stops there, and the two plan the run through one computation (``plan_shape`` and the task's ``run_plan``), called
once each, with the same inputs; the planning methods take each default from the task's constructor (``settings``)."""

from __future__ import annotations

import functools

import pytest
import pytorch_lightning as pl
import torch

from helpers.fits import TINY, stage2_args
from mabn.cli import fit as fit_module
from mabn.cli import lightning as cli
from mabn.cli import plan as plan_module
from mabn.run import folder as runs
from mabn.run import lock as runlock
from mabn.run import plan_shape
from mabn.tasks import SegmentationTask
from mabn.tasks import base as task_base


def _spy(monkeypatch, owner, name: str, calls: list, label: str) -> None:
    real = getattr(owner, name)

    @functools.wraps(real)  # the parser reads Trainer.fit's arguments from its signature
    def spied(*args, **kwargs):
        calls.append((label, args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spied)


def test_a_fit_runs_its_steps_in_order_and_plans_as_its_dry_run_does(tiny_cityscapes, tmp_path, monkeypatch):
    # Both plan through one function: the configuration's and the Trainer's shapes meet in plan_shape.
    assert plan_module.plan_shape is task_base.plan_shape
    calls: list = []
    for owner, name, label in (
        (fit_module, "check_fit_config", "check"),
        (runlock, "lock", "lock"),
        (runs, "plan", "resume plan"),
        (plan_module, "plan_shape", "shape"),
        (task_base, "plan_shape", "shape"),
        (cli.MabnCLI, "build", "build"),
        (pl.Trainer, "fit", "train"),
    ):
        _spy(monkeypatch, owner, name, calls, label)
    run_plan = SegmentationTask.run_plan.__func__
    monkeypatch.setattr(
        SegmentationTask,
        "run_plan",
        classmethod(lambda cls, hp, shape: calls.append(("run_plan", (shape,), {})) or run_plan(cls, hp, shape)),
    )
    args = [*stage2_args(tiny_cityscapes, "mabn", *TINY), "--trainer.default_root_dir", str(tmp_path / "run")]

    lines = cli.run_cli(args, dry_run=True).plan_lines
    dry = [label for label, _, _ in calls]
    assert dry == ["check", "resume plan", "shape", "run_plan"]  # no lock, nothing built, nothing trained
    assert any(line.startswith("iterations:") for line in lines)
    dry_shape = calls[2][1]
    dry_planned = calls[3][1][0]

    calls.clear()
    cli.run_cli(args)
    steps = [label for label, _, _ in calls]
    # The task plans inside training (configure_optimizers), from the Trainer it runs under.
    assert steps == ["check", "lock", "resume plan", "build", "train", "shape", "run_plan"]
    assert calls[5][1] == dry_shape  # per device, devices, accumulation, norm batch, samples, epochs, steps, limit
    assert calls[6][1][0] == dry_planned


def test_the_planning_methods_take_each_default_from_the_constructor():
    """A task's planning methods read its arguments through ``settings``: what a mapping leaves out is the
    constructor's default, so a subclass that changes a default changes the plan, and nothing else holds a copy."""

    class LongWarmup(SegmentationTask):
        def __init__(self, warmup_epochs: float = 7.0, **rest) -> None:
            super().__init__(warmup_epochs=warmup_epochs, **rest)

    shape = plan_shape(4, 1, 1, 2, 40, 20, -1)  # 10 iterations an epoch
    recipe, longer = (task.run_plan({"norm": "mabn"}, shape) for task in (SegmentationTask, LongWarmup))
    assert (recipe.warmup_steps, longer.warmup_steps) == (30, 70)  # the recipe's 3 epochs, the subclass's 7
    assert recipe.lr == longer.lr
    settings = LongWarmup.settings({"norm": "gn"})
    assert (settings["norm"], settings["warmup_epochs"], settings["norm_batch_size"]) == ("gn", 7.0, 2)
    with pytest.raises(TypeError):  # read-only: a planning method cannot change what the fit will build
        settings["norm"] = "bn"


def test_the_checks_build_leaves_the_fits_random_state_as_it_was():
    """The fit seeds torch's generator before its checks and builds its model after them: the check's build of a
    model that cannot be built on the meta device (a mix transformer, built on the CPU) must draw nothing from it,
    or the fit's initial weights would depend on the check."""
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    SegmentationTask.build_unweighted({"norm": "gn", "arch": "mit_b0", "num_classes": 3})
    assert torch.equal(torch.random.get_rng_state(), before)
