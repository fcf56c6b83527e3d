"""Stage 2's start from BN weights (docs/backbones.md, "A MABN encoder from BN weights"): a torchvision or timm ResNet
state dict, or a stage-1 bn file, converted for a MABN encoder so that it keeps BN's function; held to the BN
encoder and the formulas in float64, a 2-step ``segment`` fit from such a file, the dry runs' line, the refusals;
and the ablation's ``--segment-start`` comparison (docs/ablation/segment-start.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import segmentation_models_pytorch as smp
import timm
import torch
import torchvision
from torch import nn

from helpers.backbone_files import Backbones, trained_like
from helpers.commands import run_mabn
from helpers.trainer import STAGE2_FIT
from mabn.data.synthetic import segment as demo_segment
from mabn.errors import ConfigError
from mabn.inference.checkpoint import load_task
from mabn.models import load_backbone_into, norm_kwargs_for
from mabn.models.backbone import CONVERTED, BackboneError, check_backbone
from mabn.norm import CenConv2d, FrozenBatchNorm2d, MABN2d, convert_norm
from mabn.tasks.segmentation import SegmentationTask
from mabn.tools.ablation import segment
from mabn.tools.ablation.model import SmallResNet

EPS = 1e-5
RESNET18 = ["--model.init_args.arch", "resnet18", "--model.init_args.log_predictions_every_n_epochs", "0"]


@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory) -> Path:
    """torchvision's ResNet-18 state dict (random weights, never downloaded) with trained-like BN layers."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bn") / "resnet18-imagenet.pth"
    torch.save(trained_like(torchvision.models.resnet18()).state_dict(), path)
    return path


def _mabn_encoder(arch: str = "resnet18", centred: bool = False) -> nn.Module:
    """Stage 2's MABN(2) encoder (smp's dilated ResNet at output stride 8), its convs uncentred as a fit from BN
    weights builds it (``centred``: as from a stage-1 MABN file)."""
    encoder = smp.encoders.get_encoder(arch, weights=None, output_stride=8)
    return convert_norm(encoder, "mabn", centred, **norm_kwargs_for("mabn", 2))


@pytest.mark.parametrize("arch", ["resnet18", pytest.param("resnet101", marks=pytest.mark.slow)])
def test_converted_encoder_computes_the_bn_encoder_in_eval_in_float64(arch, tmp_path):
    """BN weights with BN statistics away from their start, converted for a MABN encoder: every feature map of the
    encoder in eval mode is the BN encoder's, in float64; each MABN layer holds BN's second moment var + mean^2 as
    its EMA and in every SMA slot, gamma sqrt(var + mean^2 + eps) / sqrt(var + eps) as its weight and
    beta - gamma mean / sqrt(var + eps) as its bias."""
    torch.manual_seed(0)
    state = trained_like(getattr(torchvision.models, arch)()).state_dict()
    state = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    path = tmp_path / f"{arch}-float64.pth"
    torch.save(state, path)
    encoder = _mabn_encoder(arch).double()
    reference = smp.encoders.get_encoder(arch, weights=None, output_stride=8).double()
    info = load_backbone_into(encoder, path, "mabn", arch)
    assert info["converted"] and info["conversion"].endswith(CONVERTED)
    assert not load_backbone_into(reference, path, "bn", arch)["converted"]
    assert not any(isinstance(m, CenConv2d) for m in encoder.modules())
    x = torch.randn(2, 3, 48, 48, dtype=torch.float64)
    with torch.no_grad():
        features = list(zip(encoder.eval()(x), reference.eval()(x), strict=True))
    for got, want in features[1:]:  # the first is the input itself
        assert ((got - want).norm() / want.norm()).item() <= 1e-10
    for name, layer in encoder.named_modules():
        if isinstance(layer, MABN2d):
            mean, var = state[f"{name}.running_mean"], state[f"{name}.running_var"]
            gamma, beta = state[f"{name}.weight"], state[f"{name}.bias"]
            second = var + mean**2
            torch.testing.assert_close(layer.running_var, second, rtol=1e-14, atol=0)
            assert torch.equal(layer.buffer_x2, layer.running_var.expand(layer.buffer_size, -1))
            assert int(layer.count_x2) == layer.buffer_size  # the SMA counts as full of the seed
            torch.testing.assert_close(layer.weight, gamma * (second + EPS).sqrt() / (var + EPS).sqrt())
            torch.testing.assert_close(layer.bias, beta - gamma * mean / (var + EPS).sqrt())


