"""The model benchmarks (training step, inference) run end to end at tiny sizes and report sane ratios.

The PSPNet rows run the bench's code on a PSPNet whose encoder is ResNet-18 in the default suite (the rows, the
memory and time measurements and the tables are the same code at any depth), and on the real PSPNet-101 in the
slow suite."""

import math
import re
from contextlib import contextmanager
from functools import partial

import pytest
import torch

from helpers.marks import default_suite_runs
from mabn.models import PSPNet
from mabn.tools.bench import infer, report, step
from mabn.tools.bench.command import main

CPU = torch.device("cpu")


def _table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The body rows (cells) of the first table under the "### " heading that starts with ``heading``."""
    section = next(s for s in markdown.split("\n### ") if s.startswith(heading))
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


@contextmanager
def pspnet_on(arch: str):
    """The bench builds its PSPNets (training step and inference) on the ResNet ``arch`` while this lasts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step, "PSPNet", partial(PSPNet, arch=arch))
        yield


@pytest.fixture(scope="session", params=[pytest.param(a, marks=pytest.mark.slow) for a in ("resnet18", "resnet101")])
def measured(request):
    """(encoder arch, step rows, inference rows) of the PSPNet tables at small sizes (crop 32: 4x4 features)."""
    with pspnet_on(request.param):
        step_rows = step.run(CPU, repeats=2, crop=32, batch=2, num_classes=4)
        infer_rows = infer.run(CPU, repeats=2, size=(32, 64), num_classes=4)
    return request.param, step_rows, infer_rows


def test_step_and_infer_report_one_row_per_norm_with_finite_positive_ratios(measured, tmp_path):
    _, step_rows, infer_rows = measured
    sections = [step.table(step_rows, 2, 32, 2), infer.table(infer_rows, 2, (32, 64))]
    env = report.header(CPU)
    md, png = report.write(tmp_path / "bench.md", CPU, "python -m mabn bench all", sections, step_rows, infer_rows, env)
    text = md.read_text()
    assert png == tmp_path / "bench.png" and png.read_bytes().startswith(b"\x89PNG")
    assert "![ratios to BN](bench.png)" in text
    assert re.search(r"CPU \(\d+ threads\), torch 2\.\S+, torchvision \S+, segmentation-models-pytorch \S+", text)

    step_table = _table_rows(text, "PSPNet-101 training step")
    assert [r[0] for r in step_table] == ["bn", "gn", "brn", "mabn", "mabn + stats logging"]
    for cells in step_table:
        values = [float(c) for c in cells[1:]]  # s / step, time / BN, peak GiB, memory / BN
        assert all(math.isfinite(v) and v > 0 for v in values), cells
    assert [float(r[2]) for r in step_table][0] == 1.0 and [float(r[4]) for r in step_table][0] == 1.0
    assert "MABNCallback(NormPolicy(log_every_n_steps=1))" in text  # what the logging row runs is said

    infer_table = _table_rows(text, "Inference")
    assert [r[0] for r in infer_table] == ["bn (folded)", "brn (folded)", "mabn (folded)", "gn"]
    assert float(infer_table[0][3]) == 1.0
    for cells in infer_table:
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in cells[1:]), cells


def test_step_peak_memory_counts_the_activations(measured):
    arch, step_rows, _ = measured
    # A step allocates at least its gradients (float32, 68M for PSPNet-101) and activations.
    gradient_bytes = 4 * sum(p.numel() for p in PSPNet(num_classes=4, norm="bn", arch=arch).parameters())
    assert all(r.peak_bytes > gradient_bytes for r in step_rows)


def test_inference_models_are_folded_except_gn():
    from torch import nn

    from mabn.norm import BatchRenorm2d, CenConv2d, MABN2d

    norms = (nn.BatchNorm2d, nn.GroupNorm, BatchRenorm2d, MABN2d, CenConv2d)
    with pspnet_on("resnet18"):  # folding is per layer; test_convert_fold.py folds ResNet-101
        models = {name: infer.build_inference(name, num_classes=4) for name in ("bn", "mabn", "gn")}
    for name in ("bn", "mabn"):
        model = models[name]
        assert not model.training and not [m for m in model.modules() if isinstance(m, norms)]
    gn = models["gn"]
    assert not gn.training and any(isinstance(m, nn.GroupNorm) for m in gn.modules())


def test_bench_cli_rejects_an_odd_batch(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["step", "--batch", "3"])
    assert exit_info.value.code == 2
    assert "--batch must be a multiple of 2" in capsys.readouterr().err


def test_bench_cli_refuses_cuda_graphs_on_the_cpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["step", "--device", "cpu", "--cuda-graph"])
    assert exit_info.value.code == 2
    assert "--cuda-graph needs a CUDA device, got --device cpu" in capsys.readouterr().err


def test_bench_cli_refuses_graph_segments_without_cuda_graphs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["step", "--device", "cpu", "--graph-segments", "stages"])
    assert exit_info.value.code == 2
    assert "--graph-segments stages needs --cuda-graph" in capsys.readouterr().err


