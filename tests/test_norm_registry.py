"""One entry per norm: a norm registered through one ``NormEntry`` is taken wherever the code takes a norm by name
(create_norm, convert_norm, fold_norms, the backbone rules, the launch checks, the cost tables), and an unknown
name meets one error naming the known norms."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mabn
from helpers import own_dataset
from helpers.commands import run_mabn
from helpers.fits import TINY
from mabn.callbacks.syncbn import has_sync_batchnorm
from mabn.cli import launch
from mabn.errors import ConfigError
from mabn.inference import export
from mabn.models import resnet
from mabn.models.backbone import STAGE1, TORCHVISION, Backbone, BackboneError, adapt_statistics, check_fits
from mabn.models.resnet import norm_kwargs_for
from mabn.norm import (
    NORM_PRESETS,
    NORMS,
    CenConv2d,
    NormEntry,
    check_norm,
    convert_norm,
    create_norm,
    fold_norms,
    register_norm,
    unregister_norm,
)
from mabn.run.memory import ACTIVATION_BYTES
from mabn.tasks import SegmentationTask
from mabn.tasks.base import NormTask
from mabn.tasks.memory import per_pixel
from mabn.tools.bench import infer, step
from mabn.tools.bench import norm as norm_bench


class ToyNorm2d(nn.Module):
    """x * weight / sqrt(E[x^2] + eps) + bias per channel: the second moment of each (ghost) batch in training, a
    running one at inference, so it is linear there."""

    def __init__(self, channels: int, eps=1e-5, momentum=None, norm_batch_size=None, gain=1.0) -> None:
        super().__init__()
        self.num_features, self.eps, self.norm_batch_size, self.gain = channels, eps, norm_batch_size, gain
        self.momentum = 0.9 if momentum is None else momentum
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_sq", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        if not self.training:
            return x * (self.scale()).view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)
        groups = x.split(self.norm_batch_size or x.shape[0])
        sq = torch.stack([g.pow(2).mean((0, 2, 3)) for g in groups])
        with torch.no_grad():
            self.running_sq.mul_(self.momentum).add_((1 - self.momentum) * sq.mean(0))
        out = [g * (self.gain * self.weight / (s + self.eps).sqrt()).view(1, c, 1, 1) for g, s in zip(groups, sq)]
        return torch.cat(out) + self.bias.view(1, c, 1, 1)

    def scale(self) -> torch.Tensor:
        return self.gain * self.weight / (self.running_sq + self.eps).sqrt()


class SyncToyNorm2d(ToyNorm2d):
    """The toy as a norm that synchronizes across devices (its entry's ``sync``)."""


def _toy(channels, *, eps, momentum, norm_batch_size, **options):
    return ToyNorm2d(channels, eps=eps, momentum=momentum, norm_batch_size=norm_batch_size, **options)


def _sync_toy(channels, *, eps, momentum, norm_batch_size, **options):
    return SyncToyNorm2d(channels, eps=eps, momentum=momentum, norm_batch_size=norm_batch_size, **options)


TOY = NormEntry(
    "toy",
    "second-moment norm of the registry test",
    _toy,
    (ToyNorm2d,),
    batch=True,
    inference_affine=lambda m: (m.scale(), m.bias),
    # BN's statistics as the toy keeps them: its second moment var + mean^2
    from_bn=lambda bn, layer: layer.running_sq.copy_(bn.running_var + bn.running_mean.square()),
    cost_family="bn",
    steady_state={"gain": 1.0},
)
SYNC_TOY = dataclasses.replace(
    TOY,
    name="toy_sync",
    build=_sync_toy,
    layers=(SyncToyNorm2d,),
    sync=True,
    steady_state=None,
    from_bn=None,
)


@pytest.fixture
def toy():
    """The toy norms registered for one test, and gone after it, whatever it did."""
    register_norm(TOY)
    register_norm(SYNC_TOY)
    try:
        yield TOY
    finally:
        unregister_norm("toy")
        unregister_norm("toy_sync")
    assert "toy" not in NORMS and "toy" not in NORM_PRESETS and "toy_sync" not in NORM_PRESETS


def _net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6)
    )


def test_create_norm_builds_the_registered_layer_with_its_options(toy):
    layer = create_norm("toy", 8, eps=1e-3, momentum=0.5, norm_batch_size=2, gain=2.0)
    assert type(layer) is ToyNorm2d
    assert (layer.eps, layer.momentum, layer.norm_batch_size, layer.gain) == (1e-3, 0.5, 2, 2.0)
    with pytest.raises(TypeError, match="buffer_size"):
        create_norm("toy", 8, buffer_size=4)