def test_a_centred_encoder_is_refused_and_the_stage1_mabn_route_stays_centred(resnet18_file, backbones, tmp_path):
    with pytest.raises(BackboneError, match="conv1 is a centred conv: BN's function needs the convs as BN trained"):
        load_backbone_into(_mabn_encoder(centred=True), resnet18_file, "mabn", "resnet18")
    own = backbones.stage1("mabn", "resnet18")
    task = SegmentationTask(norm="mabn", backbone=str(own), arch="resnet18", num_classes=5)
    assert task.hparams.centre_encoder is None
    assert sum(isinstance(m, CenConv2d) for m in task.model.encoder.modules()) == 20


def test_a_fit_records_the_uncentred_encoder_and_its_checkpoint_rebuilds_it(resnet18_file, tmp_path):
    task = SegmentationTask(norm="mabn", backbone=str(resnet18_file), arch="resnet18", num_classes=5)
    assert task.hparams.centre_encoder is False
    assert not any(isinstance(m, CenConv2d) for m in task.model.encoder.modules())
    assert any(isinstance(m, CenConv2d) for m in task.model.heads().modules())  # the heads centre as MABN does
    path = tmp_path / "run.ckpt"
    hparams = {**dict(task.hparams), "backbone": str(tmp_path / "gone.pth")}  # the backbone file is not read again
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": hparams, "pytorch-lightning_version": "2.6"}, path)
    restored = load_task(path).task
    assert not any(isinstance(m, CenConv2d) for m in restored.model.encoder.modules())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(restored.model.eval()(x), task.model.eval()(x))
    with pytest.raises(ConfigError, match="centre_encoder=True: BN weights .* keep BN's function only in uncentred"):
        SegmentationTask(norm="mabn", backbone=str(resnet18_file), arch="resnet18", centre_encoder=True)


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
    torch.save(trained_like(timm.create_model("resnet18", pretrained=False)).state_dict(), path)
    encoder = _mabn_encoder()
    assert load_backbone_into(encoder, path, "mabn", "resnet18")["converted"]
    source = torch.load(path, weights_only=True)
    second = source["layer4.1.bn2.running_var"] + source["layer4.1.bn2.running_mean"] ** 2
    torch.testing.assert_close(encoder.layer4[1].bn2.running_var, second)


def test_stage1_bn_files_convert_and_mabn_files_load_as_they_are(backbones: Backbones):
    for norm_batch_size in (None, 2):  # bn32 (running_var) and bn at batch 2 (running_std)
        path = backbones.stage1("bn", "resnet18", norm_batch_size)
        assert load_backbone_into(_mabn_encoder(), path, "mabn", "resnet18")["converted"]
    own = backbones.stage1("mabn", "resnet18")
    assert not load_backbone_into(_mabn_encoder(centred=True), own, "mabn", "resnet18")["converted"]


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
    assert checkpoint["hyper_parameters"]["centre_encoder"] is False
    trained = checkpoint["state_dict"]["model.encoder.conv1.weight"]
    w = torch.load(resnet18_file, weights_only=True)["conv1.weight"]
    means = w.mean(dim=(1, 2, 3), keepdim=True)
    # The fit started from BN's filters as they are: two steps at a warm-up lr moved them by far less than their
    # means, which stay (no centring).
    moved = (trained - w).abs().max()
    assert moved < 0.1 * means.abs().max(), moved
    torch.testing.assert_close(trained.mean(dim=(1, 2, 3), keepdim=True), means, rtol=0.1, atol=1e-3)


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
    return trained_like(SmallResNet(10)).state_dict()


