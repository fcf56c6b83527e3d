"""Stage 2 on every decoder (``mabn.models.DECODERS``): the norm everywhere, MABN's centred convs, the head and
policy groups, folding, and short CLI fits that restore and export.

All on ResNet-18 (``arch: resnet18``): the decoders are the same code on any depth. The per-decoder CLI fits are
in the slow suite, except two in the default one: DeepLabV3+ (auxiliary head, spliced separable convs, output
stride 16) and U-Net (no auxiliary head, output stride 32)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from helpers.fits import stage2_args
from helpers.folding import randomize_affine
from helpers.marks import default_suite_runs
from mabn.cli import launch
from mabn.cli import lightning as cli
from mabn.inference import export
from mabn.inference.checkpoint import load_task
from mabn.models import DECODERS, DecoderNet, PSPNet, build_segmentation_model, resnet, save_backbone
from mabn.norm import BatchRenorm2d, CenConv2d, MABN2d, convert_norm, fold_norms
from mabn.tasks import SegmentationTask
from mabn.tools.bench.infer import calibrate

ARCH = "resnet18"
SHALLOW = ("--model.init_args.arch", ARCH)
BATCH_NORMS = (nn.BatchNorm2d, nn.SyncBatchNorm, nn.GroupNorm, BatchRenorm2d, MABN2d)
KIND_TYPES = {"bn": nn.BatchNorm2d, "syncbn": nn.SyncBatchNorm, "gn": nn.GroupNorm, "brn": BatchRenorm2d}


def _build(decoder: str, norm: str = "mabn", norm_batch_size: int | None = 2, **kwargs) -> nn.Module:
    return build_segmentation_model(decoder, 5, norm, norm_batch_size, arch=ARCH, **kwargs)


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    """The model's norms, by name, but UPerNet's LayerNorm2d on the encoder's features (kept on purpose)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (*BATCH_NORMS, nn.LayerNorm))}


def _kept(name: str) -> bool:
    return ".feature_norms." in f".{name}"


def _heads_group() -> list[str]:
    config = yaml.safe_load((launch.CONFIGS / "cityscapes.yaml").read_text())["model"]["init_args"]
    return config["norm_policy"]["groups"]["heads"]["prefixes"]


def _trained_like(model: nn.Module) -> nn.Module:
    """Random gamma/beta and the running statistics of a real batch, so that folding has something to fold."""
    gen = torch.Generator().manual_seed(3)
    randomize_affine(model, BATCH_NORMS, gen)
    calibrate(model, torch.randn(2, 3, 64, 64, generator=gen))
    return model.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# 1. Every decoder with MABN: structure, groups, folding


@pytest.mark.parametrize("decoder", default_suite_runs(DECODERS, keep=["deeplabv3plus"]))
def test_mabn_everywhere_centred_convs_heads_and_exact_folding(decoder):
    model = _build(decoder)
    spec = DECODERS[decoder]
    assert isinstance(model, PSPNet if decoder == "pspnet" else DecoderNet)

    # No BatchNorm2d left: every norm is MABN2d (UPerNet's per-pixel LayerNorm2d on the encoder's features stays).
    norms = _norms(model)
    kept = [n for n in norms if _kept(n)]
    assert all(type(m) is MABN2d for n, m in norms.items() if n not in kept), decoder
    assert len(kept) == (4 if decoder == "upernet" else 0)
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())

    # The parts: the encoder, the new heads (the 10x group), the auxiliary head where the decoder takes one.
    parts = {name for name, _ in model.named_children()}
    new_parts = {"ppm", "classifier", "aux"} if decoder == "pspnet" else {"classifier", "aux"}
    assert parts == {"encoder"} | (new_parts if spec.aux else new_parts - {"aux"})
    head_ids = {id(p) for p in model.heads().parameters()}
    assert head_ids == {id(p) for name, p in model.named_parameters() if not name.startswith("encoder.")}
    # The config's heads group covers every norm of the heads, the encoder group every other one.
    heads = tuple(f"{p.removeprefix('model.')}." for p in _heads_group())
    for name in norms:
        assert name.startswith(heads) != name.startswith("encoder."), name

    # Training and eval at a size no output stride divides: logits at the input's size, aux only where it exists.
    x = torch.randn(2, 3, 40, 56)
    calls: list[nn.Module] = []
    hooks = [
        m.register_forward_hook(lambda m, a, o: calls.append(m)) for m in model.modules() if not list(m.children())
    ]
    with torch.no_grad():
        out = model.train()(x)
    outs = out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in outs] == [(2, 5, 40, 56)] * (2 if spec.aux else 1)
    # In execution order, every MABN2d runs right after a centred conv (MABN centres every conv feeding a norm).
    positions = [i for i, m in enumerate(calls) if isinstance(m, MABN2d)]
    assert len(positions) == len(norms) - len(kept)  # each once
    for i in positions:
        assert isinstance(calls[i - 1], CenConv2d), (decoder, type(calls[i - 1]).__name__)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        assert model.eval()(x).shape == (2, 5, 40, 56)

    # Folding: no norm, no centring left, every norm inside the conv before it (no stand-in convs), and the
    # folded eval model computes what the unfolded one does (exact algebra: float64).
    model = _trained_like(model).double()
    folded = fold_norms(model)
    assert not [m for m in folded.modules() if isinstance(m, (*BATCH_NORMS, CenConv2d))]
    assert sum(isinstance(m, nn.Conv2d) for m in folded.modules()) == sum(
        isinstance(m, nn.Conv2d) for m in model.modules()
    )
    x = x.double()
    with torch.no_grad():
        assert _rel(folded(x), model(x)) < 1e-10