def test_convert_norm_swaps_every_batchnorm_for_the_registered_layer_and_keeps_state(toy):
    model = _net()
    with torch.no_grad():
        model[1].weight.fill_(3.0)
    convert_norm(model, "toy", norm_batch_size=2)
    assert [type(m) for m in model if not isinstance(m, nn.Conv2d | nn.ReLU)] == [ToyNorm2d, ToyNorm2d]
    assert model[1].weight.eq(3.0).all() and model[4].norm_batch_size == 2
    assert not any(isinstance(m, CenConv2d) for m in model.modules())  # the entry centres nothing
    centred = convert_norm(_net(), "toy", centralize_weights=True)
    assert sum(isinstance(m, CenConv2d) for m in centred.modules()) == 2  # both convs feed a toy norm


def test_convert_norm_carries_bn_statistics_as_the_entry_says(toy):
    """The toy's entry takes BN's statistics as a second moment (``from_bn``): convert_norm carries them so; the
    synchronized toy's entry takes none, and its layers keep their start."""
    torch.manual_seed(0)
    model = _net()
    for _ in range(3):
        model(torch.randn(4, 3, 8, 8) * 2 + 1)  # BN's running statistics away from their start
    mean, var = model[4].running_mean.clone(), model[4].running_var.clone()
    converted = convert_norm(copy.deepcopy(model), "toy")
    torch.testing.assert_close(converted[4].running_sq, var + mean * mean, rtol=0, atol=1e-6)
    assert convert_norm(copy.deepcopy(model), "toy_sync")[4].running_sq.eq(1.0).all()
    # A BN backbone's state dict for a toy encoder: the toy's buffer in place of BN's, the weights as they were.
    state = adapt_statistics(model.state_dict(), converted, eps=1e-5)
    assert "4.running_var" not in state and "4.running_mean" not in state
    torch.testing.assert_close(state["4.running_sq"], var + mean * mean, rtol=0, atol=1e-6)
    converted.load_state_dict(state, strict=True)
    # A source already in the layer's form (BN for BN) loads as it is, its count of batches included.
    same = adapt_statistics(model.state_dict(), model, eps=1e-5)
    assert same.keys() == model.state_dict().keys()
    assert all(torch.equal(same[key], value) for key, value in model.state_dict().items())


def test_fold_norms_folds_the_registered_norm_by_its_entrys_affine(toy):
    torch.manual_seed(0)
    model = convert_norm(_net(), "toy")
    for _ in range(3):
        model(torch.randn(4, 3, 8, 8) * 2 + 1)  # running statistics away from their start
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ToyNorm2d):
                m.weight.uniform_(0.5, 2.0)
                m.bias.uniform_(-1.0, 1.0)
    folded = fold_norms(model.double())  # float64 throughout, so the comparison is exact up to rounding
    assert not any(isinstance(m, ToyNorm2d) for m in folded.modules())
    assert all(m.bias is not None for m in folded.modules() if isinstance(m, nn.Conv2d))
    # Reference: the eval model in float64, the toy layer's own forward.
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    expected = model.eval()(x)
    torch.testing.assert_close(folded(x), expected, rtol=1e-10, atol=1e-10)


def test_the_backbone_rules_read_the_entry(toy):
    """A BN backbone starts a norm that takes BN statistics; a file of the toy (no BN statistics) starts no BN
    encoder, and the refusal lists the norms a BN backbone fits, the toy among them."""
    bn = Backbone(Path("resnet101.pt"), TORCHVISION, "bn", False, 1e-5, {}, {})
    check_fits(bn, "toy")
    own = Backbone(Path("toy.pt"), STAGE1, "toy", False, 1e-5, {}, {})
    with pytest.raises(BackboneError, match=r"a BN backbone fits bn, syncbn, brn, frozenbn, toy\b"):
        check_fits(own, "bn")
    assert norm_kwargs_for("toy", 2, {"toy": {"gain": 2.0}}) == {"gain": 2.0, "norm_batch_size": 2}
    net = resnet("toy", num_classes=10, norm_batch_size=2, arch="resnet18")
    layers = [m for m in net.modules() if isinstance(m, ToyNorm2d)]
    assert len(layers) == 20 and all(m.norm_batch_size == 2 for m in layers)


def test_the_launch_checks_read_the_entry(toy):
    assert launch.norm_args("toy", 1, 1, cuda=False) == []
    with pytest.raises(launch.LaunchError, match="NORM=toy_sync synchronizes BatchNorm across GPUs"):
        launch.norm_args("toy_sync", 1, 1, cuda=True)
    with pytest.raises(launch.LaunchError, match="NORM=toy_sync needs GPUs"):
        launch.norm_args("toy_sync", 2, 1, cuda=False)
    assert launch.norm_args("toy_sync", 2, 1, cuda=True) == ["--trainer.sync_batchnorm", "true"]
    assert has_sync_batchnorm(convert_norm(_net(), "toy_sync")) and not has_sync_batchnorm(convert_norm(_net(), "toy"))
    NormTask.check_hparams({"norm": "toy"})  # a known norm


