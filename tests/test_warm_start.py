"""The warm start of stage 1 (``mabn.models.warm_start``, beyond the paper): a MABN network seeded from a BN
network, held to the formulas of docs/backbones.md; ``python -m mabn pretrain --init`` as a user runs it; the
ablation's ``--warm-start`` mode."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from helpers.backbone_files import Backbones
from helpers.commands import run_mabn
from helpers.trainer import STAGE1_FIT
from mabn.callbacks.policy import NormPolicy
from mabn.cli import launch
from mabn.cli import lightning as cli
from mabn.inference.checkpoint import load_task
from mabn.models import load_backbone
from mabn.models.warm_start import check_init, seed_from_bn
from mabn.norm import CenConv2d, MABN2d, convert_norm
from mabn.tasks import ClassificationTask
from mabn.tools.ablation.model import SmallResNet

EPS = 1e-5
M = 4  # the MABN layers' buffer size in these tests


def _trained_bn(num_classes: int = 3) -> nn.Module:
    """A small BN network whose running statistics and affine are not their initial values (as after training)."""
    torch.manual_seed(0)
    model = SmallResNet(num_classes, widths=(4, 8), blocks=(1, 1))
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm2d):
            c = layer.num_features
            layer.weight.data = torch.rand(c) + 0.5
            layer.bias.data = torch.randn(c) * 0.1
            layer.running_mean = torch.randn(c) * 0.2
            layer.running_var = torch.rand(c) * 2 + 0.1
    return model


def _mabn_from(bn: nn.Module) -> nn.Module:
    """The same network with MABN(2) layers and centred convs, its own random weights, then seeded from ``bn``."""
    torch.manual_seed(1)
    mabn = convert_norm(SmallResNet(3, widths=(4, 8), blocks=(1, 1)), "mabn", norm_batch_size=2, buffer_size=M)
    assert seed_from_bn(mabn, bn.state_dict(), EPS) == []
    return mabn


def test_seeding_copies_centres_and_seeds_the_statistics() -> None:
    bn = _trained_bn()
    mabn = _mabn_from(bn)
    source = dict(bn.named_modules())
    norms = [(name, m) for name, m in mabn.named_modules() if isinstance(m, MABN2d)]
    assert len(norms) == 6  # stem, two per block, one downsample
    for name, layer in norms:
        old = source[name]
        assert torch.equal(layer.weight, old.weight) and torch.equal(layer.bias, old.bias)  # gamma, beta
        assert torch.allclose(layer.running_var, old.running_var)  # the EMA: BN's variance
        assert torch.allclose(layer.buffer_x2, old.running_var.expand(M, -1))  # every SMA slot
        assert int(layer.count_x2) == M  # the SMA counts as full
        # The backward's psi streams and the forward counter start empty.
        assert int(layer.count_gz) == 0 and not layer.buffer_gz.any() and int(layer.iters) == 0
    convs = [(name, m) for name, m in mabn.named_modules() if isinstance(m, CenConv2d)]
    assert len(convs) == 6
    for name, conv in convs:
        w = source[name].weight
        assert torch.allclose(conv.weight, w - w.mean(dim=(1, 2, 3), keepdim=True))  # each filter minus its mean
        assert conv.weight.sum(dim=(1, 2, 3)).abs().max() < 1e-5
    assert torch.equal(mabn.fc.weight, bn.fc.weight) and torch.equal(mabn.fc.bias, bn.fc.bias)


def test_first_training_forward_uses_the_seeded_statistics() -> None:
    """With moving statistics from the first forward (the warm timeline), group g of the first batch is normalized
    by the SMA of the m - 1 - g seeded slots and its own and the earlier groups' chi^2; the EMA moves from BN's
    variance."""
    bn = _trained_bn()
    mabn = _mabn_from(bn)
    layer = mabn.bn1
    layer.warmup_iters = 1  # moving statistics from forward 1, r = 1 (renorm_warmup_iters keeps its default)
    seen = {}
    # Copies: the ReLU after the layer works in place.
    layer.register_forward_hook(lambda _m, a, out: seen.update(x=a[0].detach().clone(), out=out.detach().clone()))
    mabn.train()
    torch.manual_seed(2)
    mabn(torch.randn(4, 3, 8, 8))

    x, var = seen["x"].double(), bn.bn1.running_var.double()
    chi2 = x.square().mean(dim=(2, 3)).view(2, 2, -1).mean(1)  # (G, C): groups of 2 samples
    sma = torch.stack([((M - 1) * var + chi2[0]) / M, ((M - 2) * var + chi2[0] + chi2[1]) / M])
    w, b = layer.weight.detach().double().view(1, -1, 1, 1), layer.bias.detach().double().view(1, -1, 1, 1)
    expected = w * x / (sma.repeat_interleave(2, 0)[:, :, None, None] + EPS).sqrt() + b
    assert torch.allclose(seen["out"].double(), expected, atol=1e-5)
    ema = layer.momentum * var + (1 - layer.momentum) * sma.mean(0)
    assert torch.allclose(layer.running_var.double(), ema, atol=1e-6)


def test_eval_output_after_seeding_is_bn_without_its_mean() -> None:
    """In eval mode a seeded layer computes gamma * x / sqrt(var + eps) + beta: BN's map less its mean, which the
    centred convs are there to keep near 0."""
    bn = _trained_bn()
    mabn = _mabn_from(bn).eval()
    x = torch.randn(2, 4, 5, 5)
    old = bn.bn1
    expected = old.weight.view(1, -1, 1, 1) * x / (old.running_var.view(1, -1, 1, 1) + EPS).sqrt()
    assert torch.allclose(mabn.bn1(x), expected + old.bias.view(1, -1, 1, 1), atol=1e-6)


def test_ghost_batch_bn_statistics_come_from_running_std() -> None:
    """A stage-1 bn file at normalization batch 2 keeps running_std = sqrt(var + eps): the seed is std^2 - eps."""
    bn = _trained_bn()
    ghost = convert_norm(copy.deepcopy(bn), "bn", norm_batch_size=2)
    state = dict(ghost.state_dict())
    state["bn1.running_std"] = (bn.bn1.running_var + EPS).sqrt()
    mabn = _mabn_from(bn)
    seed_from_bn(mabn, state, EPS)
    assert torch.allclose(mabn.bn1.running_var, bn.bn1.running_var, atol=1e-6)


def _torchvision_file(folder: Path, arch: str = "resnet18") -> Path:
    """torchvision's ``arch`` state dict (random weights, never downloaded), as a user saves it."""
    torch.manual_seed(0)
    path = folder / f"{arch}-imagenet.pth"
    torch.save(getattr(torchvision.models, arch)(weights=None).state_dict(), path)
    return path


