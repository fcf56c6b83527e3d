"""Stage 2: PSPNet structure, the warm-up + poly schedule, short fits per norm, the backbone hand-off, bad data.

The structure and the backbone hand-off are checked on PSPNet-101 (the default); the schedule and the short fits,
which are the same code at any depth, train a PSPNet on ResNet-18 (``SHALLOW``)."""

from __future__ import annotations

import math
import re
import types
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from helpers.commands import run_mabn
from helpers.fits import stage2_args
from helpers.marks import default_suite_runs
from helpers.trainer import BARE
from mabn.callbacks import MABNCallback, PhaseRule
from mabn.cli import launch
from mabn.cli import lightning as cli
from mabn.data.classes import IGNORE_INDEX
from mabn.models import BackboneError, PSPNet, resnet101, save_backbone
from mabn.norm import BatchRenorm2d, CenConv2d, MABN2d
from mabn.tasks import SegmentationTask
from mabn.tasks.segmentation import probs_loss

NORM_TYPES = (nn.BatchNorm2d, nn.SyncBatchNorm, nn.GroupNorm, nn.LayerNorm, nn.InstanceNorm2d, BatchRenorm2d, MABN2d)
EXPECTED_NORM = {"bn": nn.BatchNorm2d, "gn": nn.GroupNorm, "brn": BatchRenorm2d, "mabn": MABN2d}
# ResNet-101: stem 1 + 33 bottlenecks x 3 + 4 downsample = 104; PPM one per bin; one each in the two heads.
NORM_COUNTS = {"encoder": 104, "ppm": 4, "classifier": 1, "aux": 1}


SHALLOW = ("--model.init_args.arch", "resnet18")


def _cli_error_lines(args: list[str], capsys) -> tuple[int | str | None, list[str]]:
    """Exit code and stderr lines of ``python -m mabn fit <args>``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Python warnings are not the CLI's report (pytest usually captures them)
        code, _, err = run_mabn(args, capsys)
    return code, err.strip().splitlines()


def _norms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, NORM_TYPES)]


# 1. PSPNet structure


@pytest.mark.parametrize("norm", default_suite_runs(["bn", "gn", "brn", "mabn"], keep=["gn", "mabn"]))
def test_every_norm_of_pspnet_is_the_requested_one(norm):
    with torch.device("meta"):  # the layers' types and counts: no weights needed
        model = PSPNet(norm=norm)
    for part, count in NORM_COUNTS.items():
        norms = _norms(getattr(model, part))
        assert len(norms) == count, part
        assert all(type(m) is EXPECTED_NORM[norm] for m in norms), (part, {type(m).__name__ for m in norms})
        if norm == "gn":
            assert all(m.num_groups == 32 for m in norms), part
    centred = [m for m in model.modules() if isinstance(m, CenConv2d)]
    assert bool(centred) == (norm == "mabn")  # only MABN centres conv weights
    assert [stage[0].output_size for stage in model.ppm.stages] == [1, 2, 3, 6]


def test_pspnet_forward_shapes_aux_head_and_centred_convs():
    model = PSPNet(num_classes=19, norm="mabn")
    n, h, w = 2, 32, 48  # not square, so swapped height/width would show
    x = torch.randn(n, 3, h, w)
    calls: list[nn.Module] = []  # leaf modules in execution order
    shapes: dict[str, list[tuple]] = {}  # (input shape, output shape) per call of a watched module

    def trace(module, args, out):
        calls.append(module)

    def watch(name: str, module: nn.Module):
        def hook(mod, args, out):
            shapes.setdefault(name, []).append((tuple(args[0].shape), tuple(out.shape)))

        return module.register_forward_hook(hook)

    hooks = [m.register_forward_hook(trace) for m in model.modules() if not list(m.children())]
    hooks += [watch("ppm", model.ppm), watch("aux", model.aux)]
    hooks += [watch(f"pool{i}", stage[0]) for i, stage in enumerate(model.ppm.stages)]
    aux_leaves = {m for m in model.aux.modules() if not list(m.children())}

    model.train()
    with torch.no_grad():
        out = model(x)
    assert isinstance(out, tuple) and len(out) == 2
    assert out[0].shape == (n, 19, h, w) and out[1].shape == (n, 19, h, w)
    assert aux_leaves <= set(calls)
    assert len(shapes["aux"]) == 1
    # Output stride 8: layer4 (into the PPM) and layer3 (into the aux head) are at H/8 x W/8.
    assert shapes["ppm"] == [((n, 2048, h // 8, w // 8), (n, 2048 + 4 * 512, h // 8, w // 8))]
    assert shapes["aux"][0][0] == (n, 1024, h // 8, w // 8)
    assert [shapes[f"pool{i}"][0][1] for i in range(4)] == [(n, 2048, b, b) for b in (1, 2, 3, 6)]

    # In execution order, every norm runs once and right after a centred conv.
    norm_positions = [i for i, m in enumerate(calls) if isinstance(m, NORM_TYPES)]
    assert len(norm_positions) == sum(NORM_COUNTS.values())
    for i in norm_positions:
        assert i > 0 and isinstance(calls[i - 1], CenConv2d), (i, calls[i - 1])

    calls.clear()
    shapes.clear()
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert isinstance(out, torch.Tensor) and out.shape == (n, 19, h, w)
    assert "aux" not in shapes and not aux_leaves & set(calls)
    assert "ppm" in shapes  # the hooks still work in eval
    for hook in hooks:
        hook.remove()


# 2. Learning-rate schedule


class _RecordLR(pl.Callback):
    def __init__(self):
        self.lrs: list[list[float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append([group["lr"] for group in trainer.optimizers[0].param_groups])


def _expected_lrs(base: float, batches: int, accumulate: int, epochs: int, warmup_epochs: float) -> list[list[float]]:
    """[encoder lr, head lr] at every micro-batch: Lightning steps every ``accumulate`` batches and on the last one;
    ``base`` is the lr at the run's global batch."""
    steps_per_epoch = math.ceil(batches / accumulate)
    total = epochs * steps_per_epoch
    warmup = round(warmup_epochs * steps_per_epoch)
    expected = []
    for epoch in range(epochs):
        for batch in range(batches):
            i = epoch * steps_per_epoch + batch // accumulate  # the optimizer step this micro-batch feeds
            factor = (i + 1) / warmup if i < warmup else (1 - i / total) ** 0.9
            expected.append([base * factor, 10 * base * factor])
    return expected


