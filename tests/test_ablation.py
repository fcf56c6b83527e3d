"""The small-scale ablation (``python -m mabn ablation``): row mapping, probes, and the whole pipeline."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.commands import run_mabn
from mabn.data.synthetic import imagenet as demo_imagenet
from mabn.norm import BatchRenorm2d, CenConv2d, GhostBatchNorm2d, MABN2d
from mabn.tools.ablation import command as ablation
from mabn.tools.ablation import train
from mabn.tools.ablation.probes import BatchNormProbe, MABNProbe
from mabn.tools.ablation.rows import KEY_ROWS, ROWS, ROWS_BY_KEY, layer_options, select
from mabn.tools.ablation.train import TrainConfig, build_model, lr_factor, train_run


def _norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d | BatchRenorm2d | MABN2d | nn.GroupNorm)]


@pytest.mark.parametrize(
    ("key", "layer", "groups_of", "centred"),
    [
        ("bn32", nn.BatchNorm2d, None, False),
        ("bn2", GhostBatchNorm2d, 2, False),
        ("brn2", BatchRenorm2d, 2, False),
        ("mbn32", MABN2d, 32, True),
        ("mabn2", MABN2d, 2, True),
        ("mabn_nowc2", MABN2d, 2, False),
        ("gn2", nn.GroupNorm, None, False),
    ],
)
def test_each_row_builds_its_norm(key: str, layer: type, groups_of: int | None, centred: bool) -> None:
    model = build_model(ROWS_BY_KEY[key], num_classes=10, steps=300)
    norms = _norms(model)
    assert norms and all(type(m) is layer for m in norms)
    assert all(getattr(m, "norm_batch_size", None) == groups_of for m in norms)
    assert any(isinstance(m, CenConv2d) for m in model.modules()) == centred
    if key == "bn2":  # ghost-batch BN: renormalization off
        assert all(m.r_max == 1.0 and m.d_max == 0.0 for m in norms)
    if key == "brn2":
        assert all(m.r_max > 1.0 for m in norms)


def test_timelines_switch_inside_the_run() -> None:
    steps = 300
    mabn = layer_options(ROWS_BY_KEY["mabn2"], steps)
    assert 0 < mabn["warmup_iters"] < mabn["renorm_warmup_iters"] < steps
    brn = layer_options(ROWS_BY_KEY["brn2"], steps)
    assert 0 < brn["r_ramp"][0] < brn["r_ramp"][1] < steps and brn["d_ramp"][1] < steps
    assert {r.key for r in ROWS} == set(ROWS_BY_KEY) and len(ROWS) == 11
    assert [r.key for r in select(None)] == list(KEY_ROWS) and select(["all"]) == list(ROWS)
    assert [r.key for r in select(["mabn2", "bn32"])] == ["bn32", "mabn2"]  # table order
    with pytest.raises(ValueError, match="unknown rows \\['bn3'\\]"):
        select(["bn32", "bn3"])


def test_lr_warms_up_then_decays_to_zero() -> None:
    factors = [lr_factor(s, 100, 0.05) for s in range(100)]
    assert factors[0] == pytest.approx(0.2) and factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:])) and factors[-1] < 0.01


def test_batchnorm_probe_matches_the_formulas() -> None:
    """g_B = mean(dL/dy) and psi_B = mean(dL/dy * y) of the first ghost batch, and of the whole batch."""
    layer = BatchRenorm2d(3, r_max=1.0, d_max=0.0, norm_batch_size=2).train()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
    probe = BatchNormProbe(layer)
    x = torch.randn(4, 3, 5, 5) * 3 + 1
    w = torch.randn(4, 3, 5, 5)
    (layer(x) * w).sum().backward()
    probe.end_step(0)
    rec = probe.records[0]

    dy = w * layer.weight.detach().view(1, 3, 1, 1)  # dL/dy = gamma * dL/dout
    x0 = x[:2].double()
    mu, var = x0.mean((0, 2, 3)), x0.var((0, 2, 3), unbiased=False)
    y0 = (x0 - mu.view(1, 3, 1, 1)) / (var.view(1, 3, 1, 1) + layer.eps).sqrt()
    assert rec["mu"] == pytest.approx(float(mu.norm()))
    assert rec["var"] == pytest.approx(float(var.norm()))
    assert rec["g"] == pytest.approx(float(dy[:2].double().mean((0, 2, 3)).norm()))
    assert rec["psi"] == pytest.approx(float((dy[:2].double() * y0).mean((0, 2, 3)).norm()))
    assert rec["mu_regular"] == pytest.approx(float(x.double().mean((0, 2, 3)).norm()))
    assert rec["g_regular"] == pytest.approx(float(dy.double().mean((0, 2, 3)).norm()))
    with pytest.raises(TypeError, match="renormalizes"):
        BatchNormProbe(BatchRenorm2d(3))


def test_mabn_probe_regular_statistic_is_the_whole_batch() -> None:
    layer = MABN2d(3, norm_batch_size=2, warmup_iters=1, buffer_size=2).train()
    probe = MABNProbe(layer)
    for step in range(2):
        x = torch.randn(4, 3, 5, 5) * (step + 1)
        layer(x).sum().backward()
        probe.end_step(step)
    last = probe.records[-1]
    assert last["chi2_regular"] == pytest.approx(float(x.double().square().mean((0, 2, 3)).norm()), rel=1e-5)
    assert last["chi2_batch"] == pytest.approx(float(x[:2].double().square().mean((0, 2, 3)).norm()), rel=1e-5)
    assert last["moving"] == 1.0 and probe.records[0]["moving"] == 0.0
    assert last["chi2_used"] != pytest.approx(last["chi2_batch"])  # an SMA over groups, not the batch's own


def test_missing_dataset_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_mabn(["ablation", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert err.startswith("error: ") and "nowhere" in err
    code, _, err = run_mabn(["ablation", "--data", str(tmp_path), "--rows", "bn3"], capsys)
    assert code == 2 and "unknown rows" in err
    too_small = demo_imagenet.generate(tmp_path / "small", n_train=3, n_val=1, size=20)  # 30 < one batch of 32
    code, _, err = run_mabn(["ablation", "--data", str(too_small), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "holds 30 images; one gradient batch needs 32" in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("")
    code, _, err = run_mabn(["ablation", "--data", str(too_small), "--out", str(tmp_path / "file" / "out")], capsys)
    assert code == 2 and err == f"error: --out {tmp_path / 'file' / 'out'}: {tmp_path / 'file'} is not a folder\n"


def test_same_seed_same_start_and_data_whatever_the_norm(tiny_imagenet: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of BN(32) and MABN(2) (whose weight-centred convs draw from the global generator when built)
    with one seed: equal initial weights of every layer they share, equal batches (order and
    augmentation); another seed changes both."""
    seen: dict[tuple[str, int], dict] = {}

    def recording_model(row, num_classes, seed, steps, init=None):
        model = initial_model(row, num_classes, seed, steps, init)
        seen[row.key, seed] = {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "batches": []}
        return model

    def recording_batches(data, seed, loader_workers):
        for images, labels in batches(data, seed, loader_workers):
            seen[next(reversed(seen))]["batches"].append((images.clone(), labels.clone()))
            yield images, labels

    initial_model, batches = train.initial_model, train.training_batches
    monkeypatch.setattr(train, "initial_model", recording_model)
    monkeypatch.setattr(train, "training_batches", recording_batches)
    config = TrainConfig(data=tiny_imagenet, steps=3, image_size=16, progress_every=0)
    for key, seed in (("bn32", 1), ("mabn2", 1), ("bn32", 2)):
        train_run(ROWS_BY_KEY[key], seed, config)

    bn, mabn, other = seen["bn32", 1], seen["mabn2", 1], seen["bn32", 2]
    shared = [k for k in bn["weights"] if k in mabn["weights"] and bn["weights"][k].shape == mabn["weights"][k].shape]
    assert {"conv1.weight", "layer1.0.conv1.weight", "layer3.0.downsample.0.weight", "fc.weight"} <= set(shared)
    for k in shared:
        assert torch.equal(bn["weights"][k], mabn["weights"][k]), k
    assert len(bn["batches"]) == len(mabn["batches"]) == 3
    for (x_bn, y_bn), (x_mabn, y_mabn) in zip(bn["batches"], mabn["batches"]):
        assert torch.equal(y_bn, y_mabn) and torch.equal(x_bn, x_mabn)
    assert not torch.equal(bn["weights"]["conv1.weight"], other["weights"]["conv1.weight"])
    assert not torch.equal(bn["batches"][0][1], other["batches"][0][1])


