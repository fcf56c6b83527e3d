"""Stage 2's start from BN weights (docs/backbones.md, "A MABN encoder from BN weights"): a torchvision or timm ResNet
state dict, or a stage-1 bn file, converted for a MABN encoder as stage 1's warm start converts it; held to the
formulas in float64, a 2-step ``segment`` fit from such a file, the dry runs' line, the refusals; and the ablation's
``--segment-start`` comparison (docs/ablation/segment-start.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import segmentation_models_pytorch as smp
import timm
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from helpers.backbone_files import Backbones
from helpers.commands import run_mabn
from helpers.trainer import STAGE2_FIT
from mabn.data.synthetic import segment as demo_segment
from mabn.models import load_backbone_into, norm_kwargs_for
from mabn.models.backbone import CONVERTED, check_backbone
from mabn.norm import CenConv2d, MABN2d, convert_norm
from mabn.tools.ablation import segment
from mabn.tools.ablation.model import SmallResNet

EPS = 1e-5
RESNET18 = ["--model.init_args.arch", "resnet18", "--model.init_args.log_predictions_every_n_epochs", "0"]
# The BN layer each conv of a torchvision ResNet feeds.
NORM_OF = {"conv1": "bn1", "conv2": "bn2", "conv3": "bn3"}


def _trained_like(model: nn.Module) -> nn.Module:
    """``model`` with BN statistics and affine away from their initial values, as after training."""
    generator = torch.Generator().manual_seed(3)
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm2d):
            c = layer.num_features
            layer.weight.data = torch.rand(c, generator=generator) + 0.5
            layer.bias.data = torch.randn(c, generator=generator) * 0.1
            layer.running_mean = torch.randn(c, generator=generator) * 0.2
            layer.running_var = torch.rand(c, generator=generator) * 2 + 0.1
    return model


@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory) -> Path:
    """torchvision's ResNet-18 state dict (random weights, never downloaded) with trained-like BN layers."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bn") / "resnet18-imagenet.pth"
    torch.save(_trained_like(torchvision.models.resnet18()).state_dict(), path)
    return path


def _mabn_encoder(arch: str = "resnet18") -> nn.Module:
    """Stage 2's MABN(2) encoder (smp's dilated ResNet at output stride 8)."""
    encoder = smp.encoders.get_encoder(arch, weights=None, output_stride=8)
    return convert_norm(encoder, "mabn", **norm_kwargs_for("mabn", 2))


def _norm_name(conv: str) -> str:
    if conv.endswith("downsample.0"):
        return conv.removesuffix("0") + "1"
    head, _, tail = conv.rpartition(".")
    return f"{head}.{NORM_OF[tail]}" if head else NORM_OF[tail]


def test_converted_encoder_is_the_bn_network_up_to_each_channels_mean_in_float64(resnet18_file, tmp_path):
    """Every conv computes the BN network's conv minus m_o x (the window's sum of the input), m_o the mean of filter
    o; its MABN layer holds BN's running variance (EMA and every SMA slot) and affine, so that in eval mode
    conv + norm = gamma (conv_BN(x) - m_o sum(x)) / sqrt(var + eps) + beta where BN has (conv_BN(x) - mu)."""
    path = tmp_path / "resnet18-float64.pth"  # the conversion in float64, from a file in float64
    state = {k: v.double() if v.is_floating_point() else v for k, v in torch.load(resnet18_file).items()}
    torch.save(state, path)
    encoder = _mabn_encoder().double()
    info = load_backbone_into(encoder, path, "mabn", "resnet18")
    assert info["converted"] and info["conversion"].endswith(CONVERTED)
    encoder.eval()
    convs = {name: m for name, m in encoder.named_modules() if isinstance(m, CenConv2d)}
    assert len(convs) == 20  # stem, 2 per block x 8, 3 downsamples
    generator = torch.Generator().manual_seed(4)
    for name, conv in convs.items():
        w = state[f"{name}.weight"]
        x = torch.randn(2, w.shape[1], 11, 11, generator=generator, dtype=torch.float64)
        geometry = {"stride": conv.stride, "padding": conv.padding, "dilation": conv.dilation}
        window_sum = F.conv2d(x, torch.ones(1, *w.shape[1:], dtype=torch.float64), **geometry)
        filter_mean = w.mean(dim=(1, 2, 3)).view(1, -1, 1, 1)
        expected_conv = F.conv2d(x, w, **geometry) - filter_mean * window_sum
        out = conv(x)
        torch.testing.assert_close(out, expected_conv, rtol=1e-10, atol=1e-10, msg=name)

        bn = _norm_name(name)
        layer = encoder.get_submodule(bn)
        assert isinstance(layer, MABN2d)
        var = state[f"{bn}.running_var"]
        assert torch.equal(layer.running_var, var) and torch.equal(layer.buffer_x2, var.expand(layer.buffer_size, -1))
        assert int(layer.count_x2) == layer.buffer_size  # the SMA counts as full of the seed
        gamma, beta = state[f"{bn}.weight"].view(1, -1, 1, 1), state[f"{bn}.bias"].view(1, -1, 1, 1)
        expected = gamma * expected_conv / (var.view(1, -1, 1, 1) + EPS).sqrt() + beta
        torch.testing.assert_close(layer(out), expected, rtol=1e-10, atol=1e-10, msg=bn)


