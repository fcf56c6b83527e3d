"""Stage 2 on encoders besides ResNet: one of each family smp offers (its own, and timm's through ``tu-``), with
MABN's centred convs, grouped and depthwise ones included, exact folding, ``convert_norm``'s report and warnings,
and a short CLI fit."""

from __future__ import annotations

import logging

import pytest
import torch
from segmentation_models_pytorch.decoders.upernet.decoder import LayerNorm2d
from timm.layers import LayerNorm2d as TimmLayerNorm2d
from torch import nn

from helpers.commands import run_mabn
from helpers.folding import randomize_affine
from helpers.marks import default_suite_runs
from helpers.trainer import STAGE2_FIT
from mabn.models import build_segmentation_model, logged_norms, resnet
from mabn.models.backbone import BackboneError, check_backbone
from mabn.norm import CenConv2d, MABN2d, convert_norm, fold_norms
from mabn.norm.convert import NormAct, _conv_norm_pairs
from mabn.tools.bench.infer import calibrate

# One per family: ResNeXt (grouped convs), RegNet and EfficientNet and MobileNetV3 from timm (grouped / depthwise
# convs, timm's fused BatchNormAct2d), MobileNetV2 (torchvision's depthwise blocks), a timm ResNet.
FAMILIES = ("resnext50_32x4d", "tu-regnetx_002", "tu-efficientnet_b0", "mobilenet_v2", "tu-resnet18")
NORM_TYPES = (nn.BatchNorm2d, MABN2d)


def _build(arch: str, norm: str) -> nn.Module:
    return build_segmentation_model("pspnet", 5, norm, 2, arch=arch)


def _train_step(model: nn.Module) -> None:
    """One training forward and backward of a batch of 4 at 64x64: finite logits at input size and gradients."""
    model.train()
    x = torch.randn(4, 3, 64, 64)
    out, aux = model(x)
    assert out.shape == aux.shape == (4, 5, 64, 64)
    (out.square().mean() + 0.4 * aux.square().mean()).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def _assert_folds_exactly(model: nn.Module) -> None:
    """Norms with trained-like gamma, beta and statistics fold into their convs: the same eval outputs in float64."""
    gen = torch.Generator().manual_seed(3)
    randomize_affine(model, NORM_TYPES, gen)
    model = model.double()
    calibrate(model, torch.randn(2, 3, 64, 64, generator=gen, dtype=torch.float64))
    folded = fold_norms(model)
    assert not any(isinstance(m, (*NORM_TYPES, CenConv2d)) for m in folded.modules())
    x = torch.randn(2, 3, 64, 64, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model.eval()(x), rtol=1e-10, atol=1e-10)


# ResNeXt-50, the largest, in the slow suite: grouped convs are timm's RegNet's too.
@pytest.mark.parametrize("arch", default_suite_runs(FAMILIES, keep=["tu-regnetx_002"]))
def test_mabn_centres_every_conv_before_a_norm_trains_and_folds_exactly(arch):
    model = _build(arch, "mabn")
    assert not any(type(m) is nn.BatchNorm2d or type(m).__name__ == "BatchNormAct2d" for m in model.modules())
    pairs = [(getattr(p, c), getattr(h, n)) for p, c, h, n in _conv_norm_pairs(model)]
    assert pairs and all(isinstance(conv, CenConv2d) and isinstance(norm, MABN2d) for conv, norm in pairs)
    convs = [m for m in model.modules() if isinstance(m, CenConv2d)]
    if arch != "tu-resnet18":  # the others have grouped or depthwise convs, centred per filter as the rest
        assert any(c.groups > 1 for c in convs)
    for conv in convs:
        filters = conv.centred_weight().reshape(conv.out_channels, -1)  # (out, in/groups x kH x kW)
        assert filters.mean(1).abs().max() < 1e-6
    _train_step(model)
    # The raw weights' gradients are projected onto zero-mean filters too.
    assert all(c.weight.grad.reshape(c.out_channels, -1).mean(1).abs().max() < 1e-6 for c in convs)
    _assert_folds_exactly(model)