@pytest.mark.slow
def test_whole_pipeline_two_rows(tiny_imagenet: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """BN(32) and MABN(2), one seed, a few steps, in two worker processes: table, JSON, CSVs and figures."""
    out = tmp_path / "ablation"
    args = ["--data", str(tiny_imagenet), "--rows", "bn32,mabn2", "--seeds", "1", "--steps", "6"]
    assert ablation.main([*args, "--image-size", "16", "--workers", "2", "--out", str(out)]) == 0
    printed = capfd.readouterr().out  # capfd: the worker processes print too

    table = (out / "ablation.md").read_text()
    assert table.split("\n\n")[-1] in printed  # the table is printed as written
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    for label, paper in (("BN(32)", "23.41"), ("MABN(2)", "23.58")):
        cells = [c.strip() for c in rows[label].split("|")]
        assert math.isfinite(float(cells[4])) and 0.0 <= float(cells[4]) <= 100.0
        assert paper in cells
    assert len(rows) == 3  # the header and the two rows

    for key, columns in (("bn32", {"mu", "var", "g", "psi"}), ("mabn2", {"chi2_batch", "chi2_used", "psi_used"})):
        with (out / "stats" / f"{key}-seed0.csv").open() as f:
            records = list(csv.DictReader(f))
        assert [int(r["step"]) for r in records] == list(range(6))
        assert columns <= set(records[0])
        assert all(math.isfinite(float(v)) for r in records for v in r.values())
    for name in ("curves.png", "fig2-bn-statistics.png", "fig5-6-chi2-psi.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Deterministic per seed: the same run in this process ends exactly where the worker's did.
    runs = {r["row"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert len(runs["bn32"]["losses"]) == 6 and runs["bn32"]["losses"][-1] == runs["bn32"]["final_loss"]
    assert not [p.name for p in out.rglob(".*")]  # no scratch file left behind
    assert "[mabn2 seed 0] step 6/6" in printed  # the workers' progress lines
    again = train_run(
        ROWS_BY_KEY["mabn2"], 0, TrainConfig(data=tiny_imagenet, steps=6, image_size=16, progress_every=0)
    )
    assert (runs["mabn2"]["final_loss"], runs["mabn2"]["val_error"]) == (again.final_loss, again.val_error)