@pytest.mark.parametrize("decoder", default_suite_runs(DECODERS, keep=["unet", "segformer"]))
def test_every_norm_kind_converts_encoder_and_decoder_alike(decoder):
    """Built with ``bn`` every norm, smp's included, is a BatchNorm2d (FPN's GroupNorm too), so each other kind
    replaces them all: converting that network is what building with the kind does (the mabn presets: above)."""
    model = _build(decoder, "bn", None)
    names = {n for n in _norms(model) if not _kept(n)}
    assert names == {n for n in _norms(_build(decoder)) if not _kept(n)}  # the same layers as with mabn
    assert all(type(m) is nn.BatchNorm2d for n, m in _norms(model).items() if n in names)
    for norm, kind in KIND_TYPES.items():
        norms = {n: m for n, m in _norms(convert_norm(copy.deepcopy(model), norm)).items() if not _kept(n)}
        assert norms.keys() == names, norm
        assert all(type(m) is kind for m in norms.values()), (norm, {type(m).__name__ for m in norms.values()})
        if norm == "gn":
            assert all(m.num_groups == math.gcd(32, m.num_channels) for m in norms.values())


def test_output_strides_and_their_checks():
    for decoder, stride in [("deeplabv3plus", 16), ("deeplabv3plus", 8), ("deeplabv3", 8), ("unet", 32)]:
        model = _build(decoder, "bn", output_stride=stride)
        with torch.no_grad():
            top = model.encoder(torch.randn(2, 3, 64, 64))[-1]
        assert top.shape[-1] == 64 // stride, (decoder, stride)
    assert _build("deeplabv3plus", "bn").output_stride == 16  # smp's default for DeepLabV3+
    with pytest.raises(ValueError, match="decoder unet takes output stride 32, not 8"):
        _build("unet", output_stride=8)
    with pytest.raises(ValueError, match="unknown decoder 'linknet'"):
        _build("linknet")


# 2. Through the CLI: fit, checkpoint, restore, fold (and export in the slow suite)


@pytest.fixture(scope="session")
def backbone(tmp_path_factory) -> Path:
    """A stage-1 MABN ResNet-18 file."""
    model = resnet("mabn", num_classes=10, norm_batch_size=2, norm_options={"mabn": {"buffer_size": 16}}, arch=ARCH)
    return save_backbone(tmp_path_factory.mktemp("pretrain") / "resnet18-mabn.pt", model, "mabn", {}, 0.5, ARCH)