@pytest.mark.parametrize(
    ("norm", "batch", "accumulate", "epochs"),
    [
        ("bn", 2, 1, 3),  # 2 steps an epoch: warm-up over steps 0-1, poly over 2-5
        # 4 batches an epoch, accumulated 3 + 1: still 2 optimizer steps an epoch
        pytest.param("gn", 1, 3, 2, marks=pytest.mark.slow),
    ],
)
def test_lr_follows_warmup_then_poly_with_10x_heads(
    tiny_cityscapes, tmp_path, monkeypatch, norm, batch, accumulate, epochs
):
    monkeypatch.chdir(tmp_path)
    base = 0.02
    args = stage2_args(tiny_cityscapes, norm, "--data.init_args.global_batch_size", str(batch), *SHALLOW,
                     "--model.init_args.base_lr", str(base), "--model.init_args.warmup_epochs", "1",
                     "--model.init_args.norm_batch_size", str(min(batch, 2)))  # fmt: skip
    parsed = cli.run_cli(args[1:], run=False)  # without "fit": build, then fit with this trainer
    task: SegmentationTask = parsed.model
    record = _RecordLR()
    trainer = pl.Trainer(max_epochs=epochs, accumulate_grad_batches=accumulate, limit_val_batches=0,
                         callbacks=[record], **BARE)  # fmt: skip
    trainer.fit(task, parsed.datamodule)
    assert trainer.global_step == epochs * math.ceil(4 / batch / accumulate)  # the step count assumed below
    scaled = base * batch * accumulate / 16  # the linear scaling rule, from the recipe's global batch of 16
    expected = _expected_lrs(scaled, 4 // batch, accumulate, epochs, 1)
    assert record.lrs == [pytest.approx(e, rel=1e-12) for e in expected]

    # The 10x group holds exactly the new heads; the encoder is the other group.
    encoder_group, head_group = trainer.optimizers[0].param_groups
    head_ids = {id(p) for p in task.model.heads().parameters()}
    assert {id(p) for p in head_group["params"]} == head_ids
    assert {id(p) for p in encoder_group["params"]} == {id(p) for p in task.model.encoder.parameters()}


# 3. Short fits


@pytest.mark.slow  # a stage-2 fit per norm; the default suite's is the shared one (tests/helpers/fits.py)
@pytest.mark.parametrize("norm", ["bn", "gn", "brn", "mabn"])
def test_short_fit_logs_miou_and_saves_checkpoints(tiny_cityscapes, tmp_path, monkeypatch, norm):
    monkeypatch.chdir(tmp_path)
    cli_obj = cli.run_cli(stage2_args(tiny_cityscapes, norm, *SHALLOW))
    trainer = cli_obj.trainer
    assert trainer.state.finished and trainer.global_step == 2
    miou = trainer.callback_metrics["val/miou"].item()
    assert math.isfinite(miou) and 0.0 <= miou <= 1.0
    # val/loss: the cross-entropy of the class probabilities validation scores, averaged over the val images
    val_loss = trainer.callback_metrics["val/loss"].item()
    task = cli_obj.model.eval()
    with torch.no_grad():
        losses = [(probs_loss(task.predict_probs(x), y).item(), len(x)) for x, y in cli_obj.datamodule.val_dataloader()]
        logits = torch.randn(2, 19, 5, 7, dtype=torch.float64)
        labels = torch.randint(0, 19, (2, 5, 7))
        labels[0, 0] = IGNORE_INDEX
    assert val_loss == pytest.approx(sum(v * n for v, n in losses) / sum(n for _, n in losses), rel=1e-5)
    expected = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)  # of the logits: the same cross-entropy
    assert probs_loss(logits.softmax(1), labels).item() == pytest.approx(expected.item(), rel=1e-12)
    ckpt_cb = trainer.checkpoint_callback
    best, last = Path(ckpt_cb.best_model_path), Path(ckpt_cb.dirpath) / "last.ckpt"  # mabn.run.LastCheckpoint's
    assert best.is_file() and last.is_file()
    assert best.resolve().is_relative_to(tmp_path.resolve() / "runs" / "cityscapes")
    assert best.name == f"step2-miou{miou:.4f}.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2 and ckpt["hyper_parameters"]["norm"] == norm
    assert ckpt["hyper_parameters"]["arch"] == "resnet18" and len(cli_obj.model.model.encoder.layer3) == 2
    assert ckpt["state_dict"].keys() == cli_obj.model.state_dict().keys()


