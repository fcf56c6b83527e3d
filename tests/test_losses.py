"""Stage 2's losses (``mabn.tasks.losses``, ``SegmentationTask``'s ``loss`` and ``class_weights``): each loss held to
its formula, written here in float64 from the papers, on a hand-made batch with ignored pixels (which change
nothing); OHEM's threshold and minimum kept; the class weights of ``classes.yaml`` and of the training pixels per
class; the dry run's loss and weights lines; and 2-step fits of ``python -m mabn segment`` with each loss (one in
the default suite, the others slow)."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.commands import run_mabn
from helpers.host_reads import HostReads
from helpers.own_dataset import bands, line, segment
from helpers.trainer import fit_flags
from mabn.data.classes import ClassTable
from mabn.data.errors import DatasetError
from mabn.data.folder import FolderDataModule
from mabn.errors import ConfigError
from mabn.inference.checkpoint import task_hparams
from mabn.tasks import SegmentationTask
from mabn.tasks.class_weights import inverse_log_weights, resolve_class_weights
from mabn.tasks.losses import (
    LOSSES,
    OhemOptions,
    build_loss,
    check_loss,
    from_checkpoint,
    register_loss,
    unregister_loss,
)

IGNORE = 255
K = 4  # classes; class 3 has no labelled pixel in the batch


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (2, K, 3, 4) and labels with ignored pixels, of classes 0..2 only."""
    g = torch.Generator().manual_seed(3)
    logits = 2.0 * torch.randn(2, K, 3, 4, generator=g)
    labels = torch.tensor(
        [
            [[0, 1, 2, IGNORE], [1, 1, 0, 2], [IGNORE, 0, 2, 2]],
            [[2, 0, IGNORE, 1], [0, 0, 1, IGNORE], [2, 1, 1, 0]],
        ]
    )
    return logits, labels


