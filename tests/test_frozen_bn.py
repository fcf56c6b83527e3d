"""frozenbn (detectron2's FrozenBatchNorm2d, BN's statistics and affine fixed) as a norm of the registry: the layer
against its formula in float64, BN's state carried into it, its folding, the heads built with a norm that trains,
stage 1's refusal, and ``cityscapes --norm frozenbn`` from BN weights through fit, test, predict and export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import mabn
from helpers.backbone_files import trained_like
from helpers.commands import run_mabn
from helpers.fits import TINY
from mabn.data.synthetic import segment as demo_segment
from mabn.errors import ConfigError
from mabn.inference import export
from mabn.inference.checkpoint import load_task
from mabn.models import build_segmentation_model
from mabn.models.backbone import adapt_statistics
from mabn.norm import FrozenBatchNorm2d, GhostBatchNorm2d, convert_norm, create_norm, fold_norms
from mabn.run import RunShape
from mabn.tasks.classification import ClassificationTask
from mabn.tasks.segmentation import SegmentationTask


@pytest.mark.parametrize("train_affine", [False, True])
def test_the_layer_is_bn_with_fixed_statistics_in_training_and_eval(train_affine):
    generator = torch.Generator().manual_seed(0)
    layer = FrozenBatchNorm2d(3, eps=1e-3, train_affine=train_affine).double()
    mean, var = torch.randn(3, generator=generator, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.2
    gamma, beta = torch.rand(3, dtype=torch.float64) + 0.5, torch.randn(3, dtype=torch.float64)
    with torch.no_grad():
        layer.running_mean.copy_(mean), layer.running_var.copy_(var), layer.weight.copy_(gamma), layer.bias.copy_(beta)
    x = torch.randn(2, 3, 4, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    v = lambda t: t.view(1, 3, 1, 1)  # noqa: E731
    expected = v(gamma) * (x - v(mean)) / (v(var) + 1e-3).sqrt() + v(beta)
    for mode in (True, False):
        torch.testing.assert_close(layer.train(mode)(x), expected, rtol=1e-14, atol=1e-14)
    layer.train()
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, v(gamma / (var + 1e-3).sqrt()).expand_as(x), rtol=1e-14, atol=1e-14)
    assert torch.equal(layer.running_mean, mean) and torch.equal(layer.running_var, var)  # nothing taken from x
    trained = {name for name, p in layer.named_parameters() if p.grad is not None}
    assert trained == ({"weight", "bias"} if train_affine else set())
    assert set(layer.state_dict()) == {"weight", "bias", "running_mean", "running_var"}


def test_convert_norm_carries_bn_into_it_and_fold_norms_folds_it():
    torch.manual_seed(0)
    model = trained_like(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU())).eval()
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        reference = model(x)
        frozen = convert_norm(model, "frozenbn").train()  # training mode: still BN's eval function
        torch.testing.assert_close(frozen(x), reference, rtol=1e-6, atol=1e-6)
        folded = fold_norms(frozen)
        assert not any(isinstance(m, FrozenBatchNorm2d) for m in folded.modules())
        torch.testing.assert_close(folded(x), reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="frozenbn keeps BN's statistics fixed; momentum does not apply"):
        create_norm("frozenbn", 4, momentum=0.9)


def test_a_bn_backbones_state_loads_into_it_as_bns_function():
    """A BN network's state dict for a frozenbn encoder (``adapt_statistics``, the backbone hand-off): its affine,
    which frozenbn keeps as buffers, and its statistics both carry, so the frozen encoder is BN's eval function."""
    torch.manual_seed(0)
    model = trained_like(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU())).eval()
    encoder = convert_norm(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU()), "frozenbn")
    encoder.load_state_dict(adapt_statistics(model.state_dict(), encoder, eps=1e-5), strict=True)
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        torch.testing.assert_close(encoder(x), model(x), rtol=1e-6, atol=1e-6)