# 4. Backbone hand-off


def _task_args(data: Path, norm: str, *extra: str) -> list[str]:
    return stage2_args(data, norm, *extra)[1:]  # without "fit": build, don't run


@pytest.fixture(scope="session")
def mabn_backbone(tmp_path_factory) -> Path:
    model = resnet101("mabn", num_classes=10, norm_batch_size=2, norm_options={"mabn": {"buffer_size": 16}})
    path = tmp_path_factory.mktemp("pretrain") / "resnet101-mabn.pt"
    return save_backbone(path, model, "mabn", config={}, val_top1=0.5)


@pytest.mark.slow  # a stage-2 fit from a stage-1 file; test_pretrain.py loads one strictly into the encoder
def test_backbone_weights_reach_the_encoder(tiny_cityscapes, mabn_backbone, tmp_path, monkeypatch, recwarn):
    monkeypatch.chdir(tmp_path)
    parsed = cli.run_cli(
        _task_args(tiny_cityscapes, "mabn", "--model.init_args.backbone", str(mabn_backbone)), run=False
    )
    assert not [w for w in recwarn if "random weights" in str(w.message)]
    saved = torch.load(mabn_backbone, map_location="cpu", weights_only=True)["state_dict"]
    encoder = parsed.model.model.encoder.state_dict()
    assert encoder.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(encoder[key], value), key


