"""``python -m mabn export``: checkpoint -> folded TorchScript, torch.export program and ONNX that reproduce the
trained model.

The checkpoints hold ResNet-18 networks (``arch: resnet18``): folding, tracing and the checks are per layer and
the same at any depth, and ``export`` rebuilds the network from the checkpoint's arguments, arch included."""

import importlib.util
import json
import logging
import os
import sys
import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from helpers import full_disk
from helpers.commands import run_mabn
from helpers.export_program import programs_take_any_size
from mabn.cli.commands import export as export_command
from mabn.data.classes import ClassTable
from mabn.data.images import imagenet_normalize
from mabn.inference import export
from mabn.inference.checkpoint import Restored
from mabn.norm import fold_norms
from mabn.tasks import ClassificationTask, SegmentationTask
from mabn.tools.bench.infer import calibrate

# The files a ResNet's export writes beside the TorchScript module: the ExportedProgram where this torch's program of
# a ResNet takes every input size (helpers.export_program).
# Evaluated as a marked test starts (an export takes half a second): collection in every worker exports nothing.
needs_program = pytest.mark.skipif(
    "not programs_take_any_size()", reason="this torch's export guards a max pooling on its input's parity"
)
NORM_OPS = ("batch_norm", "group_norm", "instance_norm", "layer_norm", "renorm")
SIZE = (64, 64)
# The classes of the exported segmentation checkpoint, as a dataset of one's own records them (its classes.yaml).
CLASSES = ClassTable.parse(
    {"classes": ["sky", "road", "car", "tree", "sign"], "colors": [[70, 130, 180], [128, 64, 128], [0, 0, 142],
                                                                    [107, 142, 35], [220, 220, 0]]}
)  # fmt: skip


def _trained_like(task: pl.LightningModule) -> None:
    """Random gamma/beta and running statistics of a real batch, so that folding has something to fold."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in task.model.modules():
            if hasattr(m, "running_mean") or hasattr(m, "running_var"):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=gen))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen))
    calibrate(task.model, torch.randn(2, 3, *SIZE, generator=gen))
    task.model.eval()


def _save(task: pl.LightningModule, path, data: dict | None = None, **hparams) -> None:
    """A checkpoint as Lightning writes it: the module's state_dict under ``model.*``, its hyper_parameters and
    (``data``) its data module's."""
    ckpt = {
        "state_dict": task.state_dict(),
        "hyper_parameters": {**dict(task.hparams), **hparams},
        "pytorch-lightning_version": pl.__version__,
    }
    if data is not None:
        ckpt["datamodule_hyper_parameters"] = data
    torch.save(ckpt, path)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(scope="session")
def seg_checkpoint(tmp_path_factory):
    """A MABN PSPNet (ResNet-18 encoder) checkpoint of a dataset of one's own (``CLASSES``), and its unfolded eval
    model."""
    tmp = tmp_path_factory.mktemp("seg")
    torch.manual_seed(0)
    task = SegmentationTask(norm="mabn", num_classes=5, arch="resnet18")
    _trained_like(task)
    _save(task, tmp / "psp.ckpt", data={"data_dir": "data/mine", "classes": CLASSES.as_dict()})
    return task.model, tmp / "psp.ckpt"


@pytest.fixture(scope="session")
def seg_export(seg_checkpoint):
    """The unfolded eval model and what export wrote for it when asked for TorchScript and the ExportedProgram."""
    model, checkpoint = seg_checkpoint
    return model, export.export(checkpoint, checkpoint.parent / "out", SIZE, formats=("torchscript", "pt2"))


@pytest.fixture(scope="session")
def seg_onnx(seg_checkpoint):
    """The same model and what export wrote for it when asked for the ONNX file alone."""
    model, checkpoint = seg_checkpoint
    return model, export.export(checkpoint, checkpoint.parent / "onnx", SIZE, formats=("onnx",))


