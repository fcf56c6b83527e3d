"""The dry run builds what the fit builds and checks what the fit's setup checks (``mabn.cli.plan.build_task``):
every pair of encoder family, decoder and norm that docs/models.md offers gets the same verdict from ``--dry-run``
as from a 1-step fit, through the command a user runs; a choice that cannot train is one ``error:`` line in both.
The plan's checkpoint size is that of a saved checkpoint, and a checkpoint of the content of the one saved before it
is a hard link to it (``mabn.run.AtomicCheckpointIO``)."""

from __future__ import annotations

import itertools
import os
import re
import shutil

import pytest
import torch

from helpers.commands import run_mabn
from helpers.trainer import fit_flags, flags
from mabn.models import DECODERS
from mabn.run.files import DIGEST_KEY, AtomicCheckpointIO, intact

# One encoder of each family docs/models.md names: ResNet (the arch option), smp's ResNeXt, timm's RegNet,
# EfficientNet, MobileNetV3 and ResNet, torchvision's MobileNetV2, smp's own EfficientNet (same-padding convs), the
# mix transformers (LayerNorms only) and VGG (max pooling: no dilation).
ENCODERS = (
    "resnet18", "resnext50_32x4d", "tu-regnetx_002", "tu-efficientnet_b0", "tu-mobilenetv3_small_100", "tu-resnet18",
    "mobilenet_v2", "efficientnet-b0", "mit_b0", "vgg11",
)  # fmt: skip
NORMS = ("bn", "syncbn", "gn", "brn", "frozenbn", "mabn")
# Every pair of the three choices, each pair once with the third at its default (mabn, the ResNet, PSPNet): the
# verdicts come from pairs (an encoder a decoder cannot dilate, a pair smp refuses, a norm an encoder has no layer
# for), and the whole product would be 540 fits.
CASES = list(
    dict.fromkeys(
        [
            *((encoder, decoder, "mabn") for encoder, decoder in itertools.product(ENCODERS, DECODERS)),
            *((encoder, "pspnet", norm) for encoder, norm in itertools.product(ENCODERS, NORMS)),
            *(("resnet18", decoder, norm) for decoder, norm in itertools.product(DECODERS, NORMS)),
        ]
    )
)
# The default suite's sample: the two refusals the fit reported as a traceback (VGG at PSPNet's stride 8, a pair smp
# refuses), and MABN on an encoder without a norm it manages (its group drives nothing: the fit trains).
SAMPLE = [("vgg11", "pspnet", "mabn"), ("mit_b0", "unetplusplus", "mabn"), ("mit_b0", "segformer", "mabn")]
ONE_STEP = [
    *fit_flags(1, limit_val_batches=0, num_sanity_val_steps=0, logger=False),
    *flags("data.init_args", global_batch_size=4, num_workers=0, crop_size=32),
    *flags("model.init_args", log_predictions_every_n_epochs=0),
]


def _verdict(code: int, err: str) -> tuple[int, str | None]:
    """(exit status, the first ``error:`` line where the command stopped): a dry run names every problem, the launch's
    first, a run stops at its first."""
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    return code, lines[0] if code else None


@pytest.mark.parametrize(
    ("encoder", "decoder", "norm"),
    [pytest.param(*case, id="-".join(case), marks=() if case in SAMPLE else pytest.mark.slow) for case in CASES],
)
def test_the_dry_run_and_a_one_step_fit_give_the_same_verdict(
    encoder, decoder, norm, tiny_cityscapes, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    choice = ["--model.init_args.arch", encoder, "--model.init_args.decoder", decoder]
    argv = ["cityscapes", "--data", str(tiny_cityscapes), "--norm", norm, "--backbone", "none"]
    verdicts = []
    for dry in (True, False):
        run = ["--run-dir", str(tmp_path / ("dry" if dry else "fit")), *(["--dry-run"] if dry else [])]
        code, _, err = run_mabn([*argv, *run, "--", *ONE_STEP, *choice], capsys)
        assert code in (0, 2) and "Traceback" not in err, err[-3000:]
        verdicts.append(_verdict(code, err))
    assert verdicts[0] == verdicts[1]
    if (encoder, decoder) == ("vgg11", "pspnet") and norm != "syncbn":  # syncbn: the launch refuses first, on CPUs
        assert verdicts[1] == (2, f"error: encoder 'vgg11' does not run at output stride 8 ({_VGG}): pick a decoder "
                               "at output stride 32 or another encoder (docs/models.md, Encoders)")  # fmt: skip
    if (encoder, decoder, norm) == ("mit_b0", "segformer", "mabn"):
        assert verdicts[1] == (0, None)  # the encoder's group holds no MABN layer: the heads' train on


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("log_layers", "[model.nothing]", "error: norm_policy: log_layers ['model.nothing'] are not MABN2d/"),
        ("groups", "{encoder: {prefixes: [model.encoder]}, heads: {prefixes: [model.head]}}",
         "error: norm_policy: groups ['heads'] match no module of the model by name prefix: give each group"),
    ],
    ids=["log_layers", "groups"],
)  # fmt: skip
def test_a_norm_policy_that_names_nothing_of_the_model_stops_the_dry_run_and_the_fit_alike(
    setting, value, said, tiny_cityscapes, tmp_path, monkeypatch, capsys
):
    """MABNCallback's check of the model at the fit's setup, run by the dry run too: one line in both."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    argv = ["cityscapes", "--data", str(tiny_cityscapes), "--backbone", "none"]
    extra = ["--model.init_args.arch", "resnet18", f"--model.init_args.norm_policy.{setting}", value]
    for dry in (True, False):
        run = ["--run-dir", str(tmp_path / ("dry" if dry else "fit")), *(["--dry-run"] if dry else [])]
        code, _, err = run_mabn([*argv, *run, "--", *ONE_STEP, *extra], capsys)
        assert code == 2 and "Traceback" not in err, err[-3000:]
        assert _verdict(code, err)[1].startswith(said), err


_VGG = "'VGG' models do not support dilated mode due to Max Pooling operations for downsampling!"


def test_the_plans_checkpoint_size_is_the_saved_checkpoints(stage2_run, tmp_path, capsys):
    """The shared fit's plan (PSPNet on ResNet-18, MABN) says the size of its checkpoint within 2 %."""
    from helpers.fits import TINY

    argv = ["cityscapes", "--data", str(stage2_run.data), "--norm", "mabn", "--backbone", "none"]
    code, out, err = run_mabn([*argv, "--run-dir", str(tmp_path / "run"), "--dry-run", "--", *TINY], capsys)
    assert code == 0, err
    said = re.search(r"^checkpoint: ([\d.]+) MB a file \(weights and buffers ([\d.]+) MB", out, re.M)
    assert said, out
    size = stage2_run.checkpoint.stat().st_size
    assert abs(float(said[1]) * 1e6 - size) < 0.02 * size, (said[0], size)
    state = torch.load(stage2_run.checkpoint, weights_only=True)["state_dict"]
    weights = sum(t.numel() * t.element_size() for t in state.values())
    assert abs(float(said[2]) * 1e6 - weights) < 0.01 * weights, (said[0], weights)