def test_backbone_of_another_norm_names_both(tiny_cityscapes, mabn_backbone, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    both = "pre-trained with norm 'mabn'.*asks for norm 'gn'"
    with pytest.raises(Exception) as info:
        cli.run_cli(_task_args(tiny_cityscapes, "gn", "--model.init_args.backbone", str(mabn_backbone)), run=False)
    err = info.value
    while err is not None and not isinstance(err, BackboneError):  # jsonargparse may wrap it
        err = err.__cause__ or err.__context__
    assert isinstance(err, BackboneError), repr(info.value)
    assert re.search(both, str(err)), str(err)

    # The command line reports it as one line and exit code 2.
    code, lines = _cli_error_lines(
        stage2_args(tiny_cityscapes, "gn", "--model.init_args.backbone", str(mabn_backbone)), capsys
    )
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(both, lines[0]), lines


def test_backbone_of_another_arch_is_one_error_line(tiny_cityscapes, mabn_backbone, tmp_path, monkeypatch, capsys):
    """A stage-2 run of ResNet-18 refuses the ResNet-101 backbone before building anything."""
    monkeypatch.chdir(tmp_path)
    args = stage2_args(tiny_cityscapes, "mabn", *SHALLOW, "--model.init_args.backbone", str(mabn_backbone))
    code, lines = _cli_error_lines(args, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: arch mismatch: backbone {mabn_backbone} is a stage-1 resnet101 file")
    assert lines[0].endswith(
        "the model's encoder is resnet18: set the model's arch to resnet101 or pre-train with arch resnet18"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # a stage-2 fit
def test_no_backbone_warns_random_encoder(tiny_cityscapes, mabn_backbone, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="encoder starts from random weights"):
        parsed = cli.run_cli(_task_args(tiny_cityscapes, "mabn"), run=False)
    saved = torch.load(mabn_backbone, map_location="cpu", weights_only=True)["state_dict"]
    assert not torch.equal(parsed.model.model.encoder.conv1.weight, saved["conv1.weight"])


# 5. Global batch


def test_global_batch_splits_over_devices(tiny_cityscapes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parsed = cli.run_cli(
        _task_args(tiny_cityscapes, "bn", *SHALLOW, "--data.init_args.global_batch_size", "4"), run=False
    )
    dm = parsed.datamodule

    def on(world: int) -> int:
        dm.trainer = types.SimpleNamespace(world_size=world, num_devices=world, lightning_module=parsed.model)
        dm.setup("fit")
        return dm.batch_size

    assert on(1) == 4
    batches = list(dm.train_dataloader())
    assert [tuple(images.shape) for images, _ in batches] == [(4, 3, 32, 32)]
    assert [tuple(labels.shape) for _, labels in batches] == [(4, 32, 32)]
    assert on(2) == 2
    assert on(3) == on(4) == 2  # more devices than pairs in the global batch: one pair each (mabn.run.scaling)


# 6. The norm policy


def test_norm_policy_settings_from_the_config_and_the_command_line_reach_the_callback(
    tiny_cityscapes, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    parsed = cli.run_cli(
        _task_args(tiny_cityscapes, "mabn", *SHALLOW, "--model.init_args.norm_policy.log_every_n_steps", "7"), run=False
    )
    callback = next(c for c in parsed.model.configure_callbacks() if isinstance(c, MABNCallback))
    assert callback.policy.log_every_n_steps == 7  # the command line's
    config = yaml.safe_load((launch.CONFIGS / "cityscapes.yaml").read_text())["model"]["init_args"]["norm_policy"]
    for name, rule in config["groups"].items():  # the config's module groups, typed
        assert callback.policy.groups[name] == PhaseRule(**rule), name
    assert parsed.model.hparams["norm_policy"]["groups"] == config["groups"]  # plain values, as checkpoints hold them


@pytest.mark.parametrize(
    ("override", "culprit"),
    [
        (["--model.init_args.norm_policy.log_every_n_step", "5"], "log_every_n_step"),
        (['--model.init_args.norm_policy={"groups": {"heads": {"prefixes": ["model.ppm"], "renorm_form": 3}}}'],
         "renorm_form"),
    ],
    ids=["policy-key", "group-key"],
)  # fmt: skip
def test_a_misspelt_norm_policy_key_stops_the_command_naming_it(
    tiny_cityscapes, tmp_path, monkeypatch, capsys, override, culprit
):
    monkeypatch.chdir(tmp_path)
    code, lines = _cli_error_lines(stage2_args(tiny_cityscapes, "mabn", *override), capsys)
    assert code == 2
    assert len(lines) == 1 and f".{culprit} (did you mean" in lines[0], lines
    assert not (tmp_path / "runs").exists()  # refused while parsing: no run folder, no data read


# 7. Bad input


@pytest.mark.parametrize(
    "present", [(), pytest.param(("leftImg8bit/train", "leftImg8bit/val"), marks=pytest.mark.slow)]
)
def test_missing_layout_exits_with_one_error_line(tiny_cityscapes, tmp_path, monkeypatch, capsys, present):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "not_cityscapes"
    root.mkdir()
    for folder in present:
        (root / folder).mkdir(parents=True)
    missing = root / ("gtFine" if present else "leftImg8bit") / "train"
    code, lines = _cli_error_lines(stage2_args(tiny_cityscapes, "bn", "--data.init_args.data_dir", str(root)), capsys)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert f"missing Cityscapes folder {missing}" in lines[0]
