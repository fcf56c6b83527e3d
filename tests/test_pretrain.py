"""Stage 1: short fits through the real CLI, the backbone hand-off, the recipe's schedule, bad data.

The fits train ResNet-18 (``arch: resnet18``): the CLI, the export and the hand-off are the same code at any
depth, and the default ResNet-101 is what ``test_weight_decay_reaches_norm_gamma_and_beta`` builds."""

from pathlib import Path

import pytest
import pytorch_lightning as pl
import segmentation_models_pytorch as smp
import torch

from helpers.commands import run_mabn
from helpers.marks import default_suite_runs
from helpers.trainer import BARE, STAGE1_FIT
from mabn import MABN2d, convert_norm
from mabn.callbacks.policy import NormPolicy
from mabn.cli import launch
from mabn.cli import lightning as cli
from mabn.data.synthetic import imagenet as demo_imagenet
from mabn.models import BackboneError, load_backbone, load_backbone_into, norm_kwargs_for
from mabn.tasks import ClassificationTask
from mabn.tasks.classification import backbone_path

ARCH = "resnet18"  # the short fits' depth


def _fit_args(data: Path, norm: str, *extra: str, arch: str | None = ARCH) -> list[str]:
    """A 2-step fit of ``arch`` (None: the recipe's default)."""
    args = launch.build_args("pretrain", data, norm, gpus=0, nodes=1, extra=list(extra))
    args += ["--model.init_args.arch", arch] if arch else []
    return args + STAGE1_FIT


@pytest.mark.parametrize("norm", default_suite_runs(["bn", "gn", "brn", "mabn"], keep=["mabn"]))
def test_short_fit_exports_a_backbone_that_loads_into_the_stage2_encoder(tiny_imagenet, tmp_path, monkeypatch, norm):
    monkeypatch.chdir(tmp_path)
    cli.run_cli(_fit_args(tiny_imagenet, norm))
    path = tmp_path / "pretrain" / f"{ARCH}-{norm}.pt"
    payload = load_backbone(path, norm)
    assert payload["norm"] == norm and payload["arch"] == ARCH
    assert payload["centralized"] == (norm == "mabn")
    assert 0.0 <= payload["val_top1"] <= 1.0
    assert payload["config"]["model"]["norm"] == norm and payload["config"]["global_batch_size"] == 8
    assert not any(k.startswith("fc.") for k in payload["state_dict"])

    encoder = smp.encoders.get_encoder(ARCH, weights=None, output_stride=8)
    convert_norm(encoder, norm, **norm_kwargs_for(norm, 2, {"mabn": {"buffer_size": 16}}))
    info = load_backbone_into(encoder, path, norm, ARCH)
    for key, value in encoder.state_dict().items():
        assert torch.equal(value, payload["state_dict"][key]), key
    assert info["norm"] == norm