def test_task_starts_from_a_torchvision_file(tmp_path: Path) -> None:
    path = _torchvision_file(tmp_path)
    source = torch.load(path, weights_only=True)
    task = ClassificationTask(num_classes=1000, norm="mabn", arch="resnet18", warm_start=str(path))
    layer, conv = task.model.layer1[0].bn1, task.model.layer1[0].conv1
    assert isinstance(layer, MABN2d) and isinstance(conv, CenConv2d)
    assert torch.allclose(layer.running_var, source["layer1.0.bn1.running_var"])
    w = source["layer1.0.conv1.weight"]
    assert torch.allclose(conv.weight, w - w.mean(dim=(1, 2, 3), keepdim=True))
    assert torch.equal(task.model.fc.weight, source["fc.weight"])  # torchvision's classifier fits 1000 classes
    other = ClassificationTask(num_classes=10, norm="mabn", arch="resnet18", warm_start=str(path))
    assert other.model.fc.weight.shape == (10, 512)  # another classifier: random, and said so


def test_checkpoint_rebuilds_without_the_warm_start_file(tmp_path: Path) -> None:
    """A checkpoint holds the trained weights: export, test and predict do not read the file it started from."""
    path = _torchvision_file(tmp_path)
    task = ClassificationTask(num_classes=10, norm="mabn", arch="resnet18", warm_start=str(path))
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams)}, ckpt)
    path.unlink()
    restored = load_task(ckpt)
    assert restored.name == "ClassificationTask" and restored.task.hparams.warm_start is None
    assert torch.equal(restored.task.model.layer1[0].bn1.running_var, task.model.layer1[0].bn1.running_var)