def test_the_cost_tables_take_the_registered_norm(toy):
    assert norm_bench.compared() == ("brn", "mabn", "toy") and step.benched() == ("bn", "gn", "brn", "mabn", "toy")
    assert infer.models() == ("bn", "brn", "mabn", "toy", "gn")  # folded first
    assert (
        per_pixel(SegmentationTask.settings({"norm": "toy", "arch": "resnet101"}))
        == ACTIVATION_BYTES[("resnet101", "bn")]
    )
    table = norm_bench.run(torch.device("cpu"), repeats=1, shapes=[("tiny ghost", 4, 8, 6, 6, 2)])
    header, row = (line for line in table.splitlines() if line.startswith("| layer") or line.startswith("| tiny"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert "TOY / BN time" in cells and "TOY / BN peak mem" in cells
    values = [c.strip() for c in row.strip("|").split("|")]
    assert len(values) == len(cells)
    toy_time = float(values[cells.index("TOY / BN time")])
    assert math.isfinite(toy_time) and toy_time > 0


def test_one_membership_check_names_the_known_norms(toy):
    assert check_norm("toy").kind == "toy"
    with pytest.raises(
        ValueError, match=r"^unknown norm 'tyo'; choose one of bn, brn, frozenbn, gn, mabn, .*toy, toy_sync$"
    ):
        create_norm("tyo", 4)
    with pytest.raises(ValueError, match="toy_sync"):
        convert_norm(_net(), "tyo")
    with pytest.raises(ValueError, match="register_norm: norm 'toy' exists already"):
        register_norm(TOY)


def test_an_unregistered_norm_is_unknown_everywhere():
    register_norm(TOY)
    unregister_norm("toy")
    for refused in (lambda: create_norm("toy", 4), lambda: convert_norm(_net(), "toy"), lambda: norm_kwargs_for("toy")):
        with pytest.raises(ValueError, match="unknown norm 'toy'"):
            refused()
    with pytest.raises(ConfigError, match="norm='toy': unknown norm 'toy'"):
        NormTask.check_hparams({"norm": "toy"})
    assert "toy" not in norm_bench.compared() and "toy" not in step.benched()
    assert not any(NORMS[n].layers == (ToyNorm2d,) for n in NORMS)


def test_the_lists_of_norms_for_users_name_every_registered_norm():
    """``--norm``'s help is made from the registry; the Makefile's NORM line is written by hand, and names each."""
    from mabn.cli.commands import stage

    assert all(name in stage.norm_help() for name in NORM_PRESETS)
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    line = next(line for line in makefile.splitlines() if "NORM: " in line)
    listed = set(re.findall(r"[a-z_]+", line.split("NORM: ", 1)[1]))
    assert set(NORMS) <= listed, f"the Makefile's NORM line lacks {sorted(set(NORMS) - listed)}"


@pytest.mark.slow  # a fit and the four readers of its checkpoint
def test_a_registered_norm_trains_and_its_checkpoint_is_tested_predicted_loaded_and_exported(toy, tmp_path, capsys):
    """A norm added through ``register_norm`` alone goes the whole way: a 2-step ``segment`` fit with it, then
    ``test``, ``predict``, ``mabn.load(...).predict`` and ``export``, whose folded model has no toy layer left."""
    data = own_dataset.bands(tmp_path / "data", train=4)
    run = tmp_path / "run"
    argv = ["segment", "--data", str(data), "--norm", "toy", "--backbone", "none", "--run-dir", str(run), "--", *TINY]
    code, _, err = run_mabn(argv, capsys)
    assert code == 0, err
    ckpt = run / "checkpoints" / "last.ckpt"
    code, out, err = run_mabn(["test", str(ckpt), "--num-workers", "0"], capsys)
    assert code == 0 and "| road |" in out, err
    code, _, err = run_mabn(
        ["predict", str(ckpt), "--split", "val", "--out", str(tmp_path / "p"), "--num-workers", "0"], capsys
    )
    assert code == 0 and len(list((tmp_path / "p" / "masks").iterdir())) == own_dataset.VAL, err
    segmenter = mabn.load(ckpt, device="cpu")
    assert any(isinstance(m, ToyNorm2d) for m in segmenter.task.modules())
    assert segmenter.predict(np.zeros((40, 56, 3), np.uint8)).shape == (40, 56)
    result = export.export(ckpt, tmp_path / "exported", (64, 64), formats=("torchscript",))
    assert result.folded.relative < 1e-10
