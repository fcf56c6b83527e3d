"""Stage 2's backbone sources: stage-1 files of the same norm, BN files into bn/brn/syncbn encoders, torchvision
state dicts, and the refusals (one line naming why) where a backbone cannot start the encoder."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import segmentation_models_pytorch as smp
import torch
import torchvision
from torch import nn

from helpers.commands import run_mabn
from helpers.trainer import STAGE1_FIT
from mabn.cli import launch
from mabn.cli import lightning as cli
from mabn.data.synthetic import cityscapes as demo_cityscapes
from mabn.data.synthetic import imagenet as demo_imagenet
from mabn.models import (
    BackboneError,
    check_backbone,
    load_backbone_into,
    norm_kwargs_for,
    resnet,
    resnet101,
    save_backbone,
)
from mabn.models.backbone import CONVERTED, STAGE1, Backbone, check_fits, converts
from mabn.norm import BatchRenorm2d, convert_norm

EPS = 1e-5


def _encoder(norm: str, norm_batch_size: int | None = None, arch: str = "resnet101") -> nn.Module:
    """A stage-2 PSPNet encoder (dilated ResNet-101 or ``arch``, output stride 8) with ``norm``."""
    encoder = smp.encoders.get_encoder(arch, weights=None, output_stride=8)
    return convert_norm(encoder, norm, **norm_kwargs_for(norm, norm_batch_size))


@pytest.fixture(scope="session")
def bn_model() -> nn.Module:
    """torchvision's ResNet-101 (random init) whose BN statistics are those of one batch, so that eval-mode
    activations stay finite through all 104 norms."""
    torch.manual_seed(0)
    model = torchvision.models.resnet101()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # cumulative average: after one batch, that batch's statistics
    with torch.no_grad():
        model.train()(torch.randn(4, 3, 64, 64))
    return model.eval()


@pytest.fixture(scope="session")
def tv_file(bn_model, tmp_path_factory) -> Path:
    """What a user saves from torchvision: ``torch.save(model.state_dict(), path)``."""
    path = tmp_path_factory.mktemp("tv") / "resnet101-imagenet.pth"
    torch.save(bn_model.state_dict(), path)
    return path


def _bn_layers(module: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in module.named_modules() if isinstance(m, nn.BatchNorm2d | BatchRenorm2d)}


@pytest.mark.slow  # builds ResNet-101 twice
def test_torchvision_bn_statistics_become_brn_running_std_with_eps(bn_model, tmp_path):
    state = {k: v.clone() for k, v in bn_model.state_dict().items()}  # the module's model stays as built
    # Tiny variances, where sqrt(var + eps) and sqrt(var) differ by a factor of 3 or more.
    state["layer1.0.bn1.running_var"][:8] = torch.linspace(1e-7, 1e-6, 8)
    path = tmp_path / "tv.pth"
    torch.save(state, path)
    encoder = _encoder("brn")
    info = load_backbone_into(encoder, path, "brn")
    assert info["source"] == "torchvision" and info["norm"] == "bn"

    layers = _bn_layers(encoder)
    assert len(layers) == 104 and all(isinstance(m, BatchRenorm2d) for m in layers.values())
    for name, layer in layers.items():
        var = state[f"{name}.running_var"].double()
        torch.testing.assert_close(layer.running_mean, state[f"{name}.running_mean"], rtol=0, atol=0)
        torch.testing.assert_close(layer.running_std.double(), (var + EPS).sqrt(), rtol=1e-6, atol=0)
        torch.testing.assert_close(layer.weight, state[f"{name}.weight"], rtol=0, atol=0)
        assert layer.num_batches_tracked.item() == 0  # BRN's clipping ramps start on Cityscapes
    tiny = encoder.layer1[0].bn1.running_std[:8].double()
    assert (tiny > 3 * state["layer1.0.bn1.running_var"][:8].double().sqrt()).all()


@pytest.mark.slow  # builds three ResNet-101 encoders
def test_bn_backbone_gives_bn_brn_and_syncbn_encoders_the_same_eval_function(tv_file):
    # bn at normalization batch 2 is ghost-batch BN, a BatchRenorm2d layer keeping running_std.
    encoders = {
        "bn": _encoder("bn"),
        "brn": _encoder("brn"),
        "bn (batch 2)": _encoder("bn", 2),
        "syncbn": _encoder("syncbn"),
    }
    # In float64: float32 rounding through 104 norms alone comes within the tolerance below.
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    outputs = {}
    for name, encoder in encoders.items():
        load_backbone_into(encoder, tv_file, name.split()[0])
        with torch.no_grad():
            outputs[name] = encoder.double().eval()(x)[-1]
    reference = outputs.pop("bn")
    assert reference.shape == (1, 2048, 8, 8)
    assert torch.isfinite(reference).all() and reference.std() > 0.01  # neither overflow nor zeros: a real comparison
    for name, out in outputs.items():
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item(), msg=name)


@pytest.mark.slow  # builds and loads three ResNet-101 encoders
def test_stage1_bn_files_of_either_layout_load_into_bn_brn_and_syncbn(bn_model, tmp_path):
    # Ghost-batch BN at batch 2 (stage 1's bn) keeps running_std; BN over the device batch (bn32) running_var.
    ghost = resnet101("bn", num_classes=10, norm_batch_size=2)
    with torch.no_grad():
        for layer in _bn_layers(ghost).values():
            layer.running_std.uniform_(0.5, 2.0)
            layer.running_mean.normal_()
    files = {
        "bn2": save_backbone(tmp_path / "bn2.pt", ghost, "bn", {"model": {"norm_batch_size": 2}}, 0.4),
        "bn32": save_backbone(tmp_path / "bn32.pt", bn_model, "bn", {"model": {"norm_batch_size": None}}, 0.7),
    }
    syncbn = _encoder("syncbn")
    load_backbone_into(syncbn, files["bn2"], "syncbn")
    for name, layer in _bn_layers(ghost).items():
        target = syncbn.get_submodule(name)
        assert isinstance(target, nn.SyncBatchNorm)
        torch.testing.assert_close(target.running_var, layer.running_std.square() - EPS, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(target.running_mean, layer.running_mean, rtol=0, atol=0)

    stage2_bn = _encoder("bn", 2)  # the recipe's stage-2 bn: ghost batches of 2
    info = load_backbone_into(stage2_bn, files["bn32"], "bn")
    assert "normalization batch per device" in info["description"] and "val top-1 0.700" in info["description"]
    state = bn_model.state_dict()
    for name, layer in _bn_layers(stage2_bn).items():
        expected = (state[f"{name}.running_var"].double() + EPS).sqrt()
        torch.testing.assert_close(layer.running_std.double(), expected, rtol=1e-6, atol=0)


def test_torchvision_file_is_converted_for_mabn_norms_and_refused_by_gn(tv_file):
    for norm in ("mabn", "mabn_nowc", "mbn_emas"):
        assert converts(check_backbone(tv_file, norm), norm)
    with pytest.raises(BackboneError, match="GroupNorm normalizes each sample by its own statistics"):
        check_backbone(tv_file, "gn")
    for norm in ("bn", "brn", "syncbn", "frozenbn"):
        assert check_backbone(tv_file, norm).source == "torchvision"


def test_torchvision_resnet50_is_refused_by_its_block_count(tmp_path):
    path = tmp_path / "resnet50.pth"
    torch.save(torchvision.models.resnet50().state_dict(), path)
    with pytest.raises(BackboneError, match="6 blocks in layer3, ResNet-101 has 23") as refused:
        check_backbone(path, "bn")
    # both ways out: the weights of the arch asked for, or the arch of the weights at hand
    assert str(refused.value).endswith(
        "save torchvision.models.resnet101's state_dict(), or train the file's ResNet-50: --model.init_args.arch "
        "resnet50"
    )


def test_resnet18_bn_weights_under_the_default_arch_name_both_ways_out(tmp_path):
    path = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    with pytest.raises(BackboneError) as refused:
        check_backbone(path, "bn")
    assert str(refused.value).endswith(
        "save torchvision.models.resnet101's state_dict(), or train the file's ResNet-18: --model.init_args.arch "
        "resnet18"
    )


def test_torchvision_file_of_basic_blocks_is_refused_by_a_bottleneck_arch(tmp_path):
    path = tmp_path / "resnet34.pth"  # ResNet-34 has ResNet-50's block counts, of basic blocks
    torch.save(torchvision.models.resnet34().state_dict(), path)
    with pytest.raises(
        BackboneError, match="of basic blocks, ResNet-50 has bottleneck blocks.*models.resnet50.*arch resnet34$"
    ):
        check_backbone(path, "bn", "resnet50")
    assert check_backbone(path, "bn", "resnet34").describe() == "torchvision ResNet-34 state dict (BN)"


def test_a_stage1_file_starts_only_an_encoder_of_its_arch(tmp_path):
    """A resnet18 stage-1 file records its arch: a resnet101 encoder refuses it by name before any weight is
    read into it, a resnet18 encoder loads it strictly."""
    model = resnet("mabn", num_classes=10, norm_batch_size=2, arch="resnet18")
    path = save_backbone(tmp_path / "resnet18-mabn.pt", model, "mabn", {}, None, arch="resnet18")
    refusal = "arch mismatch: .*stage-1 resnet18 file, but the model's encoder is resnet101"
    with pytest.raises(BackboneError, match=refusal):
        check_backbone(path, "mabn")
    encoder = convert_norm(smp.encoders.get_encoder("resnet18", weights=None, output_stride=8), "mabn")
    assert load_backbone_into(encoder, path, "mabn", "resnet18")["norm"] == "mabn"
    for key, value in encoder.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    with pytest.raises(ValueError, match="unknown arch 'resnet19'; choose one of resnet18, resnet34"):
        resnet("bn", arch="resnet19")
    payload = {**torch.load(path, weights_only=True), "arch": "vgg16"}
    torch.save(payload, tmp_path / "vgg.pt")
    with pytest.raises(BackboneError, match="vgg.pt names an unknown arch 'vgg16'"):
        check_backbone(tmp_path / "vgg.pt", "mabn", "resnet18")


def test_a_file_without_a_key_names_it(bn_model, tmp_path):
    state = bn_model.state_dict()
    del state["layer4.2.bn3.running_var"]
    path = tmp_path / "cut.pth"
    torch.save(state, path)
    encoder = _encoder("bn")
    before = encoder.conv1.weight.clone()
    with pytest.raises(BackboneError, match="1 encoder key.s. missing from the file, e.g. layer4.2.bn3.running_var"):
        load_backbone_into(encoder, path, "bn")
    assert torch.equal(encoder.conv1.weight, before)  # nothing loaded


@pytest.mark.parametrize(
    ("source", "centralized", "target", "reason"),
    [
        ("bn", False, "bn", None),
        ("bn", False, "brn", None),
        ("bn", False, "syncbn", None),
        ("syncbn", False, "brn", None),
        ("mabn", True, "mabn", None),
        ("brn", False, "brn", None),
        ("bn", False, "mabn", None),  # converted
        ("syncbn", False, "mbn", None),
        ("bn", False, "mabn_nowc", None),  # converted
        ("bn", False, "frozenbn", None),
        ("mabn", True, "frozenbn", "pre-train with that norm"),
        ("mabn_nowc", False, "mabn", "mabn centres each conv's weights"),
        ("gn", False, "mabn", "or give BN weights (converted to mabn)"),
        ("bn", False, "gn", "GroupNorm normalizes each sample"),
        ("mabn", True, "brn", "pre-train with that norm"),
        ("brn", False, "bn", "pre-train with that norm"),
        ("gn", False, "bn", "pre-train with that norm"),
    ],
)
def test_which_stage1_norm_starts_which_encoder(source, centralized, target, reason):
    backbone = Backbone(Path("b.pt"), STAGE1, source, centralized, EPS, {}, {})
    if reason is None:
        check_fits(backbone, target)
        return
    with pytest.raises(BackboneError) as info:
        check_fits(backbone, target)
    message = str(info.value)
    assert f"pre-trained with norm '{source}' (a stage-1 file), but the model asks for norm '{target}'" in message
    assert reason in message and "\n" not in message


def _launch(argv: list[str], capsys) -> tuple[int, str, str]:
    return run_mabn(argv, capsys)


@pytest.mark.slow  # three stage-2 dry runs; tests/test_segment_start.py dry-runs the conversion
def test_stage2_dry_runs_accept_a_bn_backbone_for_brn_and_syncbn_and_convert_it_for_mabn(
    bn_model, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    bn32 = save_backbone(tmp_path / "pretrain" / "bn32" / "resnet101-bn.pt", bn_model, "bn", {}, None)
    for norm, gpus in (("brn", "0"), ("bn", "0"), ("syncbn", "2")):
        argv = ["cityscapes", "--norm", norm, "--gpus", gpus, "--backbone", str(bn32), "--dry-run"]
        code, out, err = _launch(argv, capsys)
        assert code == 0, err
        assert f"--model.init_args.norm {norm} " in out and f"--model.init_args.backbone {bn32}" in out
    code, out, err = _launch(["cityscapes", "--norm", "mabn", "--backbone", str(bn32), "--dry-run"], capsys)
    assert code == 0, err
    assert f"backbone: {bn32} (stage-1 backbone, norm bn at normalization batch n/a, val top-1 n/a), {CONVERTED}" in out
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # a stage-2 fit
def test_stage2_brn_run_starts_from_a_bn32_backbone(bn_model, tmp_path, monkeypatch, caplog):
    # What make cityscapes NORM=brn BACKBONE=pretrain/bn32/resnet101-bn.pt builds, up to the first step.
    monkeypatch.chdir(tmp_path)
    data = demo_cityscapes.generate(tmp_path / "cs", n_train=2, n_val=1, size=(32, 64))
    bn32 = save_backbone(tmp_path / "pretrain" / "bn32" / "resnet101-bn.pt", bn_model, "bn", {}, None)
    args = launch.build_args("cityscapes", data, "brn", 0, 1, ["--data.init_args.num_workers", "0"], backbone=bn32)
    with caplog.at_level(logging.INFO):
        task = cli.run_cli(args[1:], run=False).model  # without "fit": build, don't train
    assert f"Encoder loaded from {bn32} (stage-1 backbone, norm bn" in caplog.text and "into norm brn" in caplog.text
    layer, state = task.model.encoder.layer3[22].bn2, bn_model.state_dict()
    assert isinstance(layer, BatchRenorm2d)
    expected = (state["layer3.22.bn2.running_var"].double() + EPS).sqrt()
    torch.testing.assert_close(layer.running_std.double(), expected, rtol=1e-6, atol=0)


def test_bn32_preset_trains_bn_over_the_device_batch_into_its_own_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = launch.build_args("pretrain", None, "bn32", 0, 1, [])
    joined = " ".join(args)
    assert "--model.init_args.norm bn " in joined and "--model.init_args.norm_batch_size null" in joined
    assert "--trainer.default_root_dir runs/demo/pretrain/bn32" in joined
    assert "--model.init_args.export_dir pretrain/demo/bn32" in joined
    cli.check(args)  # the whole configuration passes (the demo batch of 32 is one normalization batch)
    real = launch.build_args("pretrain", _imagenet_layout(tmp_path), "bn32", 8, 1, [], dry_run=True)
    assert "--model.init_args.export_dir pretrain/bn32" in " ".join(real)
    with pytest.raises(launch.LaunchError, match="NORM=bn32 is a stage-1 preset.*BACKBONE=pretrain/bn32/resnet101-bn"):
        launch.build_args("cityscapes", None, "bn32", 0, 1, [])


@pytest.mark.slow  # a stage-1 fit
def test_bn32_short_fit_exports_a_bn_backbone_that_starts_brn(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = demo_imagenet.generate(tmp_path / "cls", n_train=4, n_val=2, size=40)
    # ResNet-18: what is checked is the preset's folders and BN layers, the same at any depth.
    args = launch.build_args("pretrain", data, "bn32", 0, 1, []) + ["--model.init_args.arch", "resnet18", *STAGE1_FIT]
    cli.run_cli(args)
    path = tmp_path / "pretrain" / "bn32" / "resnet18-bn.pt"
    payload = torch.load(path, weights_only=True)
    assert payload["norm"] == "bn" and payload["config"]["model"]["norm_batch_size"] is None
    assert payload["config"]["run_dir"] == "runs/pretrain/bn32" and "layer1.0.bn1.running_var" in payload["state_dict"]
    assert not (tmp_path / "pretrain" / "resnet18-bn.pt").exists()  # never where bn at batch 2 exports
    encoder = _encoder("brn", arch="resnet18")
    assert "at normalization batch per device" in load_backbone_into(encoder, path, "brn", "resnet18")["description"]
    expected = (payload["state_dict"]["layer1.0.bn1.running_var"].double() + EPS).sqrt()
    torch.testing.assert_close(encoder.layer1[0].bn1.running_std.double(), expected, rtol=1e-6, atol=0)


def _imagenet_layout(root: Path) -> Path:
    for split in ("train", "val"):
        (root / "imagenet" / split).mkdir(parents=True)
    return root / "imagenet"


def test_a_backbone_is_read_once_until_its_file_changes(tmp_path, monkeypatch, backbones):
    """A run checks its backbone, plans with it and loads it: one read while the file stays as it is, under any name;
    a file written anew (a new inode, as every atomic write gives) or rewritten in place is read again."""
    from mabn.models import backbone as module

    reads = []
    real = module.load_weights_file
    monkeypatch.setattr(module, "load_weights_file", lambda path, *a, **k: reads.append(path) or real(path, *a, **k))
    path = tmp_path / "tv.pth"
    torch.save({"conv1.weight": torch.ones(2)}, path)  # not a ResNet: refused at each call, read once
    for _ in range(2):
        with pytest.raises(BackboneError):
            module.read_backbone(path, "resnet18")
    assert len(reads) == 1

    shutil.copy(backbones.torchvision("resnet18"), tmp_path / "new.pth")
    (tmp_path / "new.pth").replace(path)  # an atomic write: a new inode at the same path
    assert module.read_backbone(path, "resnet18").source == "torchvision" and len(reads) == 2
    assert module.read_backbone(path, "resnet18").source == "torchvision" and len(reads) == 2
    (tmp_path / "link.pth").hardlink_to(path)  # the same file under another name: not read again, named as given
    assert module.read_backbone(tmp_path / "link.pth", "resnet18").path == tmp_path / "link.pth" and len(reads) == 2
    with pytest.raises(BackboneError, match="ResNet-34 has 3"):  # another arch: the same read, its own answer
        module.read_backbone(path, "resnet34")
    assert len(reads) == 2

    light = torch.load(path, weights_only=True)
    torch.save({k: v for k, v in light.items() if not k.startswith("fc.")}, path)  # in place, another size
    assert "fc.weight" not in module.read_backbone(path, "resnet18").head and len(reads) == 3