@pytest.mark.parametrize("arch", default_suite_runs(FAMILIES, keep=["tu-regnetx_002"]))
def test_bn_keeps_plain_convs_trains_and_folds_exactly(arch):
    model = _build(arch, "bn")
    assert not any(isinstance(m, CenConv2d) for m in model.modules())
    assert any(isinstance(m, NormAct) for m in model.modules()) == (arch.startswith("tu-") and arch != "tu-resnet18")
    _train_step(model)
    _assert_folds_exactly(model)


def test_timm_fused_norms_keep_their_activation():
    """timm's BatchNormAct2d normalizes, then activates: the converted NormAct does both, as the original did."""
    model = build_segmentation_model("pspnet", 5, "mabn", 2, arch="tu-regnetx_002")
    norm_act = next(m for m in model.modules() if isinstance(m, NormAct))
    assert isinstance(norm_act.norm, MABN2d) and isinstance(norm_act.act, nn.ReLU)


@pytest.mark.parametrize("groups", [4, 8])  # grouped and, with 8 of 8 channels, depthwise
def test_grouped_convs_are_centred_per_filter_and_fold_exactly(groups):
    conv = nn.Conv2d(8, 8, 3, padding=1, groups=groups, bias=False)
    model = convert_norm(nn.Sequential(conv, nn.BatchNorm2d(8)), "mabn", norm_batch_size=2).double()
    cen = model[0]
    assert isinstance(cen, CenConv2d)
    # Each output filter holds in_channels/groups x 3 x 3 weights: its own mean comes off, nothing else.
    w = conv.weight.detach().double()
    expected = w - w.reshape(8, -1).mean(1).view(8, 1, 1, 1)
    torch.testing.assert_close(cen.centred_weight(), expected, rtol=0, atol=1e-12)
    _train_step_small = model.train()(torch.randn(4, 8, 6, 6, dtype=torch.float64))
    _train_step_small.square().mean().backward()
    assert cen.weight.grad.reshape(8, -1).mean(1).abs().max() < 1e-12
    calibrate(model, torch.randn(4, 8, 6, 6, dtype=torch.float64))
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fold_norms(model)(x), model.eval()(x), rtol=1e-10, atol=1e-10)


def test_smp_efficientnet_same_padding_convs_stay_uncentred_with_a_warning_and_fold_exactly():
    """smp's own EfficientNet pads in its convs' forward: they keep it, unfolded and folded."""
    with pytest.warns(UserWarning, match=r"cannot be centred.*: encoder\._conv_stem \(Conv2dStaticSamePadding\)"):
        model = _build("efficientnet-b0", "mabn")
    assert any(isinstance(m, MABN2d) for m in model.modules())
    _assert_folds_exactly(model)


def test_a_one_weight_filter_is_not_centred_and_says_so():
    """A 1x1 depthwise conv's filters hold one weight each, which centring would zero."""
    model = nn.Sequential(nn.Conv2d(4, 4, 1, groups=4), nn.BatchNorm2d(4))
    with pytest.warns(UserWarning, match=r"cannot be centred.*: 0 \(Conv2d\)"):
        convert_norm(model, "mabn")
    assert type(model[0]) is nn.Conv2d and isinstance(model[1], MABN2d)


def test_convert_norm_logs_what_it_converted(caplog):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    with caplog.at_level(logging.INFO, logger="mabn.norm.convert"):
        convert_norm(model, "mabn")
    assert "convert_norm: 2 BatchNorm2d -> mabn, 2 conv(s) centred" in caplog.text


def test_convert_norm_warns_when_it_converts_nothing():
    with pytest.warns(UserWarning, match="converted nothing to mabn: Sequential has no BatchNorm2d"):
        convert_norm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), "mabn")