@pytest.mark.slow  # a stage-1 fit, then a stage-2 start
def test_norm_mismatch_names_both_norms(tiny_imagenet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli.run_cli(_fit_args(tiny_imagenet, "bn"))
    encoder = convert_norm(smp.encoders.get_encoder(ARCH, weights=None, output_stride=8), "gn")
    with pytest.raises(BackboneError, match="pre-trained with norm 'bn'.*asks for norm 'gn'"):
        load_backbone_into(encoder, tmp_path / "pretrain" / f"{ARCH}-bn.pt", "gn", ARCH)
    with pytest.raises(BackboneError, match="not found"):
        load_backbone(tmp_path / "pretrain" / f"{ARCH}-gn.pt", "gn")


class _RecordLR(pl.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_lr_schedule_follows_the_recipe_formula(tiny_imagenet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # milestones in epochs: 5 optimizer steps an epoch put the drops at steps 2 and 4
    args = _fit_args(
        tiny_imagenet, "bn", "--model.init_args.milestones", "[0.4, 0.8]", "--model.init_args.base_lr", "0.4"
    )
    args += ["--data.init_args.batch_size", "4"]  # 40 images: 10 micro-batches, 5 whole optimizer steps an epoch
    parsed = cli.run_cli(args[1:], run=False)  # without the "fit" subcommand: build, don't run
    record = _RecordLR()
    trainer = pl.Trainer(max_steps=6, callbacks=[record], limit_val_batches=0, accumulate_grad_batches=2, **BARE)
    parsed.model.hparams.export_dir = None
    trainer.fit(parsed.model, parsed.datamodule)
    base = 0.4 * (4 * 2) / 256  # lr x global batch (4 per micro-batch x 2 accumulated) / 256
    # one entry per micro-batch; optimizer step i covers micro-batches 2i and 2i+1
    expected = [base * 0.1 ** sum(i // 2 >= m for m in (2, 4)) for i in range(12)]
    assert record.lrs == pytest.approx(expected, rel=1e-12)


class _ZeroGradientStep(pl.Callback):
    """At the start of training, before any batch: the norms' gamma 2 and beta -1, then one optimizer step with
    zero loss gradients, so that only weight decay moves them; records (lr, weight decay); then stops the fit."""

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        self.lr, self.wd = optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]
        with torch.no_grad():
            for m in pl_module.modules():
                if isinstance(m, MABN2d):
                    m.weight.fill_(2.0)
                    m.bias.fill_(-1.0)
        for p in pl_module.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        trainer.should_stop = True  # the fit loop ends before its first batch


def test_weight_decay_reaches_norm_gamma_and_beta(tiny_imagenet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parsed = cli.run_cli(_fit_args(tiny_imagenet, "mabn", arch=None)[1:], run=False)
    task: ClassificationTask = parsed.model
    assert task.hparams.arch == "resnet101" and len(task.model.layer3) == 23  # the recipe's default: ResNet-101
    assert backbone_path(task.hparams.export_dir, "mabn", task.hparams.arch).name == "resnet101-mabn.pt"
    task.hparams.export_dir = None
    step = _ZeroGradientStep()
    trainer = pl.Trainer(max_epochs=1, limit_val_batches=0, callbacks=[step], **BARE)
    trainer.fit(task, parsed.datamodule)
    assert step.wd == 1e-4
    norms = [m for m in task.modules() if isinstance(m, MABN2d)]
    assert norms
    for m in norms:
        torch.testing.assert_close(m.weight, torch.full_like(m.weight, 2.0 * (1 - step.lr * step.wd)))
        torch.testing.assert_close(m.bias, torch.full_like(m.bias, -1.0 * (1 - step.lr * step.wd)))


def _copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _expect_error(capsys, args, *fragments):
    code, _, err = run_mabn(args, capsys)
    assert code == 2
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[0], err[0]


def test_bad_datasets_give_one_clear_error_naming_the_path(tiny_imagenet, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "missing"
    _expect_error(
        capsys, _fit_args(tiny_imagenet, "bn", "--data.init_args.data_dir", str(missing)), str(missing / "train")
    )

    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    (empty / "val").mkdir()
    _expect_error(capsys, _fit_args(tiny_imagenet, "bn", "--data.init_args.data_dir", str(empty)), str(empty / "train"))

    differ = _copy_tree(tiny_imagenet, tmp_path / "differ")
    (differ / "val" / demo_imagenet.CLASSES[3]).rename(differ / "val" / "zz_unknown")
    _expect_error(capsys, _fit_args(tiny_imagenet, "bn", "--data.init_args.data_dir", str(differ)),
                  "class folders differ", demo_imagenet.CLASSES[3], "zz_unknown")  # fmt: skip

    no_images = _copy_tree(tiny_imagenet, tmp_path / "no_images")
    for f in (no_images / "val" / demo_imagenet.CLASSES[0]).iterdir():
        f.unlink()
    _expect_error(capsys, _fit_args(tiny_imagenet, "bn", "--data.init_args.data_dir", str(no_images)),
                  str(no_images / "val" / demo_imagenet.CLASSES[0]))  # fmt: skip


@pytest.mark.parametrize("workers", default_suite_runs([0, 1], keep=[1]))
def test_unreadable_image_is_named_also_from_a_worker(tiny_imagenet, tmp_path, monkeypatch, capsys, workers):
    monkeypatch.chdir(tmp_path)
    broken = _copy_tree(tiny_imagenet, tmp_path / "broken")
    for f in (broken / "train").rglob("*.png"):
        f.write_bytes(b"not a png")
    victim = sorted((broken / "train").rglob("*.png"))[0]
    args = _fit_args(tiny_imagenet, "bn", "--data.init_args.data_dir", str(broken))
    _expect_error(capsys, args + ["--data.init_args.num_workers", str(workers)], "cannot read image", "broken/train")
    assert victim.read_bytes() == b"not a png"  # nothing rewritten


@pytest.mark.parametrize(
    "norm, timeline",
    [("mabn", (2, 100, "first")), pytest.param("mabn-det", (100, 1001, "one"), marks=pytest.mark.slow)],
    ids=["imagenet-timeline", "detection-timeline"],
)
@pytest.mark.parametrize("demo", default_suite_runs([False, True], keep=[False], ids=["recipe", "demo"]))
def test_stage1_mabn_timelines(norm, timeline, demo, tiny_imagenet, tmp_path, monkeypatch):
    """NORM=mabn runs the official ImageNet code's timeline with label smoothing 0.1; NORM=mabn-det the detection
    code's (the demo: shortened), in folders of its own."""
    monkeypatch.chdir(tmp_path)
    data = None if demo else tiny_imagenet
    args = launch.build_args("pretrain", data, norm, 0, 1, ["--data.init_args.data_dir", str(tiny_imagenet)])
    assert f"--trainer.default_root_dir {'runs/demo' if demo else 'runs'}/pretrain/{norm}" in " ".join(args)
    model = cli.run_cli(args[1:], run=False).model  # without the subcommand: build, do not run
    (rule,) = NormPolicy.parse(model.hparams.norm_policy).groups.values()
    moving, renorm, ema_start = timeline
    if demo and norm == "mabn-det":
        moving, renorm = 20, 101
    assert (rule.moving_stats_first_step, rule.renorm_first_step) == (moving, renorm)
    layers = [m for m in model.modules() if isinstance(m, MABN2d)]
    assert layers and all(m.ema_start == ema_start and m.norm_batch_size == 2 for m in layers)
    assert model.hparams.label_smoothing == 0.1
    if norm == "mabn-det":  # stage 2 starts from its backbone as NORM=mabn
        with pytest.raises(launch.LaunchError, match="NORM=mabn with BACKBONE=pretrain/mabn-det/resnet101-mabn.pt"):
            launch.build_args("cityscapes", None, norm, 0, 1, [])


def test_top1_and_top5_are_the_shares_of_samples_with_their_label_among_the_best_logits():
    """On unbalanced labels (class 0 frequent and mostly found, the rare classes missed), top-1 and top-5 are the
    share of samples whose label is among the 1 and 5 highest logits, over all batches seen: not the mean of the
    per-class shares, which weighs each rare class as much as the frequent one."""
    task = ClassificationTask(num_classes=8, norm="bn", arch=ARCH, export_dir=None)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for labels in ([0] * 9 + [1, 2, 3], [0] * 5 + [4, 5, 6, 7]):
        labels = torch.tensor(labels)
        logits = torch.randn(len(labels), 8, generator=gen)
        logits[labels == 0, 0] += 3.0  # the frequent class is mostly predicted right
        batches.append((logits, labels))
        task.train_top1(logits, labels)
        task.val_top1(logits, labels)
        task.val_top5(logits, labels)
    logits = torch.cat([b[0] for b in batches]).double()
    labels = torch.cat([b[1] for b in batches])
    ranks = (logits > logits.gather(1, labels[:, None])).sum(1)  # logits above the label's: its 0-based rank
    top1, top5 = (ranks < 1).double().mean(), (ranks < 5).double().mean()
    per_class = torch.stack([(ranks[labels == c] < 1).double().mean() for c in labels.unique()]).mean()
    assert abs(top1 - per_class) > 0.1  # the data tell the two averages apart
    assert task.train_top1.compute().item() == pytest.approx(top1.item(), abs=1e-6)
    assert task.val_top1.compute().item() == pytest.approx(top1.item(), abs=1e-6)
    assert task.val_top5.compute().item() == pytest.approx(top5.item(), abs=1e-6)