def test_export_writes_a_folded_torchscript_that_matches_the_unfolded_model(seg_export):
    model, result = seg_export
    assert result.task == "SegmentationTask"
    assert result.torchscript.name == "psp.folded.pt" and result.torchscript.is_file()
    # The formats asked for, and only those: no ONNX file (nor its check) where it was not asked for.
    assert (
        sorted(p.name for p in result.torchscript.parent.iterdir())
        == ["psp.folded.pt", "psp.folded.pt2"][: 1 + programs_take_any_size()]
    )
    assert (result.program is not None) == programs_take_any_size()
    assert result.onnx is None and result.onnxruntime is None
    assert result.folded.relative < 1e-10  # the folding itself is exact algebra (checked in float64)
    scripted = torch.jit.load(str(result.torchscript))
    x = torch.randn(1, 3, *SIZE)
    with torch.no_grad():
        out, ref = scripted(x), model(x)
    assert out.shape == (1, 5, *SIZE)
    # float32 rounding through the random layers stays far below this; a wrong fold is off by O(1).
    assert _rel(out, ref) < 2e-3
    # Tracing kept the sizes symbolic: another input size still works and still matches.
    x = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        assert _rel(scripted(x), model(x)) < 2e-3


def test_exported_graph_has_no_norm_and_no_centring(seg_export):
    model, result = seg_export
    kinds = [node.kind() for node in torch.jit.load(str(result.torchscript)).inlined_graph.nodes()]
    assert not [k for k in kinds if any(op in k for op in NORM_OPS)]
    assert "aten::mean" not in kinds  # CenConv2d's w - mean(w) was folded into the weights
    # Every norm went into the conv before it: no depthwise stand-in convs were added (the auxiliary
    # head does not run in eval mode, so it is not in the trace).
    convs = sum(isinstance(m, nn.Conv2d) for name, m in model.named_modules() if not name.startswith("aux."))
    assert kinds.count("aten::_convolution") == convs


def _load_program(path) -> tuple[torch.export.ExportedProgram, dict]:
    """The ExportedProgram of a .pt2 file and its metadata, read back as a consumer reads them."""
    extra = {export.METADATA_FILE: ""}  # torch.export.load fills in the archive's file of that name
    return torch.export.load(path, extra_files=extra), json.loads(extra[export.METADATA_FILE])


@needs_program
def test_the_exported_program_is_the_folded_model_at_any_batch_height_and_width(seg_export):
    """The .pt2 beside the TorchScript module, read back by torch.export.load, gives the folded model's outputs at
    the sample size and at other batches and sizes (odd, non-square, one side under the traced 128 px), has no
    norm left, and says what the TorchScript archive says about its input and classes."""
    model, result = seg_export
    assert result.program == result.torchscript.with_name("psp.folded.pt2") and result.program.is_file()
    assert result.program_diff.relative < 1e-5 and result.program_other.relative < 1e-5
    program, meta = _load_program(result.program)
    assert meta == result.metadata == _torchscript_metadata(result.torchscript)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert not [t for t in targets if any(op in t for op in NORM_OPS)] and "aten.mean" not in " ".join(targets)
    folded, runnable = fold_norms(model), program.module()
    for shape in [(1, 3, *SIZE), (2, 3, 37, 50), (3, 3, 90, 21), (1, 3, 9, 9)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            out = runnable(x)
            assert out.shape == (shape[0], 5, *shape[2:]), shape
            # The program runs the folded model's own ATen ops on the same weights: the same numbers.
            torch.testing.assert_close(out, folded(x), rtol=1e-6, atol=1e-6, msg=str(shape))
            assert _rel(out, model(x)) < 2e-3, shape
    with pytest.raises(AssertionError, match=r"Guard failed: .*>= 9"):  # the stride-8 features would be 1 px
        runnable(torch.randn(1, 3, 8, 16))


@needs_program
def test_torch_export_load_reads_the_program_without_a_warning(seg_export, caplog):
    """torch.export.load is the loader torch keeps (torch.jit.load warns that it is deprecated): it reads the file
    export wrote without a Python warning or a warning of torch's logging."""
    _, result = seg_export
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _load_program(result.program)
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


needs_onnx = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime")),
    reason="needs onnx, onnxscript and onnxruntime (pip install onnx onnxscript onnxruntime)",
)


