"""The phase rule, written once (``mabn.norm.phase``), and the keys that name its first steps: PhaseRule's
``moving_stats_first_step`` and ``renorm_first_step``. A checkpoint's hyperparameters may carry the keys
``moving_stats_from`` (a first step) and ``renorm_from`` (the last step before renormalization): they are
translated there, and refused in a config or a Python mapping."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from mabn.callbacks import NormPolicy, PhaseRule
from mabn.cli import launch
from mabn.cli import lightning as cli
from mabn.data.synthetic import imagenet as demo_imagenet
from mabn.errors import ConfigError
from mabn.inference.checkpoint import load_task
from mabn.norm import MABN2d
from mabn.norm.phase import phase
from mabn.tasks import ClassificationTask


@pytest.mark.parametrize(("moving", "renorm"), [(1, 1), (2, 100), (5, 3), (4, 5), (4, 4)])
def test_each_key_names_the_first_step_of_its_phase(moving, renorm):
    """Moving statistics from step ``moving`` on; r from step ``renorm`` on, but never on or before the first step
    with moving statistics: ints and tensors give the same answers."""
    rule = PhaseRule(prefixes=["x"], moving_stats_first_step=moving, renorm_first_step=renorm)
    answers = [tuple(bool(v) for v in rule.phase(step)) for step in range(120)]  # 0-based optimizer steps
    first_moving = next(t for t, (m, _) in enumerate(answers, start=1) if m)
    first_renorm = next(t for t, (_, r) in enumerate(answers, start=1) if r)
    assert first_moving == moving
    assert first_renorm == max(renorm, moving + 1)
    assert all(m for m, _ in answers[moving - 1 :]) and all(r for _, r in answers[first_renorm - 1 :])
    for t in range(1, 121):
        as_tensor = phase(torch.tensor(t), moving, renorm)
        assert tuple(bool(v) for v in as_tensor) == answers[t - 1], t


@pytest.mark.parametrize(("warmup", "renorm_warmup"), [(3, 6), (2, 0), (4, 2)])
def test_a_layer_switches_where_the_rule_says(warmup, renorm_warmup):
    """MABN2d's own timeline is the rule at (warmup_iters, renorm_warmup_iters + 1): the first forward with moving
    statistics (its one-entry buffer full from the second) and the first with r != 1."""
    torch.manual_seed(0)
    layer = MABN2d(2, buffer_size=1, warmup_iters=warmup, renorm_warmup_iters=renorm_warmup, momentum=0.5)
    layer.track_stats = True
    seen = []
    for t in range(1, 10):
        layer(torch.randn(2, 2, 3, 3) * t)  # a changing scale: r differs from 1 once it may
        seen.append((bool(layer.last_stats["active"].all()), bool((layer.last_stats["r"] != 1).all())))
    expected = [phase(t, warmup, renorm_warmup + 1) for t in range(1, 10)]
    assert seen == expected


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("renorm_from", 99, "norm_policy.groups.backbone: renorm_from is no setting; write renorm_first_step: 100"),
        ("moving_stats_from", 2, "norm_policy.groups.backbone: moving_stats_from is no setting; write "
         "moving_stats_first_step: 2"),
    ],
)  # fmt: skip
def test_a_key_naming_a_step_otherwise_is_refused_naming_the_setting(key, value, message):
    with pytest.raises(ConfigError) as info:
        NormPolicy.parse({"groups": {"backbone": {"prefixes": ["model."], key: value}}})
    assert str(info.value).startswith(message), str(info.value)
    assert len(str(info.value).splitlines()) == 1


OLD_POLICY = {"groups": {"backbone": {"prefixes": ["model."], "moving_stats_from": 2, "renorm_from": 99}}}


def test_a_checkpoints_keys_are_translated_to_the_same_steps():
    (rule,) = NormPolicy.from_checkpoint({**OLD_POLICY, "log_every_n_steps": 7}).groups.values()
    assert (rule.moving_stats_first_step, rule.renorm_first_step) == (2, 100)

    def old_meaning(step: int) -> tuple[bool, bool]:  # moving_stats_from: 2, renorm_from: 99
        return step + 1 >= 2, step + 1 > max(99, 2)

    assert all(rule.phase(step) == old_meaning(step) for step in range(200))
    assert NormPolicy.from_checkpoint({**OLD_POLICY, "log_every_n_steps": 7}).log_every_n_steps == 7
    with pytest.raises(ConfigError, match="renorm_frm"):  # anything else is checked as in a config
        NormPolicy.from_checkpoint({"groups": {"b": {"prefixes": ["m."], "renorm_frm": 3}}})


def test_test_and_export_rebuild_a_task_whose_checkpoint_names_the_steps_otherwise(tmp_path):
    task = ClassificationTask(num_classes=3, arch="resnet18", norm="mabn", export_dir=None)
    hparams = {**task.hparams, "norm_policy": OLD_POLICY, "_class_path": "mabn.tasks.ClassificationTask"}
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": hparams}, path)
    restored = load_task(path).task
    (rule,) = NormPolicy.parse(restored.hparams["norm_policy"]).groups.values()
    assert (rule.moving_stats_first_step, rule.renorm_first_step) == (2, 100)


@pytest.fixture(scope="module")
def stage1_args(tmp_path_factory) -> list[str]:
    data = demo_imagenet.generate(tmp_path_factory.mktemp("data") / "cls", n_train=4, n_val=2, size=40)
    extra = ["--data.init_args.data_dir", str(data), "--model.init_args.arch", "resnet18"]
    return launch.build_args("pretrain", data, "mabn", gpus=0, nodes=1, extra=extra)


def test_a_resume_reads_a_checkpoints_keys_as_the_same_steps(stage1_args, tmp_path, monkeypatch):
    """``fit --ckpt_path`` merges the checkpoint's hyperparameters into the config, its policy translated."""
    monkeypatch.chdir(tmp_path)
    hparams = {"_class_path": "mabn.tasks.ClassificationTask", "norm": "mabn", "norm_policy": OLD_POLICY}
    torch.save({"state_dict": {}, "hyper_parameters": hparams, "epoch": 0, "global_step": 3}, "old.ckpt")
    parsed = cli.run_cli([*stage1_args, "--ckpt_path", "old.ckpt"], dry_run=True)  # parsed, checked, nothing built
    (rule,) = parsed.config.model.init_args.norm_policy.groups.values()
    assert (rule.moving_stats_first_step, rule.renorm_first_step) == (2, 100)


def test_a_config_with_a_key_naming_a_step_otherwise_is_refused(stage1_args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = Path("old.yaml")
    groups = "{backbone: {prefixes: [model.], moving_stats_from: 2, renorm_from: 99}}"
    config.write_text(f"model:\n  init_args:\n    norm_policy:\n      groups: {groups}\n")
    with pytest.raises(cli.ArgumentMistake, match="moving_stats_from .*did you mean .*moving_stats_first_step"):
        cli.check([*stage1_args, "--config", str(config)])
    assert not list(itertools.chain(Path().glob("runs/**/*.ckpt")))