@pytest.mark.slow  # builds timm's ResNets
def test_timm_resnet_state_dicts_read_as_torchvision_ones(tmp_path):
    """timm's resnet18/50/101 have torchvision's keys and shapes: their state dicts convert as torchvision's."""
    for arch in ("resnet50", "resnet101"):
        with torch.device("meta"):
            model = timm.create_model(arch, pretrained=False)
        path = tmp_path / f"timm-{arch}.pth"  # every key and shape, a few hundred kB (zero-strided tensors)
        torch.save({k: torch.zeros((), dtype=v.dtype).expand(v.shape) for k, v in model.state_dict().items()}, path)
        backbone = check_backbone(path, "mabn", arch)
        assert backbone.source == "torchvision" and backbone.norm == "bn"
    torch.manual_seed(0)
    path = tmp_path / "timm-resnet18.pth"
    torch.save(_trained_like(timm.create_model("resnet18", pretrained=False)).state_dict(), path)
    encoder = _mabn_encoder()
    assert load_backbone_into(encoder, path, "mabn", "resnet18")["converted"]
    source = torch.load(path, weights_only=True)
    torch.testing.assert_close(encoder.layer4[1].bn2.running_var, source["layer4.1.bn2.running_var"])


def test_stage1_bn_files_convert_and_mabn_files_load_as_they_are(backbones: Backbones):
    for norm_batch_size in (None, 2):  # bn32 (running_var) and bn at batch 2 (running_std)
        path = backbones.stage1("bn", "resnet18", norm_batch_size)
        assert load_backbone_into(_mabn_encoder(), path, "mabn", "resnet18")["converted"]
    own = backbones.stage1("mabn", "resnet18")
    assert not load_backbone_into(_mabn_encoder(), own, "mabn", "resnet18")["converted"]


def _data(tmp_path: Path) -> Path:
    return demo_segment.generate(tmp_path / "my-data", n_train=4, n_val=2, size=(40, 64), seed=5)