@pytest.mark.slow  # torch's dynamo ONNX exporter: 10 s for PSPNet-18
@needs_onnx
def test_onnx_matches_the_folded_model_under_onnxruntime(seg_onnx):
    import onnx
    import onnxruntime

    model, result = seg_onnx
    assert result.onnx is not None and result.onnx.is_file()
    assert result.onnxruntime is not None and result.onnxruntime.relative < 1e-3
    ops = [node.op_type for node in onnx.load(str(result.onnx)).graph.node]
    assert not set(ops) & {"BatchNormalization", "GroupNormalization", "InstanceNormalization"}
    convs = sum(isinstance(m, nn.Conv2d) for name, m in model.named_modules() if not name.startswith("aux."))
    assert ops.count("Conv") == convs
    session = onnxruntime.InferenceSession(str(result.onnx), providers=["CPUExecutionProvider"])
    x = torch.randn(1, 3, *SIZE)
    (out,) = session.run(None, {"image": x.numpy()})
    with torch.no_grad():
        assert _rel(torch.from_numpy(out), model(x)) < 2e-3


@pytest.mark.slow  # torch's dynamo ONNX exporter: 10 s for PSPNet-18
@needs_onnx
def test_onnx_takes_any_batch_height_and_width(seg_onnx):
    """The ONNX graph's input is (batch, 3, height, width), all three symbolic; export checked it at the sample
    and at two images of a second, non-square size, and it matches the PyTorch model at both (and a third)."""
    import onnx
    import onnxruntime

    model, result = seg_onnx
    assert result.other_shape == (2, 3, *export.other_size(*SIZE)) == (2, 3, 33, 81)
    assert result.onnxruntime_other is not None and result.onnxruntime_other.relative < 1e-3
    (graph_input,) = onnx.load(str(result.onnx)).graph.input
    dims = [d.dim_param or d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    assert dims == ["batch", 3, "height", "width"]
    session = onnxruntime.InferenceSession(str(result.onnx), providers=["CPUExecutionProvider"])
    for shape in [(1, 3, *SIZE), (2, 3, 37, 50), (1, 3, 90, 21)]:
        x = torch.randn(*shape)
        (out,) = session.run(None, {"image": x.numpy()})
        with torch.no_grad():
            ref = model(x)
        assert out.shape == (shape[0], 5, *shape[2:]) and _rel(torch.from_numpy(out), ref) < 2e-3, shape


def _torchscript_metadata(path) -> dict:
    extra = {export.METADATA_FILE: ""}
    torch.jit.load(str(path), _extra_files=extra)
    return json.loads(extra[export.METADATA_FILE])


def test_torchscript_carries_the_checkpoints_classes_and_input_normalisation(seg_export):
    _, result = seg_export
    meta = _torchscript_metadata(result.torchscript)
    assert meta == result.metadata
    assert meta["num_classes"] == 5 and meta["task"] == "SegmentationTask"
    assert meta["class_names"] == ["sky", "road", "car", "tree", "sign"]
    assert meta["class_colors"][2] == [0, 0, 142] and len(meta["class_colors"]) == 5
    assert (meta["channel_order"], meta["input_layout"], meta["value_range"]) == ("RGB", "NCHW", [0, 255])
    assert meta["mean"] == [0.485, 0.456, 0.406] and meta["std"] == [0.229, 0.224, 0.225]


@pytest.mark.slow  # torch's dynamo ONNX exporter: 10 s for PSPNet-18
@needs_onnx
def test_onnx_carries_the_same_metadata_and_an_input_made_by_it_is_the_models(seg_onnx):
    """metadata_props, read by onnx and by onnxruntime, hold what metadata.json holds; an uint8 image normalised as
    they say gives the logits of the image normalised as training did (``imagenet_normalize``)."""
    import onnx
    import onnxruntime

    model, result = seg_onnx
    props = {p.key: json.loads(p.value) for p in onnx.load(str(result.onnx)).metadata_props}
    assert props == result.metadata  # what metadata.json holds (test_torchscript_carries_...)
    session = onnxruntime.InferenceSession(str(result.onnx), providers=["CPUExecutionProvider"])
    custom = session.get_modelmeta().custom_metadata_map
    assert {key: json.loads(value) for key, value in custom.items()} == props

    pixels = np.random.default_rng(0).integers(0, 256, (*SIZE, 3), dtype=np.uint8)
    top = props["value_range"][1]
    image = ((pixels / top - props["mean"]) / props["std"]).astype(np.float32).transpose(2, 0, 1)[None]
    (out,) = session.run(None, {"image": image})
    trained = imagenet_normalize()(image=pixels)["image"].transpose(2, 0, 1)[None]
    with torch.no_grad():
        assert _rel(torch.from_numpy(out), model(torch.from_numpy(np.ascontiguousarray(trained)))) < 2e-3


def test_metadata_names_the_classes_its_data_module_declares_and_no_invented_ones():
    """A segmentation checkpoint names the classes its data module declares (Cityscapes' 19 for the Cityscapes data
    module, which LightningCLI records by class path); 19 outputs alone are no dataset: a checkpoint without a
    data module or a class table, and a classification checkpoint, name no classes (only their number)."""
    data = {"_class_path": "mabn.data.cityscapes.CityscapesDataModule", "data_dir": "x"}
    cityscapes = export.metadata(Restored("SegmentationTask", SegmentationTask(num_classes=19, arch="resnet18"), data))
    assert cityscapes["class_names"][:3] == ["road", "sidewalk", "building"] and len(cityscapes["class_names"]) == 19
    assert cityscapes["class_colors"][13] == [0, 0, 142]  # car
    for classes in (19, 4):
        unnamed = export.metadata(
            Restored("SegmentationTask", SegmentationTask(num_classes=classes, arch="resnet18"), {})
        )
        assert unnamed["num_classes"] == classes and "class_names" not in unnamed and "class_colors" not in unnamed
    cls = export.metadata(Restored("ClassificationTask", ClassificationTask(num_classes=7, arch="resnet18"), {}))
    assert cls["num_classes"] == 7 and "class_names" not in cls and "(N, num_classes)" in cls["output"]


@pytest.mark.parametrize("bins", [1, 2, 3, 6, (2, 5)])
def test_averaging_pool_is_adaptive_average_pooling_at_any_size(bins):
    pool, averaging = nn.AdaptiveAvgPool2d(bins), export.AveragingPool2d(nn.modules.utils._pair(bins))
    for size in [(8, 8), (5, 7), (1, 2), (13, 3), (64, 129)]:
        x = torch.randn(2, 3, *size, dtype=torch.float64)
        torch.testing.assert_close(averaging(x), pool(x), rtol=1e-12, atol=1e-12)


@needs_onnx
@pytest.mark.slow
def test_an_onnx_graph_that_only_fits_the_traced_size_is_refused(tmp_path, capsys, monkeypatch):
    """The exporter's own decomposition of adaptive pooling unrolls each bin's window for the traced size (PSPNet's
    3- and 6-bin pooling of 16x16 features here): at the second size onnxruntime fails on an index (elsewhere
    the graph computes wrong numbers). The file is refused, and only the TorchScript module is left."""
    torch.manual_seed(0)
    task = SegmentationTask(norm="bn", num_classes=3, arch="resnet18")
    _trained_like(task)
    _save(task, tmp_path / "psp.ckpt")
    monkeypatch.setattr(export, "_for_onnx", lambda folded: folded)
    err = _error_line(capsys, [str(tmp_path / "psp.ckpt"), "--input-size", "128", "128"])
    assert f"{tmp_path / 'psp.onnx'}: onnxruntime cannot run the ONNX model at 2x3x65x161: " in err, err
    written = ["psp.ckpt", "psp.folded.pt", "psp.folded.pt2"][: 2 + programs_take_any_size()]
    assert sorted(p.name for p in tmp_path.iterdir()) == written


@pytest.fixture(scope="session")
def cls_checkpoint(tmp_path_factory):
    """A BRN ResNet-18 checkpoint as LightningCLI writes it, and the model it holds."""
    path = tmp_path_factory.mktemp("cls") / "cls.ckpt"
    torch.manual_seed(0)
    task = ClassificationTask(norm="brn", num_classes=7, arch="resnet18")
    _trained_like(task)
    # LightningCLI stores the class path and its instantiator beside the arguments.
    _save(task, path, _class_path="mabn.tasks.ClassificationTask", _instantiator="x")
    return path, task.model


@pytest.mark.slow
def test_export_rebuilds_a_cli_classification_checkpoint(cls_checkpoint, tmp_path, capsys):
    path, model = cls_checkpoint
    assert export_command.main([str(path), "--out", str(tmp_path), "--input-size", "64", "64"]) == 0
    printed = capsys.readouterr().out
    assert "Loaded ClassificationTask" in printed and "max abs diff" in printed
    scripted = torch.jit.load(str(tmp_path / "cls.folded.pt"))
    assert _torchscript_metadata(tmp_path / "cls.folded.pt")["num_classes"] == 7
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert _rel(scripted(x), model(x)) < 2e-3
    kinds = {node.kind() for node in scripted.inlined_graph.nodes()}
    assert not [k for k in kinds if any(op in k for op in NORM_OPS)]


def test_a_fold_that_changes_the_model_is_refused_and_writes_nothing(cls_checkpoint, tmp_path, capsys, monkeypatch):
    fold = export.fold_norms

    def off_by_one_percent(model: nn.Module) -> nn.Module:
        folded = fold(model)
        with torch.no_grad():
            folded.conv1.weight.mul_(1.01)  # a 1% error in the first folded conv
        return folded

    monkeypatch.setattr(export, "fold_norms", off_by_one_percent)
    path, _ = cls_checkpoint
    err = _error_line(capsys, [str(path), "--out", str(tmp_path), "--input-size", "32", "32"])
    assert f"{path}: the folded model differs from the reference" in err and "nothing written" in err
    assert list(tmp_path.iterdir()) == []


class _OffWhenExported(nn.Module):
    """A model whose captured graph is 1% off the model run eagerly, as a wrong capture would be."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return out * 1.01 if torch.compiler.is_exporting() else out


@pytest.mark.slow
@needs_program
def test_an_exported_program_off_the_folded_model_is_refused(cls_checkpoint, tmp_path, capsys, monkeypatch):
    fold = export.fold_norms
    monkeypatch.setattr(export, "fold_norms", lambda model: _OffWhenExported(fold(model)))
    path, _ = cls_checkpoint
    err = _error_line(capsys, [str(path), "--out", str(tmp_path), "--input-size", "64", "64"])
    assert f"{tmp_path / 'cls.folded.pt2'}: the ExportedProgram differs from the reference" in err
    assert f"only {tmp_path / 'cls.folded.pt'} written" in err
    assert [p.name for p in tmp_path.iterdir()] == ["cls.folded.pt"]


@pytest.mark.slow
def test_a_program_that_cannot_take_the_checked_size_is_not_written(cls_checkpoint, tmp_path, capsys):
    """torch.export leaves out the sizes at which a feature map would be 1 px (0/1 specialisation): a ResNet's
    program takes 33 px and up, so with a check at 32 px it is not written, in one line naming the size and the
    program's guard, and the other files are."""
    path, _ = cls_checkpoint
    code, out, _ = run_mabn(["export", str(path), "--out", str(tmp_path), "--input-size", "32", "32"], capsys)
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("ExportedProgram"))
    assert line.startswith("ExportedProgram: not written, torch.export's program of this network cannot run at "
                           "1x3x32x32 (Guard failed: "), line  # fmt: skip
    written = {p.name for p in tmp_path.iterdir()}
    assert "cls.folded.pt" in written and "cls.folded.pt2" not in written