def test_bench_cli_plans_the_segmented_capture(capsys):
    assert main(["step", "--cuda-graph", "--graph-segments", "stages", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ", CUDA graphs (stages);" in out
    assert "bench-step-graph-stages-cuda.md" in out  # not the whole capture's report


@pytest.mark.parametrize(
    ("segments", "graphs"), default_suite_runs([("whole", 1), ("stages", 5)], keep=[("stages", 5)])
)
def test_step_bench_trainer_captures_as_graph_segments_says(graph_stand_in, segments, graphs):
    """The bench's training step hands graph_segments to the capture: stages gives PSPNet's five segments (stem
    with layer1, layer2, layer3, layer4, heads) one graph each, whole one graph (CPU stand-in capture)."""
    with pspnet_on("resnet18"):
        trainer = step._Trainer(step.build("mabn", 4).train())
    trainer.cuda_graph, trainer.graph_segments = True, segments
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2, 32, 32))
    trainer.step(images, labels)
    assert len(graph_stand_in.captured) == graphs
    assert graph_stand_in.captured[0] == (2, 3, 32, 32)


@pytest.mark.slow
def test_graphed_step_bench_captures_at_the_measured_shape(graph_stand_in):
    """With --cuda-graph every row replays graphs captured at the measured crop, not at the small crop of the
    first (momentum-creating) step (on the CPU with the stand-in capture of conftest.py)."""
    with pspnet_on("resnet18"):
        rows = step.run(CPU, repeats=1, crop=72, batch=2, num_classes=4, cuda_graph=True)
    assert [r.norm for r in rows] == ["bn", "gn", "brn", "mabn", "mabn + stats logging"]
    assert graph_stand_in.captured == [(2, 3, 72, 72)] * 5
    assert graph_stand_in.replayed == [(2, 3, 72, 72)] * 5 * 2  # the memory step and one timed repeat per row


@pytest.mark.slow  # Dynamo traces ResNet-50 with every norm: ~15 s on one core
def test_resnet50_step_has_compiled_rows_against_compiled_bn(monkeypatch):
    """The small-input ResNet-50 workload with --compile: eager rows against BN, compiled rows (Dynamo alone here)
    against compiled BN, each with the time of the step that compiled it."""
    real = torch.compile
    calls = []

    def dynamo_only(model, **options):
        calls.append(options)
        return real(model, backend="eager", fullgraph=options["fullgraph"])

    monkeypatch.setattr(torch, "compile", dynamo_only)
    rows = step.run(CPU, repeats=1, crop=32, batch=4, model="resnet50", norm_batch_size=None, compile_mode="default")
    eager = ["bn", "gn", "brn", "mabn", "mabn + stats logging", step.PLAIN, step.PLAIN_FORWARD]
    assert [r.norm for r in rows] == [*eager, "bn compiled", "mabn compiled"]
    assert calls == [{"fullgraph": True, "mode": "default"}] * 2
    by_name = {r.norm: r for r in rows}
    assert by_name["bn"].time_ratio == 1.0 and by_name["bn compiled"].time_ratio == 1.0
    assert by_name["mabn compiled"].time_ratio == by_name["mabn compiled"].seconds / by_name["bn compiled"].seconds
    assert all(r.first_step_s > 0 for r in rows[-2:]) and all(r.first_step_s is None for r in rows[:-2])
    text = step.table(rows, 1, 32, 4, model="resnet50", norm_batch_size=None, compile_mode="default")
    assert text.startswith("### ResNet-50 training step: batch 4, 32x32 px") and "normalize the whole batch" in text
    assert "ratios to `bn compiled`" in text


@pytest.mark.parametrize("what", ["check", "chain"])
def test_the_gpu_check_is_no_bench_command(what, capsys):
    """The GPU check runs the checkout's tests: a tool of the checkout (make gpu-check), not of the package."""
    with pytest.raises(SystemExit) as exit_info:
        main([what, "--dry-run"])
    assert exit_info.value.code == 2
    choices = "'?, '?".join(["norm", "step", "infer", "all", "ops"])  # quoted by argparse before Python 3.12.8
    assert re.search(rf"invalid choice: '{what}' \(choose from '?{choices}'?\)", capsys.readouterr().err)


@pytest.mark.slow  # times training steps of every norm
def test_step_measures_the_rows_asked_for_against_their_bn():
    """``rows`` (what make gpu-check times): bn and mabn alone, in the bench's order; a row without the BN it is
    compared with is refused."""
    with pspnet_on("resnet18"):
        rows = step.run(CPU, repeats=1, crop=32, batch=2, num_classes=4, rows=("mabn", "bn"))
    assert [r.norm for r in rows] == ["bn", "mabn"] and rows[0].time_ratio == 1.0
    table = step.table(rows, 1, 32, 2)
    assert "mabn + stats logging" not in table  # no note for a row not measured
    for wrong in (("mabn",), ("bn", "mabn compiled"), ("bn", "mabn", "bn32")):
        with pytest.raises(ValueError, match="rows must be some of"):
            step.run(CPU, repeats=1, crop=32, batch=2, num_classes=4, rows=wrong, compile_mode="default")


def test_stage_one_network_is_the_classification_tasks():
    """``--model resnet101`` builds stage 1's network as ClassificationTask does: MABN in ghost batches with centred
    convs, BN over the device's whole batch (the bn32 backbone's)."""
    from torch import nn

    from mabn.norm import CenConv2d, MABN2d

    mabn = step.build("mabn", 10, "resnet101", 2)
    norms = [m for m in mabn.modules() if isinstance(m, MABN2d)]
    assert len(norms) == 104 and all(m.norm_batch_size == 2 for m in norms)
    assert any(isinstance(m, CenConv2d) for m in mabn.modules()) and mabn.fc.out_features == 10
    bn = step.build("bn", 10, "resnet101", 2)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in bn.modules()) == 104