@pytest.mark.slow  # a stage-2 fit
def test_segment_fits_two_steps_from_converted_bn_weights(resnet18_file, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.chdir(tmp_path)
    data, folder = _data(tmp_path), tmp_path / "run"
    argv = ["segment", "--data", str(data), "--norm", "mabn", "--backbone", str(resnet18_file)]
    line = f"backbone: {resnet18_file} (torchvision ResNet-18 state dict (BN)), {CONVERTED}"
    code, out, err = run_mabn([*argv, "--dry-run", "--", *RESNET18, *STAGE2_FIT], capsys)
    assert code == 0, err
    assert out.splitlines().count(line) == 1

    with caplog.at_level(logging.INFO):
        code, out, err = run_mabn([*argv, "--run-dir", str(folder), "--", *RESNET18, *STAGE2_FIT], capsys)
    assert code == 0, err
    said = (out + err + caplog.text).splitlines()
    assert sum(CONVERTED in text for text in said) == 1 and any(text.endswith(line) for text in said)
    assert not any("Encoder loaded from" in text for text in said)
    checkpoint = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert checkpoint["global_step"] == 2 and checkpoint["hyper_parameters"]["norm"] == "mabn"
    trained = checkpoint["state_dict"]["model.encoder.conv1.weight"]
    w = torch.load(resnet18_file, weights_only=True)["conv1.weight"]
    means = w.mean(dim=(1, 2, 3), keepdim=True)
    # The fit started from the centred filters: two steps at a warm-up lr moved them by far less than the filters'
    # means the conversion removed, and kept them centred.
    moved = (trained - (w - means)).abs().max()
    assert moved < 0.1 * means.abs().max() and trained.mean(dim=(1, 2, 3)).abs().max() < 1e-6, moved


def test_cityscapes_dry_run_says_the_conversion(tiny_cityscapes, backbones, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = backbones.torchvision()  # ResNet-101, the recipe's
    argv = ["cityscapes", "--data", str(tiny_cityscapes), "--norm", "mabn", "--backbone", str(path), "--dry-run"]
    code, out, err = run_mabn(argv, capsys)
    assert code == 0, err
    assert f"backbone: {path} (torchvision ResNet-101 state dict (BN)), {CONVERTED}" in out.splitlines()


def test_refusals_are_one_line_each(backbones, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = _data(tmp_path)
    vgg = tmp_path / "vgg11.pth"
    torch.save({"features.0.weight": torch.zeros(64, 3, 3, 3), "classifier.6.weight": torch.zeros(10, 4096)}, vgg)
    deeper = backbones.torchvision("resnet34")
    cases = [
        (vgg, f"error: {vgg} is neither a mabn-backbone file (pretrain/README.md) nor a torchvision or timm ResNet "),
        (deeper, f"error: {deeper} is a torchvision ResNet state dict with 3 blocks in layer1, ResNet-18 has 2: save "),
    ]
    for path, message in cases:
        argv = ["segment", "--data", str(data), "--norm", "mabn", "--backbone", str(path), "--dry-run", "--", *RESNET18]
        code, _, err = run_mabn(argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(message), err


def test_missing_backbone_names_the_bn_routes(tiny_cityscapes, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no pretrain/ here
    code, _, err = run_mabn(["cityscapes", "--data", str(tiny_cityscapes), "--dry-run"], capsys)
    (error,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert (
        "start from BN weights (BACKBONE=<a torchvision or timm ResNet state dict, or a stage-1 bn file>: converted "
        "to mabn; or NORM=bn with them as they are)" in error
    )


# --- the ablation's --segment-start ------------------------------------------------------------------------------


def _bn_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return _trained_like(SmallResNet(10)).state_dict()


def test_fine_tunes_start_as_stage2_starts_and_share_their_heads():
    bn = _bn_state()
    models = {row.key: segment.initial_model(row, 7, 20, bn) for row in segment.SEGMENT_ROWS}
    converted, as_is, random = (models[k] for k in ("mabn2-from-bn", "bn32-from-bn", "mabn2-random"))
    w = bn["layer2.0.conv1.weight"]
    assert torch.equal(converted.encoder.layer2[0].conv1.weight, w - w.mean(dim=(1, 2, 3), keepdim=True))
    layer = converted.encoder.layer2[0].bn1
    assert torch.equal(layer.running_var, bn["layer2.0.bn1.running_var"]) and torch.equal(
        layer.weight, bn["layer2.0.bn1.weight"]
    )
    assert int(layer.count_x2) == 0 and not layer.buffer_x2.any()  # streams reset as stage 2's policy does
    for key, value in as_is.encoder.state_dict().items():
        assert torch.equal(value, bn[key]), key
    assert not torch.equal(random.encoder.conv1.weight, converted.encoder.conv1.weight)
    # Paired: one seed, one head start, whatever the norm (centring changes what a conv computes, not its weight).
    heads = [m.head[-1].weight for m in models.values()]
    assert all(torch.equal(h, heads[0]) for h in heads)


def test_segment_set_labels_the_shapes():
    images, labels = segment.segment_set("val", 16)  # rendered at the classification set's 36 px, resized
    assert images.shape == (segment.VAL_IMAGES, 3, 16, 16) and labels.shape == (segment.VAL_IMAGES, 16, 16)
    assert set(labels.unique().tolist()) == set(range(segment.NUM_CLASSES))
    for i in range(10):  # each image holds the background and its one shape, the classes in turn
        assert set(labels[i].unique().tolist()) == {segment.BACKGROUND, i + 1}


def test_ablation_segment_start_dry_run_and_refusals(tiny_imagenet, tmp_path, capsys):
    args = ["ablation", "--data", str(tiny_imagenet), "--seeds", "2", "--steps", "8", "--out", str(tmp_path / "o")]
    code, out, _ = run_mabn([*args, "--segment-start", "--dry-run"], capsys)
    assert code == 0
    assert "pre-training: BN(32) (bn32) x 2 seeds = 2 runs of 8 steps" in out
    assert "x 2 seeds = 6 runs of 150 steps on the generated segmentation set" in out
    assert f"writes {tmp_path / 'o' / 'ablation.md'}" in out and not (tmp_path / "o").exists()
    code, _, err = run_mabn([*args, "--segment-start", "5", "--warm-start", "--dry-run"], capsys)
    assert code == 2 and err.startswith("error: --segment-start trains its own rows")


@pytest.mark.slow  # an ablation of three fits
def test_ablation_segment_start_runs(tiny_imagenet, tmp_path, monkeypatch, capsys):
    """Two BN(32) runs of 4 steps, then each fine-tune for 2 steps on a small segmentation set: the table against
    the converted start, every run in the results."""
    monkeypatch.setattr(segment, "TRAIN_IMAGES", 64)
    monkeypatch.setattr(segment, "VAL_IMAGES", 20)
    segment.segment_set.cache_clear()
    out = tmp_path / "seg"
    args = ["ablation", "--data", str(tiny_imagenet), "--seeds", "2", "--steps", "4", "--image-size", "16"]
    try:
        code, _, err = run_mabn([*args, "--segment-start", "2", "--workers", "1", "--out", str(out)], capsys)
    finally:
        segment.segment_set.cache_clear()
    assert code == 0, err
    table = (out / "ablation.md").read_text()
    assert table.startswith("# Stage 2's start from BN weights at small scale (beyond the paper)")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")] for line in table.splitlines()[8:]}
    assert rows["MABN(2), converted from BN(32)"][2:4] == ["BN(32)'s weights, converted", "2"]
    assert rows["MABN(2), converted from BN(32)"][6] == "–"  # the reference
    assert rows["MABN(2), random"][2] == "random weights"
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert sorted({(r["row"], len(r["losses"])) for r in runs}) == [
        ("bn32", 4), ("bn32-from-bn", 2), ("mabn2-from-bn", 2), ("mabn2-random", 2)
    ]  # fmt: skip
    assert all(0 <= r["val_error"] <= 100 for r in runs)