def test_a_norm_after_a_transposed_conv_is_converted_uncentred_with_a_warning_naming_it():
    up = nn.ConvTranspose2d(4, 4, 2, stride=2)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), up, nn.BatchNorm2d(4))
    with pytest.warns(UserWarning, match=r"1 norm\(s\) converted to mabn after a layer that cannot be centred.*"
                      r": 2 \(ConvTranspose2d\)$"):  # fmt: skip
        convert_norm(model, "mabn", norm_batch_size=2)
    assert isinstance(model[0], CenConv2d) and type(model[2]) is nn.ConvTranspose2d
    assert isinstance(model[1], MABN2d) and isinstance(model[3], MABN2d)
    model.double()
    calibrate(model, torch.randn(4, 3, 8, 8, dtype=torch.float64))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fold_norms(model)(x), model.eval()(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layer_norm_2d", [LayerNorm2d, TimmLayerNorm2d], ids=["smp", "timm"])
def test_layer_norms_are_converted_only_when_asked(layer_norm_2d):
    def model() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3), layer_norm_2d(4), nn.Flatten(), nn.LayerNorm(24))

    with pytest.warns(UserWarning, match=r"kept 1 LayerNorm2d, 1 LayerNorm \(layer_norms=True converts"):
        kept = convert_norm(model(), "mabn")
    assert isinstance(kept[1], layer_norm_2d) and type(kept[0]) is nn.Conv2d
    asked = convert_norm(model(), "mabn", layer_norms=True)
    # The channel LayerNorm2d becomes the norm (its conv centred); the LayerNorm over tokens cannot, and stays.
    assert isinstance(asked[1], MABN2d) and isinstance(asked[0], CenConv2d) and isinstance(asked[3], nn.LayerNorm)


def test_an_unknown_encoder_is_one_error_naming_it():
    with pytest.raises(ValueError, match=r"^unknown encoder arch 'resnet77': .* see docs/models.md, Encoders$"):
        build_segmentation_model("unet", 5, "bn", arch="resnet77")
    with pytest.raises(ValueError, match=r"^unknown encoder arch 'tu-nothing'"):
        build_segmentation_model("pspnet", 5, "bn", arch="tu-nothing")


@pytest.mark.slow  # builds VGG-11 twice; test_an_unknown_encoder_is_one_error_naming_it refuses in the default suite
@pytest.mark.parametrize("arch", ["vgg11", "tu-vgg11"])
def test_an_encoder_smp_cannot_dilate_is_refused_in_one_line(arch):
    with pytest.raises(ValueError, match=rf"^encoder '{arch}' does not run at output stride 8 \(.*\): pick a decoder"):
        build_segmentation_model("pspnet", 5, "bn", arch=arch)
    assert build_segmentation_model("unet", 5, "bn", arch=arch)  # output stride 32: no dilation needed


def test_stage_one_stays_on_resnets():
    with pytest.raises(ValueError, match="unknown arch 'resnext50_32x4d'; choose one of resnet18"):
        resnet("bn", arch="resnext50_32x4d")


def test_a_backbone_file_starts_resnet_encoders_only(tmp_path):
    with pytest.raises(BackboneError, match=r"cannot start encoder 'resnext50_32x4d': backbone files hold ResNets"):
        check_backbone(tmp_path / "any.pt", "bn", "resnext50_32x4d")


def test_the_first_norm_of_an_encoder_without_layer1_is_logged():
    names = [n for n, m in _build("mobilenet_v2", "mabn").named_modules() if isinstance(m, MABN2d)]
    assert logged_norms(names) == ["encoder.features.0.1", "ppm.stages.0.1.1", "classifier.0.1", "aux.0.1"]


@pytest.mark.slow  # a stage-2 fit
def test_cli_fit_on_a_timm_encoder(tiny_cityscapes, tmp_path, capsys):
    arch = ("--model.init_args.arch", "tu-mobilenetv3_small_100", "--model.init_args.decoder", "unet")
    argv = ["cityscapes", "--data", str(tiny_cityscapes), "--backbone", "none", "--run-dir", str(tmp_path / "run")]
    code, _, err = run_mabn([*argv, "--", *STAGE2_FIT, *arch], capsys)
    assert code == 0, err
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["hyper_parameters"]["arch"] == "tu-mobilenetv3_small_100"
    assert any(k.endswith(".norm.running_var") for k in checkpoint["state_dict"])  # timm's norms, converted