def _flat(logits: torch.Tensor, labels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(the labelled pixels' logits, P x K float64; their classes, P)."""
    z = logits.double().permute(0, 2, 3, 1).reshape(-1, logits.shape[1]).numpy()
    y = labels.reshape(-1).numpy()
    keep = y != IGNORE
    return z[keep], y[keep]


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _weighted_mean(values: list[float], weights: list[float] | None) -> float:
    w = np.ones(len(values)) if weights is None else np.asarray(weights, dtype=np.float64)
    return float((np.asarray(values) * w).sum() / w.sum())


def ref_ce(logits, labels, weights=None) -> float:
    """sum_i w_{y_i} (-log p_{i, y_i}) / sum_i w_{y_i} over the labelled pixels i."""
    z, y = _flat(logits, labels)
    nll = -np.log(_softmax(z)[np.arange(len(y)), y])
    w = np.ones(K) if weights is None else np.asarray(weights, dtype=np.float64)
    return float((w[y] * nll).sum() / w[y].sum())


def ref_dice(logits, labels, weights=None, smooth=0.0) -> float:
    """Per class c over the batch, as smp's soft Dice score writes it: 1 - (I + smooth) / ((P + T) / 2 + smooth),
    I = sum p_c [y=c], P = sum p_c, T = sum [y=c]; 0 for a class with no labelled pixel; the (weighted) mean over
    the classes."""
    z, y = _flat(logits, labels)
    p = _softmax(z)
    per_class = []
    for c in range(K):
        t = (y == c).astype(np.float64)
        dice = ((p[:, c] * t).sum() + smooth) / ((p[:, c].sum() + t.sum()) / 2 + smooth)
        per_class.append(1.0 - dice if t.any() else 0.0)
    return _weighted_mean(per_class, weights)


def ref_focal(logits, labels, weights=None, gamma=2.0) -> float:
    """Per class c, one against the rest on its logit: mean over the labelled pixels of -(1 - q)^gamma log q, q the
    sigmoid's probability of the pixel's truth (is it c or not); the (weighted) mean over the classes."""
    z, y = _flat(logits, labels)
    per_class = []
    for c in range(K):
        s = 1.0 / (1.0 + np.exp(-z[:, c]))
        q = np.where(y == c, s, 1.0 - s)
        per_class.append(float((-((1.0 - q) ** gamma) * np.log(q)).mean()))
    return _weighted_mean(per_class, weights)


def ref_lovasz(logits, labels) -> float:
    """Lovász-Softmax (Berman et al. 2018): per class c present, the errors e_i = |[y_i=c] - p_ic| sorted down, and
    sum_k e_(k) (J_k - J_{k-1}), J_k the Jaccard loss 1 - |F \\ top-k| / |F U top-k| of the class's pixels F
    against the k pixels of largest error taken as predicted c; the mean over the classes present."""
    z, y = _flat(logits, labels)
    p = _softmax(z)
    per_class = []
    for c in range(K):
        fg = y == c
        if not fg.any():
            continue
        errors = np.abs(fg - p[:, c])
        order = np.argsort(-errors, kind="stable")
        total, previous, loss = fg.sum(), 0.0, 0.0
        for k in range(1, len(order) + 1):
            top = order[:k]
            inside = fg[top].sum()
            jaccard = 1.0 - (total - inside) / (total + (k - inside))
            loss += errors[order[k - 1]] * (jaccard - previous)
            previous = jaccard
        per_class.append(loss)
    return float(np.mean(per_class))


def ref_ohem(logits, labels, thresh, min_kept, weights=None) -> tuple[float, int]:
    """(the (weighted) mean cross-entropy over the kept pixels, how many): a labelled pixel is kept where p_true <
    thresh or where it is among the min_kept x N of lowest p_true (ties at the cut kept)."""
    z, y = _flat(logits, labels)
    p_true = _softmax(z)[np.arange(len(y)), y]
    count = min(min_kept * logits.shape[0], len(y))
    cut = np.sort(p_true)[count - 1]
    kept = (p_true < thresh) | (p_true <= cut)
    w = (np.ones(K) if weights is None else np.asarray(weights, dtype=np.float64))[y] * kept
    return float((w * -np.log(p_true)).sum() / w.sum()), int(kept.sum())


WEIGHTS = [0.5, 2.0, 1.0, 3.0]


@pytest.mark.parametrize(
    ("name", "reference", "weights"),
    [
        ("ce", ref_ce, None),
        ("ce", ref_ce, WEIGHTS),
        ("dice", ref_dice, None),
        ("dice", ref_dice, WEIGHTS),
        ("focal", ref_focal, None),
        ("focal", ref_focal, WEIGHTS),
        ("lovasz", ref_lovasz, None),
    ],
)
def test_each_loss_is_its_formula_and_leaves_ignored_pixels_out(name, reference, weights):
    logits, labels = _batch()
    loss = build_loss(name, weights)
    expected = reference(logits, labels) if weights is None else reference(logits, labels, weights)
    assert loss(logits, labels).item() == pytest.approx(expected, rel=1e-5)
    # The ignored pixels' logits change nothing.
    ignored = (labels == IGNORE).unsqueeze(1)
    moved = torch.where(ignored, logits + 7.0 * torch.randn(logits.shape), logits)
    assert loss(moved, labels).item() == pytest.approx(loss(logits, labels).item(), rel=1e-6)


def test_a_weighted_sum_is_the_sum_of_its_terms_and_the_default_is_cross_entropy():
    logits, labels = _batch()
    total = build_loss({"ce": 1.0, "dice": 0.5})(logits, labels).item()
    assert total == pytest.approx(ref_ce(logits, labels) + 0.5 * ref_dice(logits, labels), rel=1e-5)
    task = SegmentationTask(num_classes=K, arch="resnet18", norm="bn", log_predictions_every_n_epochs=0)
    assert task.criterion(logits, labels).item() == pytest.approx(ref_ce(logits, labels), rel=1e-6)


def test_the_auxiliary_head_takes_the_same_loss_at_its_weight():
    task = SegmentationTask(
        num_classes=K, arch="resnet18", norm="bn", norm_batch_size=None, dropout=0.0, loss="dice", aux_weight=0.25
    )
    images, labels = torch.randn(2, 3, 24, 24), torch.randint(0, K, (2, 24, 24))
    labels[:, :4] = IGNORE
    with torch.no_grad():
        main, aux = task.model(images)  # batch statistics in training mode: the step's forward gives the same
        loss = task.training_step((images, labels), 0)
    assert loss.item() == pytest.approx(ref_dice(main, labels) + 0.25 * ref_dice(aux, labels), rel=1e-5)


@pytest.mark.parametrize("name", ["ce", "dice", "focal", "lovasz", "ohem"])
def test_a_batch_of_ignored_pixels_only_trains_nothing(name):
    logits = torch.randn(1, K, 2, 2, requires_grad=True)
    loss = build_loss(name)(logits, torch.full((1, 2, 2), IGNORE))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize(
    ("name", "weights", "reads"),
    [
        ("ce", None, False),
        ("ce", [1.0, 2.0, 0.5, 1.0], False),
        ("ohem", None, True),
        ("focal", None, True),
        ("lovasz", None, True),
    ],
    ids=["ce", "ce weighted", "ohem", "focal", "lovasz"],
)  # not dice: smp's one_hot checks the labels on the host on the CPU, where a GPU's leaves it to its kernel
def test_the_loss_reads_the_host_as_its_entry_says(name, weights, reads, monkeypatch):
    """The recipe's cross-entropy, weighted or not, reads nothing from the device in a step's forward and backward;
    OHEM, Focal and Lovász do, as their entries' ``host_reads`` say (and docs/training.md's table, held to them
    below; ``helpers.host_reads``)."""
    assert bool(LOSSES[name].host_reads) == reads
    logits, labels = _batch()
    logits.requires_grad_()
    recorder = HostReads()
    recorder.install(monkeypatch)
    with recorder.recording():
        build_loss(name, weights)(logits, labels).backward()
    monkeypatch.undo()
    assert bool(recorder.reads) == reads, recorder.reads


@pytest.mark.parametrize(
    ("thresh", "min_kept", "kept"),
    [
        (0.5, 2, None),  # the threshold keeps more than 2 x 2 pixels
        (1e-6, 3, 6),  # no pixel under the threshold: the 3 x 2 hardest
        (1e-6, 50, 20),  # more asked than labelled: every labelled pixel
    ],
)
def test_ohem_keeps_the_pixels_under_the_threshold_and_at_least_min_kept(thresh, min_kept, kept):
    logits, labels = _batch()
    for weights in (None, WEIGHTS):
        expected, count = ref_ohem(logits, labels, thresh, min_kept, weights)
        loss = build_loss({"ohem": {"thresh": thresh, "min_kept": min_kept}}, weights)
        assert loss(logits, labels).item() == pytest.approx(expected, rel=1e-5)
        assert count == kept if kept is not None else count > 2 * min_kept
    if min_kept * 2 < count:  # as mmsegmentation keeps distinct probabilities: p < max(p_(min_kept x N), thresh)
        z, y = _flat(logits, labels)
        p_true = _softmax(z)[np.arange(len(y)), y]
        assert count == (p_true < max(np.sort(p_true)[min_kept * 2], thresh)).sum()


def test_ohem_keeps_min_kept_through_a_tie_at_the_cut():
    # Every pixel has p_true = 1/K: mmsegmentation's strict p < cut would keep none; every one is kept here.
    logits, labels = torch.zeros(1, K, 2, 3), torch.tensor([[[0, 1, 2], [3, 0, IGNORE]]])
    loss = build_loss({"ohem": {"thresh": 0.1, "min_kept": 2}})
    assert loss(logits, labels).item() == pytest.approx(math.log(K), rel=1e-6)


def test_the_loss_arguments_are_refused_in_one_line():
    for args, named in [
        (("dyce", None), "loss 'dyce' is not a loss; choose one of ce, dice, focal, lovasz, ohem, or module.name"),
        (({"ce": 1.0, "dice": 0}, None), "the weight of dice must be a number > 0"),
        (({"ce": 1.0, "dice": {"weight": -1}}, None), "the weight of dice must be a number > 0"),
        (({}, None), "loss={}"),
        (("ce", "median"), "class_weights='median'"),
        (("ce", [1.0, -1.0]), "class_weights=[1.0, -1.0]"),
        (("ce", [1e308, 1.0]), "class_weights=[1e+308, 1.0]: 1e+308 is outside [1e-06, 1e+06]"),
        (("ce", [1.0, 1e-300]), "class_weights=[1.0, 1e-300]: 1e-300 is outside [1e-06, 1e+06]"),
        (("lovasz", "counts"), "loss lovasz takes no class weights"),
        (({"ohem": {"thresh": 1.5}}, None), "ohem's thresh=1.5: a probability in (0, 1]"),
        (({"ohem": {"min_kept": 0}}, None), "ohem's min_kept=0: a whole number of pixels per image"),
        (({"ohem": {"min_kept": 2.5}}, None), "ohem's min_kept=2.5 is not of type"),
        (({"ohem": {"min_kep": 5}}, None), "ohem has no option 'min_kep'; its options are weight, thresh, min_kept"),
        (({"ce": {"smooth": 1.0}}, None), "ce takes no options, got smooth"),
        (({"dice": {"smooth": True}}, None), "dice's smooth=True is not of type"),
        (("no_such_module.tversky", None), "cannot import module 'no_such_module'"),
        (("math.tversky", None), "module 'math' registers no loss 'tversky'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(named)) as caught:
            check_loss(*args)
        assert "\n" not in str(caught.value)


def test_the_options_of_dice_and_focal_reach_their_formulas():
    logits, labels = _batch()
    dice = build_loss({"dice": {"smooth": 1.0}})(logits, labels).item()
    assert dice == pytest.approx(ref_dice(logits, labels, smooth=1.0), rel=1e-5)
    assert abs(ref_dice(logits, labels, smooth=1.0) - ref_dice(logits, labels)) > 1e-3  # the option changes it
    focal = build_loss({"focal": {"gamma": 0.5, "weight": 2.0}}, WEIGHTS)(logits, labels).item()
    assert focal == pytest.approx(2.0 * ref_focal(logits, labels, WEIGHTS, gamma=0.5), rel=1e-5)
    assert abs(ref_focal(logits, labels, gamma=0.5) - ref_focal(logits, labels)) > 1e-3


def test_ohem_keeps_a_share_of_the_crop_unless_min_kept_is_given():
    # mmsegmentation's 100000 of a 512 x 1024 crop (524288 pixels): 100000 x 14400 / 524288 = 2746.6 at 120 x 120,
    # 100000 x 508369 / 524288 = 96963.7 at 713 x 713, 100000 x 16 / 524288 = 3.05 at 4 x 4.
    assert OhemOptions().kept(120) == 2747 and OhemOptions().kept(713) == 96964 and OhemOptions().kept(4) == 3
    assert OhemOptions().kept(None) == 100_000  # a task built outside a fit: the reference's count
    assert OhemOptions(min_kept=64).kept(120) == 64
    logits, labels = _batch()  # 2 images of 12 pixels; no pixel under the threshold 1e-6: the 3 x 2 hardest
    expected, count = ref_ohem(logits, labels, 1e-6, 3)
    assert count == 6
    loss = build_loss({"ohem": {"thresh": 1e-6}}, crop=4)
    assert loss(logits, labels).item() == pytest.approx(expected, rel=1e-5)


def test_ohem_at_a_small_crop_says_what_it_keeps(banded, tmp_path, capsys):
    """The crop of ``banded`` is 40x40 (1600 pixels): OHEM keeps 19.1 % of it, 1600 x 100000 / 524288 = 305.2; a
    min_kept of 2000 keeps every pixel, which the plan says."""
    batch = ["--data.init_args.global_batch_size", "4"]
    code, out, err = segment(banded, tmp_path / "run", capsys, "--model.init_args.loss", "ohem", *batch)
    assert code == 0, err
    assert line(out, "loss:") == (
        "loss: OHEM cross-entropy (pixels of true-class probability < 0.7, at least the hardest 19.1 % of each crop); "
        "main head + 0.4 x auxiliary head"
    )
    assert line(out, "ohem:") == (
        "ohem: keeps the pixels of true-class probability < 0.7, and at least the 305 hardest of each 40x40 crop's "
        "1600 (19.1 % of the crop: mmsegmentation's 100000 of 512x1024)"
    )
    loss = ["--model.init_args.loss", "{ohem: {min_kept: 2000}}"]
    code, out, err = segment(banded, tmp_path / "run", capsys, *loss, *batch)
    assert code == 0, err
    assert line(out, "warning: ohem") == (
        "warning: ohem keeps at least 2000 pixels per image, every pixel of a 40x40 crop (1600): the loss is plain "
        "cross-entropy; give min_kept below 1600, or null for 19.1 % of the crop (305), --model.init_args.loss "
        "'{ohem: {min_kept: null}}'"
    )
    code, out, err = segment(
        banded, tmp_path / "run", capsys, "--model.init_args.loss", "{ohem: {min_kept: null}}", *batch
    )
    assert code == 0 and line(out, "ohem:").startswith(
        "ohem: keeps the pixels of true-class probability < 0.7, and at least the 305 "
    )


def test_ohems_old_task_arguments_are_refused_naming_its_options(banded, tmp_path, capsys):
    code, out, err = segment(banded, tmp_path / "run", capsys, "--model.init_args.ohem_min_kept", "64")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: unrecognized argument --model.init_args.ohem_min_kept (moved: an option of the ohem loss, "
        "--model.init_args.loss '{ohem: {min_kept: 2000}}'); python -m mabn fit --help lists the arguments"
    )


def test_a_checkpoint_with_ohems_task_arguments_rebuilds_with_them_as_its_options():
    old = {"loss": "ohem", "ohem_thresh": 1e-6, "ohem_min_kept": 3, "num_classes": K}
    assert from_checkpoint(old) == {"loss": {"ohem": {"thresh": 1e-6, "min_kept": 3, "weight": 1.0}}, "num_classes": K}
    summed = {"loss": {"ohem": 1.0, "dice": 0.5}, "ohem_thresh": 0.7, "ohem_min_kept": 100000}
    assert from_checkpoint(summed) == {
        "loss": {"ohem": {"thresh": 0.7, "min_kept": 100000, "weight": 1.0}, "dice": 0.5}
    }
    assert from_checkpoint({"loss": "ce", "ohem_thresh": 0.7, "ohem_min_kept": 100000}) == {"loss": "ce"}
    task = SegmentationTask(**task_hparams(old), arch="resnet18", norm="bn", log_predictions_every_n_epochs=0)
    logits, labels = _batch()
    assert task.criterion(logits, labels).item() == pytest.approx(ref_ohem(logits, labels, 1e-6, 3)[0], rel=1e-5)


def test_the_docs_and_the_help_list_the_registrys_losses_and_which_read_the_host(capsys):
    """docs/training.md's table has one row per loss of the registry, and says "yes" in its host-read column where
    the entry reads the host; ``--model.init_args.loss``'s help names every loss."""
    text = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    section = text.split("## Losses and class weights", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]* \| (yes|no)[^|]* \|", section, re.M)
    assert [name for name, _ in rows] == list(LOSSES)
    for name, reads in rows:
        assert (reads == "yes") == bool(LOSSES[name].host_reads), name
    code, out, _ = run_mabn(["fit", "--model.help", "mabn.tasks.SegmentationTask"], capsys)
    assert code == 0
    help_text = " ".join(out.split("  --model.loss LOSS ", 1)[1].split("--model.class_weights")[0].split())
    assert f"a loss name ({', '.join(LOSSES)};" in help_text


def test_register_loss_refuses_a_name_taken_or_dotted_and_an_option_named_weight():
    @dataclasses.dataclass(frozen=True)
    class Weighted:
        weight: float = 1.0

    for entry, said in [
        (LOSSES["ce"], "loss 'ce' exists already"),
        (dataclasses.replace(LOSSES["ce"], name="my.ce"), "loss name 'my.ce' is not an identifier"),
        (dataclasses.replace(LOSSES["ce"], name="ce2", options=Weighted), "an option named 'weight'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(said)):
            register_loss(entry)
    assert list(LOSSES) == ["ce", "dice", "focal", "lovasz", "ohem"]


def test_class_weights_from_counts_are_the_inverse_log_of_the_shares():
    # shares 0.6, 0.3, 0.1 and 0: 1 / ln(1.02 + share)
    assert inverse_log_weights([60, 30, 10, 0]) == pytest.approx([2.072856, 3.601894, 8.823891, 50.498350], rel=1e-6)


def test_classes_yaml_gives_weights_and_refuses_bad_ones_in_one_line():
    table = ClassTable.parse({"classes": ["sky", "road"], "weights": [1, 2.5]})
    assert table.weights == (1.0, 2.5)
    assert ClassTable.from_dict(table.as_dict()) == table
    colour = ClassTable.parse({"classes": ["sky", "road"], "mask_format": "color", "weights": [3, 1]})
    assert colour.weights == (3.0, 1.0)
    assert ClassTable.parse({"classes": ["sky", "road"]}).weights is None
    for bad in ([1.0], [1.0, 0.0], [1.0, "x"], [True, 1.0], [1.0, float("inf")], 2.0):
        with pytest.raises(DatasetError, match=r"weights must hold one number > 0 per class, 2 in all") as caught:
            ClassTable.parse({"classes": ["sky", "road"], "weights": bad}, "d/classes.yaml")
        assert "\n" not in str(caught.value) and "d/classes.yaml" in str(caught.value)
    for far, shown in ((1.0e308, "1e+308"), (1.0e7, "10000000.0"), (1.0e-30, "1e-30")):
        with pytest.raises(DatasetError, match=rf"weights: {re.escape(shown)} is outside \[1e-06, 1e\+06\]"):
            ClassTable.parse({"classes": ["sky", "road"], "weights": [1.0, far]}, "d/classes.yaml")
    assert ClassTable.parse({"classes": ["sky", "road"], "weights": [1e-6, 1e6]}).weights == (1e-6, 1e6)


def test_class_weights_come_from_one_place():
    names = ["sky", "road"]
    assert resolve_class_weights(None, names, None, "c.yaml", [1, 1]) == (None, "")
    assert resolve_class_weights(None, names, (1.0, 3.0), "c.yaml", None) == ([1.0, 3.0], "weights of c.yaml")
    assert resolve_class_weights([2, 1], names, None, "c.yaml", None) == ([2.0, 1.0], "as given")
    for args, named in [
        (("counts", names, (1.0, 3.0), "c.yaml", [1, 1]), "c.yaml's weights both weigh the classes"),
        (("counts", names, None, "", None), "this data module counts no pixels per class"),
        (([1.0, 2.0, 3.0], names, None, "", None), "3 weights for 2 classes"),
    ]:
        with pytest.raises(ConfigError, match=named):
            resolve_class_weights(*args)


def test_the_training_pixels_per_class_come_from_the_data_module(tmp_path):
    # Masks of 10x10 in three bands of 3, 3 and 4 columns: 60, 60 and 80 pixels over the 2 training masks.
    data = FolderDataModule(str(bands(tmp_path / "d", (10, 10), train=2)), 8, global_batch_size=2, num_workers=0)
    data.setup("fit")
    assert data.class_pixels.pixels == (60, 60, 80)


@pytest.fixture(scope="module")
def banded(tmp_path_factory) -> Path:
    """4 training and 4 validation pairs of 40x64 in bands of 21, 21 and 22 columns (sky, grass, road)."""
    return bands(tmp_path_factory.mktemp("losses") / "d", (40, 64), train=4)


def test_the_dry_run_says_the_loss_and_the_weights_from_counts(banded, tmp_path, capsys):
    loss = "{ohem: {min_kept: 1000}, dice: 0.5}"
    args = ["--model.init_args.loss", loss, "--model.init_args.class_weights", "counts"]
    code, out, err = segment(banded, tmp_path / "run", capsys, *args, "--data.init_args.global_batch_size", "4")
    assert code == 0, err
    assert line(out, "loss:") == (
        "loss: 1 x OHEM cross-entropy (pixels of true-class probability < 0.7, at least the 1000 hardest per "
        "image) + 0.5 x Dice (smp), class weights from the training pixels per class; main head + 0.4 x auxiliary head"
    )
    # shares 21/64, 21/64, 22/64: 1 / ln(1.02 + share)
    assert line(out, "class weights") == (
        "class weights (from the training pixels per class, 1 / ln(1.02 + share)): sky 3.35, grass 3.35, road 3.22"
    )
    code, out, err = segment(banded, tmp_path / "run", capsys, "--data.init_args.global_batch_size", "4")
    assert line(out, "loss:") == "loss: cross-entropy; main head + 0.4 x auxiliary head"
    assert not [text for text in out if text.startswith("class weights")]


def test_the_dry_run_refuses_weights_that_do_not_fit_the_classes(banded, tmp_path, capsys):
    weights = ["--model.init_args.class_weights", "[1.0, 2.0]", "--data.init_args.global_batch_size", "4"]
    code, out, err = segment(banded, tmp_path / "run", capsys, *weights)
    assert code == 2
    assert "error: class_weights=[1.0, 2.0]: 2 weights for 3 classes; give one per class, in class-index order" in err


@pytest.mark.parametrize("dry_run", [True, False])
def test_weights_that_float32_cannot_sum_are_refused_by_the_dry_run_and_the_fit(banded, tmp_path, capsys, dry_run):
    """1e308 is infinite in float32: the fit took it and crashed at the first loss."""
    weights = ["--model.init_args.class_weights", "[1.0, 1e308, 1.0]", "--data.init_args.global_batch_size", "4"]
    code, out, err = segment(banded, tmp_path / "run", capsys, *weights, dry_run=dry_run)
    assert code == 2
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "error: class_weights=[1.0, 1e+308, 1.0]: 1e+308 is outside [1e-06, 1e+06]: class weights are relative"
        )
    ), err
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()


TINY = [
    *fit_flags(2, check_val_every_n_epoch=2, num_sanity_val_steps=0, log_every_n_steps=1),
    "--data.init_args.global_batch_size", "4", "--data.init_args.num_workers", "0",
    "--data.init_args.crop_size", "32", "--model.init_args.arch", "resnet18",
    "--model.init_args.log_predictions_every_n_epochs", "0",
]  # fmt: skip


def _fit(data: Path, run: Path, capsys, *extra: str) -> list[str]:
    """2 steps of ``python -m mabn segment`` on ``data`` with ``extra``: its stdout lines; its main and auxiliary
    losses, finite at both steps."""
    code, out, err = segment(data, run, capsys, *TINY, *extra, dry_run=False)
    assert code == 0, err
    rows = [row for row in csv.DictReader((run / "metrics.csv").open()) if row.get("train/main_loss")]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(float(row["train/main_loss"])) and math.isfinite(float(row["train/aux_loss"]))
    return out


@pytest.mark.slow  # a stage-2 fit; the losses themselves are held to their formulas above
def test_a_fit_trains_ohem_and_dice_with_the_weights_of_classes_yaml(tmp_path, capsys):
    data = bands(tmp_path / "d", (40, 64), train=4)
    with (data / "classes.yaml").open("a") as file:
        file.write("weights: [1.0, 2.0, 0.5]\n")
    loss = ["--model.init_args.loss", "{ohem: {min_kept: 64}, dice: 0.5}"]
    out = _fit(data, tmp_path / "run", capsys, *loss)
    weights = f"class weights (weights of {data / 'classes.yaml'}): sky 1.00, grass 2.00, road 0.50"
    assert line(out, "class weights") == weights
    # The fit says what OHEM keeps at its crop (TINY's 32x32), as the dry run does.
    assert line(out, "ohem:") == (
        "ohem: keeps the pixels of true-class probability < 0.7, and at least the 64 hardest of each 32x32 crop's "
        "1024 (min_kept 64 as given)"
    )


@pytest.mark.slow
@pytest.mark.parametrize(("loss", "weights"), [("focal", "counts"), ("lovasz", "null"), ("ce", "counts")])
def test_a_fit_trains_each_loss(banded, tmp_path, capsys, loss, weights):
    args = ["--model.init_args.loss", loss, "--model.init_args.class_weights", weights]
    out = _fit(banded, tmp_path / "run", capsys, *args)
    assert bool([text for text in out if text.startswith("class weights")]) == (weights == "counts")


# A loss of one's own, as a user writes it: a module outside the package that registers it through the public
# registration only; a config names it as ``tversky_loss.tversky``, so every process that builds the task imports it.
TVERSKY_MODULE = '''
"""The Tversky loss (Salehi et al. 2017): per class c, 1 - TP / (TP + alpha FP + beta FN) over the batch's labelled
pixels (soft counts from the softmax), averaged over the classes present."""

from dataclasses import dataclass

import torch

from mabn.data.classes import IGNORE_INDEX
from mabn.tasks.losses import LossEntry, register_loss

BUILT = []  # the options of each loss built in this process


@dataclass(frozen=True)
class TverskyOptions:
    alpha: float = 0.5
    beta: float = 0.5

    def __post_init__(self):
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha={self.alpha}, beta={self.beta}: both must be >= 0")


def build(options, data):
    BUILT.append((options.alpha, options.beta))

    def loss(logits, labels):
        labelled = (labels != IGNORE_INDEX).unsqueeze(1)
        probs = logits.float().softmax(1) * labelled
        truth = torch.nn.functional.one_hot(labels.clamp(0, logits.shape[1] - 1), logits.shape[1])
        truth = truth.permute(0, 3, 1, 2) * labelled
        tp, fp = (probs * truth).sum((0, 2, 3)), (probs * (1 - truth)).sum((0, 2, 3))
        fn = ((1 - probs) * truth).sum((0, 2, 3))
        present = truth.sum((0, 2, 3)) > 0
        index = tp / (tp + options.alpha * fp + options.beta * fn).clamp_min(1e-7)
        return ((1 - index) * present).sum() / present.sum().clamp_min(1)

    return loss


register_loss(
    LossEntry("tversky", "Tversky", build, TverskyOptions, detail=lambda o: f"alpha {o.alpha:g}, beta {o.beta:g}")
)
'''


@pytest.fixture
def tversky(tmp_path, monkeypatch) -> Path:
    """The folder of ``tversky_loss.py``, importable in this process (and by a subprocess given it in
    PYTHONPATH); the loss and the module are gone after the test."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "tversky_loss.py").write_text(TVERSKY_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    if "tversky" in LOSSES:
        unregister_loss("tversky")
    sys.modules.pop("tversky_loss", None)


def test_a_loss_of_ones_own_registers_with_its_options_and_the_plan_says_them(banded, tversky, tmp_path, capsys):
    assert "tversky" not in LOSSES
    loss = ["--model.init_args.loss", "{ce: 1.0, tversky_loss.tversky: {weight: 0.5, alpha: 0.3, beta: 0.7}}"]
    code, out, err = segment(banded, tmp_path / "run", capsys, *loss, "--data.init_args.global_batch_size", "4")
    assert code == 0, err
    assert line(out, "loss:") == (
        "loss: 1 x cross-entropy + 0.5 x Tversky (alpha 0.3, beta 0.7); main head + 0.4 x auxiliary head"
    )
    bad = ["--model.init_args.loss", "{tversky_loss.tversky: {alpha: -1.0}}"]
    code, out, err = segment(banded, tmp_path / "run", capsys, *bad, "--data.init_args.global_batch_size", "4")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: loss={'tversky_loss.tversky': {'alpha': -1.0}}: tversky's alpha=-1.0, beta=0.5: both must be >= 0"
    )


@pytest.mark.slow  # a 2-step stage-2 fit, test, predict, export, and mabn.load in a fresh process
def test_a_loss_of_ones_own_trains_and_its_checkpoint_serves_every_command(banded, tversky, tmp_path, capsys):
    config = tmp_path / "loss.yaml"
    config.write_text("model:\n  init_args:\n    loss:\n      tversky_loss.tversky: {alpha: 0.3, beta: 0.7}\n")
    _fit(banded, tmp_path / "run", capsys, "--config", str(config))
    assert (0.3, 0.7) in sys.modules["tversky_loss"].BUILT  # the fit trained the registered loss with its options
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    for argv in (
        ["test", str(ckpt), "--num-workers", "0"],
        ["predict", str(ckpt), "--num-workers", "0", "--out", str(tmp_path / "predicted")],
        ["export", str(ckpt), "--out", str(tmp_path / "exported"), "--input-size", "32", "32"],
    ):
        code, _, err = run_mabn(argv, capsys)
        assert code == 0, (argv, err)
    assert len(list((tmp_path / "predicted" / "masks").glob("*.png"))) == 4
    assert list((tmp_path / "exported").glob("*.onnx"))
    # A fresh process knows the loss only from the checkpoint's loss argument, which names its module.
    script = (
        "import sys, numpy, mabn\n"
        f"classes = mabn.load({str(ckpt)!r}, device='cpu').predict(numpy.zeros((40, 64, 3), numpy.uint8))\n"
        "print(classes.shape, 'tversky_loss' in sys.modules)\n"
    )
    path = os.pathsep.join([str(tversky), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "(40, 64) True"