def test_the_encoder_is_frozen_and_the_heads_train_with_bn_or_head_norm():
    model = build_segmentation_model("pspnet", 5, "frozenbn", 2, None, "resnet18")
    encoder = [type(m) for m in model.encoder.modules() if "Norm" in type(m).__name__]
    heads = [m for m in model.heads().modules() if "Norm" in type(m).__name__]
    assert set(encoder) == {FrozenBatchNorm2d} and len(encoder) == 20
    assert heads and all(isinstance(m, GhostBatchNorm2d) and m.norm_batch_size == 2 for m in heads)
    model = build_segmentation_model("pspnet", 5, "frozenbn", 2, None, "resnet18", head_norm="gn")
    assert all(isinstance(m, nn.GroupNorm) for m in model.heads().modules() if "Norm" in type(m).__name__)
    with pytest.raises(ConfigError, match="head_norm='frozenbn': the heads start untrained"):
        SegmentationTask.check_hparams(
            {**SegmentationTask(norm="bn", arch="resnet18").hparams, "head_norm": "frozenbn"}
        )


def test_stage1_refuses_it():
    with pytest.raises(ConfigError, match="norm='frozenbn': its layers learn no statistics, so it cannot pre-train"):
        ClassificationTask(norm="frozenbn", arch="resnet18")


@pytest.fixture(scope="module")
def bn_file(tmp_path_factory) -> Path:
    """A torchvision ResNet-18 state dict with trained-like BN layers."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bn") / "resnet18-bn.pth"
    torch.save(trained_like(torchvision.models.resnet18()).state_dict(), path)
    return path


@pytest.mark.slow  # a stage-2 fit, test, predict and export (the default suite builds and folds the layers)
@pytest.mark.parametrize("stage", ["cityscapes", "segment"])
def test_frozenbn_fits_tests_predicts_and_exports(stage, bn_file, tiny_cityscapes, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "run"
    data = tiny_cityscapes if stage == "cityscapes" else demo_segment.generate(tmp_path / "mine", 4, 2, (40, 64))
    argv = [stage, "--data", str(data), "--norm", "frozenbn", "--backbone", str(bn_file)]
    code, out, err = run_mabn([*argv, "--dry-run", "--", *TINY], capsys)
    assert code == 0, err
    assert "norms: frozenbn in the encoder, bn in the decoder and heads (frozenbn trains nothing; head_norm picks " \
           "another)" in out.splitlines()  # fmt: skip
    code, out, err = run_mabn([*argv, "--run-dir", str(folder), "--", *TINY], capsys)
    assert code == 0, err
    ckpt = folder / "checkpoints" / "last.ckpt"
    restored = load_task(ckpt).task
    state = torch.load(bn_file, weights_only=True)
    layer = restored.model.encoder.layer3[1].bn2
    assert isinstance(layer, FrozenBatchNorm2d)  # two steps later, still the file's statistics and affine
    for key in ("weight", "bias", "running_mean", "running_var"):
        assert torch.equal(getattr(layer, key), state[f"layer3.1.bn2.{key}"]), key

    code, out, err = run_mabn(["test", str(ckpt), "--num-workers", "0"], capsys)
    assert code == 0 and "| **mean** |" in out, err
    code, out, err = run_mabn(["predict", str(ckpt), "--num-workers", "0"], capsys)
    assert code == 0, err
    assert list((folder / "predictions").rglob("*.png"))
    predicted = mabn.load(ckpt).predict(torch.rand(32, 48, 3).mul(255).to(torch.uint8).numpy())
    assert predicted.shape == (32, 48)
    result = export.export(ckpt, tmp_path / "export", (32, 64), formats=("torchscript",))
    assert result.folded.relative < 1e-10
    scripted = torch.jit.load(str(result.torchscript))
    assert not any("Norm" in name for name in str(scripted.inlined_graph).split())
    x = torch.randn(1, 3, 32, 64)
    with torch.no_grad():
        out, ref = scripted(x), restored.model(x)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-3


@pytest.mark.parametrize(
    ("head_norm", "batch_line"),
    [(None, ", normalization batches of 2 in the decoder and heads"), ("gn", "")],
)
def test_the_plan_says_which_norm_runs_where_and_where_batches_are_normalized(head_norm, batch_line):
    hp = {**SegmentationTask(norm="frozenbn", arch="resnet18", head_norm=head_norm).hparams}
    shape = RunShape(16, 1, 1, 2, 160, 10, 20)
    lines = SegmentationTask.run_plan(hp, shape).lines
    heads = head_norm or "bn"
    why = "head_norm" if head_norm else "frozenbn trains nothing; head_norm picks another"
    assert f"norms: frozenbn in the encoder, {heads} in the decoder and heads ({why})" in lines
    assert f"batch: 16 per device x 1 device(s) = global batch 16{batch_line}" in lines