def test_fine_tunes_start_as_their_rows_say_and_share_their_heads():
    """Every start but the centred one and GN's computes BN(32)'s encoder at step 0 (eval); the heads are paired."""
    bn = _bn_state()
    reference = segment.SegmentNet()
    reference.encoder.load_state_dict(segment.encoder_state(bn))
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        want = reference.eval().encoder.features(x)
    models = {row.key: segment.initial_model(row, 7, 20, bn) for row in segment.SEGMENT_ROWS}
    kept = {"mabn2-kept", "bn32-from-bn", "frozenbn-head-bn2", "frozenbn-head-gn", "mabn2-mean-folded", "bn2-from-bn"}
    for key, model in models.items():
        with torch.no_grad():
            got = model.eval().encoder.features(x)
        off = ((got - want).norm() / want.norm()).item()
        assert (off < 1e-5) == (key in kept), (key, off)
    converted = models[segment.REFERENCE].encoder.layer2[0]
    assert not isinstance(converted.conv1, CenConv2d) and int(converted.bn1.count_x2) == 0  # streams reset
    assert isinstance(models["mabn2-centred"].encoder.layer2[0].conv1, CenConv2d)
    assert isinstance(models["frozenbn-head-bn2"].encoder.layer2[0].bn1, FrozenBatchNorm2d)
    assert isinstance(models["frozenbn-head-gn"].head[1], nn.GroupNorm)
    heads = [m.head[-1].weight for m in models.values()]  # paired: one seed, one head start, whatever the norm
    assert all(torch.equal(h, heads[0]) for h in heads)


def test_the_domain_shift_changes_the_images_not_the_labels():
    plain, labels = segment.segment_set("val", 16)
    shifted, shifted_labels = segment.segment_set("val", 16, True)
    assert torch.equal(labels, shifted_labels)
    # Lower contrast: every channel's spread shrinks; other colours: the second channel shows the red one inverted.
    assert (shifted.std(dim=(0, 2, 3)) < 0.8 * plain.std(dim=(0, 2, 3))).all()
    assert torch.corrcoef(torch.stack([plain[:, 0].flatten(), shifted[:, 1].flatten()]))[0, 1] < -0.5


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
    assert "x 2 seeds = 16 runs of 150 steps on the generated segmentation set (" in out
    assert f"writes {tmp_path / 'o' / 'ablation.md'}" in out and not (tmp_path / "o").exists()
    code, out, _ = run_mabn([*args, "--segment-start", "--domain-shift", "--rows", "mabn2-kept,bn2-from-bn",
                             "--dry-run"], capsys)  # fmt: skip
    assert code == 0 and "x 2 seeds = 4 runs of 150 steps on the generated segmentation set, domain-shifted" in out
    code, _, err = run_mabn([*args, "--segment-start", "5", "--warm-start", "--dry-run"], capsys)
    assert code == 2 and err.startswith("error: --segment-start trains its own rows")
    code, _, err = run_mabn([*args, "--domain-shift", "--dry-run"], capsys)
    assert code == 2 and err.startswith("error: --domain-shift shifts the fine-tunes' images: it needs --segment-start")
    code, _, err = run_mabn([*args, "--segment-start", "--rows", "mabn2", "--dry-run"], capsys)
    assert code == 2 and err.startswith("error: unknown --segment-start rows ['mabn2']; choose from mabn2-kept, ")


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
        rows = ["--rows", "mabn2-kept,frozenbn-head-bn2,mabn2-centred"]
        code, _, err = run_mabn([*args, "--segment-start", "2", *rows, "--workers", "1", "--out", str(out)], capsys)
    finally:
        segment.segment_set.cache_clear()
    assert code == 0, err
    table = (out / "ablation.md").read_text()
    assert table.startswith("# Stage 2's start from BN weights at small scale (beyond the paper)")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")] for line in table.splitlines()[8:]}
    kept = "MABN(2), BN's function kept (stage 2's conversion)"
    assert rows[kept][2:5] == ["keep_bn_function", kept, "2"]  # its head: the row's own norm
    assert rows["MABN(2), BN's function kept (stage 2's conversion)"][7] == "–"  # the reference
    assert rows["frozen BN, head BN(2)"][2:4] == ["loaded, then the norm swapped (convert_norm)", "BN(2)"]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert sorted({(r["row"], len(r["losses"])) for r in runs}) == [
        ("bn32", 4), ("frozenbn-head-bn2", 2), ("mabn2-centred", 2), ("mabn2-kept", 2)
    ]  # fmt: skip
    assert all(0 <= r["val_error"] <= 100 for r in runs)