def _checkpoint(step: int) -> dict:
    return {"global_step": step, "state_dict": {"w": torch.arange(1000.0) + step}, "optimizer_states": []}


def test_a_checkpoint_of_the_content_saved_just_before_is_a_hard_link_that_a_later_save_leaves_alone(tmp_path):
    io = AtomicCheckpointIO()
    best, last = tmp_path / "step4.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(4), best)
    io.save_checkpoint(_checkpoint(4), last)
    assert os.path.samefile(best, last) and best.stat().st_nlink == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
    io.save_checkpoint(_checkpoint(5), last)  # the next save of last.ckpt: the best keeps step 4
    assert not os.path.samefile(best, last)
    kept = io.load_checkpoint(best)
    assert kept["global_step"] == 4 and intact(kept) and DIGEST_KEY in kept
    assert io.load_checkpoint(last)["global_step"] == 5
    # Saved twice under the same name: one file, no temporary one beside it.
    io.save_checkpoint(_checkpoint(5), last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step4.ckpt"]
    # Another content, or the file changed since it was written: a file of its own.
    other = tmp_path / "other.ckpt"
    os.utime(last, ns=(0, 0))
    io.save_checkpoint(_checkpoint(5), other)
    assert not os.path.samefile(other, last) and io.load_checkpoint(other)["global_step"] == 5


def test_a_network_is_planned_once_a_process_until_a_file_it_names_changes(backbones, tmp_path, monkeypatch):
    """``NormTask.planned_sizes`` builds a network once per process (a sweep's dry runs, the tests): the same
    arguments again take the sizes planned, a backbone file rewritten in place or replaced by another is read
    again, and a check that fails is raised each time (a file that is missing, then written, is then built)."""
    from mabn.errors import ConfigError
    from mabn.tasks.segmentation import SegmentationTask

    built = []
    build = SegmentationTask.build_unweighted.__func__
    monkeypatch.setattr(
        SegmentationTask, "build_unweighted", classmethod(lambda c, hp: built.append(1) or build(c, hp))
    )
    backbone = tmp_path / "resnet18-bn.pt"
    hp = {"arch": "resnet18", "norm": "bn", "num_classes": 3, "backbone": str(backbone)}
    for _ in range(2):
        with pytest.raises(ConfigError, match=re.escape(str(backbone))):
            SegmentationTask.planned_sizes(hp)
    assert len(built) == 2
    backbone.write_bytes(backbones.stage1("bn", "resnet18").read_bytes())
    first = SegmentationTask.planned_sizes(hp)
    assert SegmentationTask.planned_sizes(dict(hp)) == first and len(built) == 3
    assert first.params > 11_000_000 and first.weights > 4 * first.params  # ResNet-18 in float32, and its head
    stat = backbone.stat()
    os.utime(backbone, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten, same size
    assert SegmentationTask.planned_sizes(hp) == first and len(built) == 4
    shutil.copy2(backbone, tmp_path / "new.pt")  # another file of the same size and time, moved over it
    os.replace(tmp_path / "new.pt", backbone)
    assert SegmentationTask.planned_sizes(hp) == first and len(built) == 5