@pytest.mark.parametrize("decoder", [d for d in DECODERS if d != "pspnet"])
@pytest.mark.slow  # a stage-2 fit per decoder; the default suite fits PSPNet (tests/helpers/fits.py)
def test_cli_fit_with_a_backbone_restores_and_folds(decoder, tiny_cityscapes, backbone, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = ["--model.init_args.decoder", decoder, "--model.init_args.backbone", str(backbone)]
    args = stage2_args(tiny_cityscapes, "mabn", *SHALLOW, *extra)
    cli_obj = cli.run_cli(args)
    trainer, task = cli_obj.trainer, cli_obj.model
    assert trainer.state.finished and trainer.global_step == 2
    assert math.isfinite(trainer.callback_metrics["train/loss"].item())
    assert ("train/aux_loss" in trainer.callback_metrics) == DECODERS[decoder].aux
    assert 0.0 <= trainer.callback_metrics["val/miou"].item() <= 1.0

    # The 10x lr group is the decoder and its heads; the encoder (with the backbone's weights) the other.
    encoder_group, head_group = trainer.optimizers[0].param_groups
    assert {id(p) for p in encoder_group["params"]} == {id(p) for p in task.model.encoder.parameters()}
    assert head_group["lr"] == pytest.approx(10 * encoder_group["lr"])
    # The norm policy's groups as the config names them: every managed layer of the model is in one.
    callback = next(c for c in trainer.callbacks if type(c).__name__ == "MABNCallback")
    managed = [n for n, m in task.named_modules() if isinstance(m, MABN2d)]
    assert sorted(callback._rules) == sorted(managed)
    assert {n.split(".")[1] for n, r in callback._rules.items() if r is callback.policy.groups["heads"]} == (
        {"classifier", "aux"} if DECODERS[decoder].aux else {"classifier"}
    )

    # The checkpoint names its decoder; restore rebuilds the same network with the trained weights.
    last = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"  # mabn.run.LastCheckpoint's
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["hyper_parameters"]["decoder"] == decoder
    restored = load_task(last).task
    assert isinstance(restored, SegmentationTask) and isinstance(restored.model, DecoderNet)
    assert restored.model.decoder_name == decoder
    trained = task.model.state_dict()
    assert restored.model.state_dict().keys() == trained.keys()
    assert all(torch.equal(v.cpu(), trained[k].cpu()) for k, v in restored.model.state_dict().items())
    model = restored.model.double()
    x = torch.randn(1, 3, 48, 80, dtype=torch.float64)
    with torch.no_grad():
        assert _rel(fold_norms(model)(x), model(x)) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("decoder", [d for d in DECODERS if d != "pspnet"])
def test_export_of_each_decoder_writes_a_folded_model_that_matches(decoder, tmp_path):
    """``python -m mabn export``'s path: rebuilt from the hyperparameters, folded, traced (and ONNX where
    installed), each checked against the unfolded model."""
    task = SegmentationTask(norm="mabn", num_classes=5, arch=ARCH, decoder=decoder)
    _trained_like(task.model)
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams)}, tmp_path / "seg.ckpt")
    result = export.export(tmp_path / "seg.ckpt", tmp_path / "out", (64, 96))
    assert result.task == "SegmentationTask" and result.folded.relative < 1e-10
    assert result.onnxruntime is None or result.onnxruntime.relative < 1e-3  # where onnxruntime is installed
    scripted = torch.jit.load(str(result.torchscript))
    x = torch.randn(1, 3, 80, 112)  # another size than the traced one, and no multiple of 32
    with torch.no_grad():
        assert _rel(scripted(x), task.model.eval()(x)) < 2e-3


@pytest.mark.parametrize(
    ("decoder", "classes"),
    default_suite_runs([(d, k) for d in ("pspnet", "deeplabv3plus") for k in (3, 19)], keep=[("pspnet", 19)]),
)
def test_first_loss_is_near_ln_k_for_every_norm(decoder, classes):
    """The classifiers start near zero (normal, std 0.01): a fresh model's first cross-entropy on random pixels is
    within 1 of ln K for every norm, main and auxiliary head alike (He's fan-out start, at the class count, began
    PSPNet at 8.7 to 9.1 against ln K = 1.1 and 2.9)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 64, 64, generator=gen)
    y = torch.randint(0, classes, (4, 64, 64), generator=gen)
    for norm in ("bn", "gn", "brn", "mabn"):
        torch.manual_seed(0)
        model = build_segmentation_model(decoder, classes, norm, 2 if norm in ("brn", "mabn") else None, arch=ARCH)
        for logits in model(x):
            loss = nn.functional.cross_entropy(logits, y).item()
            assert abs(loss - math.log(classes)) < 1, (norm, loss)