@pytest.mark.slow  # a stage-1 fit and its export
def test_warm_started_fit_runs_its_timeline_and_exports_apart(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-step stage-1 fit from a torchvision ResNet-18 file: the warm config's timeline and epochs, the seeded
    layers, and the backbone written to pretrain/warm/, not over the backbone from scratch."""
    monkeypatch.chdir(tmp_path)
    init = _torchvision_file(tmp_path)
    extra = ["--model.init_args.arch", "resnet18"]
    args = launch.build_args("pretrain", tiny_imagenet, "mabn", 0, 1, extra, init=init)
    assert "--trainer.default_root_dir runs/pretrain/mabn-warm" in " ".join(args)
    built = cli.run_cli(args[1:], run=False)  # without the subcommand: build, do not run
    (rule,) = NormPolicy.parse(built.model.hparams.norm_policy).groups.values()
    assert (rule.moving_stats_first_step, rule.renorm_first_step) == (1, 100)
    assert built.trainer.max_epochs == 30 and list(built.model.hparams.milestones) == [7.5, 15, 22.5]
    layer = built.model.model.layer1[0].bn1
    assert layer.ema_start == "one" and int(layer.count_x2) == layer.buffer_size
    source = torch.load(init, weights_only=True)
    assert torch.allclose(layer.running_var, source["layer1.0.bn1.running_var"])

    cli.run_cli(args + STAGE1_FIT)
    payload = load_backbone(tmp_path / "pretrain" / "warm" / "resnet18-mabn.pt", "mabn")
    assert payload["config"]["model"]["warm_start"] == str(init) and payload["config"]["steps"] == 2
    assert not (tmp_path / "pretrain" / "resnet18-mabn.pt").exists()


def test_pretrain_init_dry_run_accepts_bn_networks(
    tmp_path: Path, backbones: Backbones, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for init in (backbones.torchvision(), backbones.stage1("bn", norm_batch_size=None), backbones.stage1("bn")):
        code, out, err = run_mabn(["pretrain", "--norm", "mabn", "--init", str(init), "--dry-run"], capsys)
        assert code == 0, err
        assert f"--model.init_args.warm_start {init}" in out
        assert "pretrain-warm.yaml" in out and "--trainer.default_root_dir runs/demo/pretrain/mabn-warm" in out
        assert "--model.init_args.export_dir pretrain/demo/warm" in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_pretrain_init_refusals_are_one_line(
    tmp_path: Path, backbones: Backbones, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    torchvision_file = backbones.torchvision()
    not_bn = tmp_path / "weights.pt"
    torch.save({"layer.weight": torch.ones(2)}, not_bn)
    cases = [
        (["--norm", "mabn", "--init", "missing.pth"], "error: INIT=missing.pth: no such file"),
        (["--norm", "mabn", "--init", str(not_bn)], f"error: {not_bn} is neither a mabn-backbone file"),
        (["--norm", "mabn", "--init", str(backbones.stage1("gn"))], "is a stage-1 file of norm 'gn': a warm start"),
        (["--norm", "bn", "--init", str(torchvision_file)], f"error: --init {torchvision_file}: a warm start centres"),
        (["--norm", "mabn_nowc", "--init", str(torchvision_file)], "not 'mabn_nowc'"),
        (["--norm", "bn32", "--init", str(torchvision_file)], "with NORM=bn32: a warm start runs its own timeline"),
        (
            ["--norm", "mabn", "--init", str(torchvision_file), "--", "--model.init_args.arch", "resnet18"],
            "with 3 blocks in layer1, ResNet-18 has 2",
        ),
    ]
    for args, line in cases:
        code, out, err = run_mabn(["pretrain", "--dry-run", *args], capsys)
        assert code == 2, (args, out, err)
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and line in err, (args, err)
    code, _, err = run_mabn(["cityscapes", "--norm", "mabn", "--init", str(torchvision_file), "--dry-run"], capsys)
    assert code == 2 and "a warm start is stage 1's" in err
    assert check_init(torchvision_file, "mbn").source == "torchvision"  # every centring MABN preset takes one


def test_ablation_warm_start_dry_run_and_refusals(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["ablation", "--data", str(tiny_imagenet), "--seeds", "2", "--steps", "8", "--out", str(tmp_path / "o")]
    code, out, _ = run_mabn([*args, "--warm-start", "--dry-run"], capsys)
    assert code == 0
    assert "runs: 6 rows x 2 seeds = 12 runs of 8, 8, 0, 60, 150, 300 (in row order) steps" in out
    assert "MABN(2) warm start, 60 steps (mabn2-warm60: mabn)" in out
    assert f"writes {tmp_path / 'o' / 'ablation.md'}" in out and "fig2" not in out
    code, _, err = run_mabn([*args, "--warm-start", "2,3", "--rows", "bn32", "--dry-run"], capsys)
    assert code == 2 and err.startswith("error: --warm-start trains its own rows (BN(32), MABN(2) and the warm st")
    code, _, err = run_mabn([*args, "--warm-start", "60,x", "--dry-run"], capsys)
    assert code == 2 and "step counts >= 0" in err


@pytest.mark.slow  # an ablation of two fits
def test_ablation_warm_start_runs(tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """BN(32), MABN(2) and two warm starts (0 and 2 steps), two seeds: the table against MABN(2) from scratch."""
    out = tmp_path / "warm"
    args = ["ablation", "--data", str(tiny_imagenet), "--seeds", "2", "--steps", "4", "--image-size", "16"]
    code, printed, err = run_mabn([*args, "--warm-start", "0,2", "--workers", "1", "--out", str(out)], capsys)
    assert code == 0, err
    table = (out / "ablation.md").read_text()
    assert table.startswith("# MABN warm start at small scale (beyond the paper)")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")] for line in table.splitlines()[6:]}
    assert rows["MABN(2) warm start, 2 steps"][2:5] == ["BN(32) after 4 steps", "2", "6"]
    assert rows["MABN(2) warm start, 0 steps"][3:5] == ["0", "4"]  # the seeded network as it starts
    assert rows["MABN(2)"][2:5] == ["random", "4", "4"] and rows["MABN(2)"][7] == "–"
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert sorted({(r["row"], len(r["losses"])) for r in runs}) == [
        ("bn32", 4), ("mabn2", 4), ("mabn2-warm0", 0), ("mabn2-warm2", 2)
    ]  # fmt: skip
    assert all("state" not in r for r in runs)