@needs_onnx
@pytest.mark.slow
def test_an_onnx_model_off_at_the_second_size_is_refused(cls_checkpoint, tmp_path, capsys, monkeypatch):
    run = export._run_onnxruntime

    def off_at_the_second_size(path, sample, other):
        at_sample, at_other = run(path, sample, other)
        return [at_sample, at_other * 1.01]

    monkeypatch.setattr(export, "_run_onnxruntime", off_at_the_second_size)
    path, _ = cls_checkpoint
    err = _error_line(capsys, [str(path), "--out", str(tmp_path), "--input-size", "64", "64"])
    assert f"{tmp_path / 'cls.onnx'}: the ONNX model under onnxruntime at 2x3x33x81 differs from the reference" in err
    written = ["cls.folded.pt", "cls.folded.pt2"][: 1 + programs_take_any_size()]
    assert f"only {' and '.join(str(tmp_path / name) for name in written)} written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == written


def _error_line(capsys, argv) -> str:
    code, _, err = run_mabn(["export", *argv], capsys)
    assert code == 2
    err = err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_bad_checkpoints_give_one_error_line_naming_the_file(tmp_path, capsys):
    missing = tmp_path / "nope.ckpt"
    assert _error_line(capsys, [str(missing)]) == f"error: checkpoint not found: {missing}"

    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"\x80\x04 not a checkpoint at all" * 10)
    assert f"{corrupt} is not a readable checkpoint" in _error_line(capsys, [str(corrupt)])

    foreign = tmp_path / "foreign.ckpt"
    torch.save({"format": "mabn-backbone", "state_dict": {}}, foreign)
    assert f"{foreign} is not a Lightning checkpoint" in _error_line(capsys, [str(foreign)])

    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"_class_path": "elsewhere.OtherTask"}}, other)
    err = _error_line(capsys, [str(other)])
    assert f"{other} is a checkpoint of elsewhere.OtherTask" in err

    bad_args = tmp_path / "bad-args.ckpt"
    torch.save({"state_dict": {"model.fc.weight": torch.zeros(1)}, "hyper_parameters": {"bogus": 1}}, bad_args)
    assert f"{bad_args}: cannot rebuild ClassificationTask" in _error_line(capsys, [str(bad_args)])

    mismatch = tmp_path / "mismatch.ckpt"
    state = {"model.fc.weight": torch.zeros(4, 2048)}  # 4 classes, where the arguments say 3
    torch.save({"state_dict": state, "hyper_parameters": {"norm": "bn", "num_classes": 3}}, mismatch)
    err = _error_line(capsys, [str(mismatch)])
    assert f"{mismatch} does not fit the ClassificationTask" in err
    assert "missing key(s) (e.g. bn1.bias)" in err and "1 mis-shaped key(s) (e.g. fc.weight)" in err

    unknown = tmp_path / "unknown.ckpt"
    torch.save({"state_dict": {"model.head.weight": torch.zeros(1)}, "hyper_parameters": {}}, unknown)
    assert str(unknown) in _error_line(capsys, [str(unknown)])
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob("*.onnx"))


def test_formats_outside_the_three_are_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    missing = tmp_path / "missing.ckpt"  # a bad format is named first: nothing is read for it
    with pytest.raises(export.ExportError, match=r"^export formats: gif; choose one or more of torchscript, pt2, onnx"):
        export.export(missing, formats=["torchscript", "gif"])
    with pytest.raises(export.ExportError, match=r"^export formats: none;"):
        export.export(missing, formats=[])
    code, _, err = run_mabn(["export", str(missing), "--formats", "gif"], capsys)
    assert code == 2 and "argument --formats: invalid choice: 'gif'" in err


def test_python_m_mabn_export_routes_to_the_exporter(tmp_path, capsys):
    """``python -m mabn export`` is ``mabn.__main__.main(["export", ...])``, run here in this process (the
    interpreter start itself is exercised by the CLI runs of tests/test_runs.py)."""
    missing = tmp_path / "missing.ckpt"
    code, _, err = run_mabn(["export", str(missing)], capsys)
    assert code == 2 and err.strip() == f"error: checkpoint not found: {missing}"


FULL_DISK = full_disk.unavailable()


@pytest.mark.slow  # an export in a subprocess per format, the model of 45 MB: ~10 s each
@pytest.mark.skipif(FULL_DISK is not None, reason=f"no real full disk here: {FULL_DISK}")
@pytest.mark.parametrize(
    "fmt, file",
    [
        ("torchscript", "cls.folded.pt"),
        pytest.param("pt2", "cls.folded.pt2", marks=needs_program),
        pytest.param("onnx", "cls.onnx", marks=needs_onnx),
    ],
)
def test_a_full_disk_during_export_is_one_line_and_leaves_no_file(cls_checkpoint, tmp_path, fmt, file):
    """The out folder a tmpfs of 1 MiB, the kernel's own ENOSPC: torch's zip writer, writing into the file, threw
    from its destructor (a C++ dump, exit 134, the temporary file left)."""
    path, _ = cls_checkpoint
    argv = [sys.executable, "-m", "mabn", "export", str(path), "--out", "out", "--input-size", "64", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run, left = full_disk.run_on_full_disk([*argv, "--formats", fmt], tmp_path / "out", 1024, tmp_path, env, 300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [f"error: cannot write out/{file}: No space left on device"]
    assert left == []
