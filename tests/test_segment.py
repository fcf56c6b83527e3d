"""Stage 2 on a dataset of the user's own (``python -m mabn segment --data DIR``, docs/your-data.md): the layout and
``classes.yaml``, a short fit whose tables name the dataset's classes and whose crop stays the configured one with
a training image smaller than it (padded), the dry run's count of such images, ``test`` and ``predict`` on its
checkpoint, one image predicted by ``predict``, by the Python API (``mabn.inference.predict.load``) and by
``test``: one class map; colour masks (``mask_format: color``) trained and predicted through the entry point.
The bad-data cases run through the entry point in tests/test_bad_input.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from helpers.commands import run_mabn
from helpers.fits import CROP, TINY, copy_run, stage_fit
from mabn.cli import launch
from mabn.cli.commands import test as evaluate
from mabn.data import cityscapes
from mabn.data.classes import ClassTable, voc_palette
from mabn.data.errors import DatasetError
from mabn.data.folder import FolderDataset
from mabn.data.pairs import find_pairs
from mabn.data.synthetic import segment as demo_segment
from mabn.inference import predict
from mabn.tasks import SegmentationTask

NAMES = tuple(demo_segment.COLORS)


@pytest.fixture(scope="session")
def fitted(segment_run, tmp_path_factory) -> tuple[Path, Path, str]:
    """(data root, last checkpoint, what the run printed) of the session's ``segment_run``: ``python -m mabn
    segment`` on the generated example (4 train and 3 val images of 40x64, the training image scene003 shrunk to
    32x20), 2 steps of a PSPNet on ResNet-18 with crop ``CROP``; the run in a folder of this module's, which its
    tests write into."""
    folder = copy_run(segment_run.folder, tmp_path_factory.mktemp("segment") / "run")
    return segment_run.data, folder / "checkpoints" / "last.ckpt", segment_run.output


def _run(command: str, argv: list[str], capsys) -> tuple[int, str, list[str]]:
    """Exit code, stdout and stderr lines of ``python -m mabn <command> <argv>``."""
    code, out, err = run_mabn([command, *argv], capsys)
    return code, out, err.strip().splitlines()


def test_segment_trains_on_the_layout_and_names_its_classes(fitted):
    data, ckpt, output = fitted
    table = output[output.index("Validation at step 2:") :]
    assert [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()[3:11]] == list(NAMES)
    assert "| wall |" not in table and "| **mean** |" in table  # the dataset's 8 classes, not Cityscapes' 19
    # The crop stays the one given: the training image lower than it is padded, not the crop lowered to 20.
    padded = f"1 of the 4 training images are smaller than the crop {CROP}x{CROP}: padded up to it (images with the"
    assert padded in output
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["num_classes"] == 8
    hp = saved["datamodule_hyper_parameters"]
    assert hp["crop_size"] == CROP and hp["data_dir"] == str(data)
    assert ClassTable.from_dict(hp["classes"]) == ClassTable.read(data / "classes.yaml")


def test_the_dry_run_counts_the_training_images_smaller_than_the_crop(fitted, tmp_path, capsys):
    data, _, _ = fitted
    run = tmp_path / "run"
    for crop, line in [
        (CROP, f"1 of the 4 training images are smaller than the crop {CROP}x{CROP}: padded up to it (images with "
         "the mean pixel, masks with ignored pixels)"),
        (48, "4 of the 4 training images are smaller than the crop 48x48: padded up to it (images with the mean "
         "pixel, masks with ignored pixels)"),
        (16, "0 of the 4 training images are smaller than the crop 16x16"),
    ]:  # fmt: skip
        argv = ["segment", "--data", str(data), "--backbone", "none", "--run-dir", str(run), "--dry-run", "--", *TINY]
        code, out, err = _run("segment", [*argv[1:], "--data.init_args.crop_size", str(crop)], capsys)
        assert code == 0, err
        assert line in out.splitlines(), out
    assert not run.exists()  # a dry run writes nothing


def test_test_and_predict_read_the_class_table_from_the_checkpoint(fitted, tmp_path, monkeypatch, capsys):
    data, ckpt, _ = fitted
    monkeypatch.chdir(tmp_path)
    code, out, err = _run("test", [str(ckpt), "--num-workers", "0"], capsys)
    assert code == 0, err
    assert f"on {data} split val (3 images): crop {CROP}" in out
    assert all(f"| {name} |" in out for name in NAMES) and "| wall |" not in out

    out_dir = tmp_path / "val"
    code, out, err = _run("predict", [str(ckpt), "--num-workers", "0", "--out", str(out_dir), "--overlay"], capsys)
    assert code == 0, err
    frames = [f"scene{i:03d}" for i in range(3)]
    assert sorted(p.name for p in (out_dir / "masks").iterdir()) == [f"{f}.png" for f in frames]
    assert sorted(p.name for p in (out_dir / "overlay").iterdir()) == [f"{f}_overlay.png" for f in frames]
    mask = np.asarray(Image.open(out_dir / "masks" / "scene000.png"))
    colors = np.asarray(Image.open(out_dir / "color" / "scene000_color.png"))
    table = ClassTable.read(data / "classes.yaml")
    assert set(np.unique(mask)) <= {value for value, _ in table.mask_values}  # the dataset's own values
    for value, index in table.mask_values:  # in the dataset's own colours
        assert (colors[mask == value] == demo_segment.COLORS[NAMES[index]]).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val"]  # test wrote nothing, predict only --out


def test_one_image_by_predict_by_the_python_api_and_by_test_is_one_class_map(fitted, tmp_path, monkeypatch, capsys):
    data, ckpt, _ = fitted
    monkeypatch.chdir(tmp_path)
    image = data / "images" / "val" / "scene001.jpg"
    options = ["--crop", "24", "--flip"]  # windows of 24 over 40x64, each with its mirror

    tested: list[np.ndarray] = []  # the class maps test scores, in the order of the split
    predict_classes = SegmentationTask.predict_classes

    def recording(self, images):
        classes = predict_classes(self, images)
        tested.extend(classes.cpu().numpy())
        return classes

    monkeypatch.setattr(SegmentationTask, "predict_classes", recording)
    evaluate.run_test(evaluate.parser().parse_args([str(ckpt), "--num-workers", "0", *options]))
    monkeypatch.setattr(SegmentationTask, "predict_classes", predict_classes)
    by_test = tested[1]

    code, _, err = _run("predict", [str(ckpt), "--images", str(image), "--num-workers", "0", *options], capsys)
    assert code == 0, err
    written = ckpt.parent.parent / "predictions" / "last-scene001" / "masks" / "scene001.png"
    table = ClassTable.read(data / "classes.yaml")
    by_cli, unknown = table.classes_of(np.asarray(Image.open(written)))
    assert unknown.size == 0

    segmenter = predict.load(ckpt, crop=24, flip=True, device="cpu")
    pixels = np.asarray(Image.open(image))
    by_api = segmenter.predict(pixels)
    assert by_api.shape == pixels.shape[:2] and by_api.dtype == np.uint8
    assert segmenter.class_names == NAMES
    np.testing.assert_array_equal(by_api, by_test)
    np.testing.assert_array_equal(by_cli, by_test)
    np.testing.assert_array_equal(segmenter.predict(Image.open(image)), by_test)  # a PIL image, a path
    np.testing.assert_array_equal(segmenter.predict(image), by_test)
    np.testing.assert_array_equal(segmenter.to_mask(by_api), np.asarray(Image.open(written)))
    assert segmenter.predict(np.zeros((20, 100), np.uint8)).shape == (20, 100)  # any size, grey


@pytest.mark.slow  # a prediction of its own; the default suite predicts one image three ways above
def test_predict_takes_a_glob(fitted, tmp_path, monkeypatch, capsys):
    data, ckpt, _ = fitted
    monkeypatch.chdir(tmp_path)
    pattern = str(data / "images" / "*" / "scene00[12].jpg")
    code, out, err = _run("predict", [str(ckpt), "--images", pattern, "--out", "out", "--num-workers", "0"], capsys)
    assert code == 2 and err[-1].startswith("error: images ") and "are both frame scene001" in err[-1]  # train, val
    pattern = str(data / "images" / "val" / "scene00[12].jpg")
    code, out, err = _run("predict", [str(ckpt), "--images", pattern, "--out", "out", "--num-workers", "0"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in Path("out/masks").iterdir()) == ["scene001.png", "scene002.png"]
    assert predict.images_name([pattern]) == "val" and predict.images_name([data / "images"]) == "images"
    code, _, err = _run("predict", [str(ckpt), "--images", "nothing/*.png", "--num-workers", "0"], capsys)
    assert code == 2 and err == ["error: no .png/.jpg/.jpeg/.bmp/.tif/.tiff/.webp images match nothing/*.png"]


@pytest.mark.slow  # a fit and a prediction of their own
def test_colour_masks_train_and_predict_in_the_class_colours(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = demo_segment.generate(tmp_path / "colour", n_train=4, n_val=2, size=(40, 64), seed=5, mask_format="color")
    index = demo_segment.generate(tmp_path / "index", n_train=4, n_val=2, size=(40, 64), seed=5)
    table = ClassTable.read(data / "classes.yaml")
    assert table.mask_format == "color" and table.ignore_color == (0, 0, 0)
    by_colour, by_value = (FolderDataset(root, "val", ClassTable.read(root / "classes.yaml")) for root in (data, index))
    labels = [by_colour[i][1] for i in range(2)]
    assert all(torch.equal(label, by_value[i][1]) for i, label in enumerate(labels))  # the same class maps
    assert any((label == 255).any() for label in labels)  # black, the ignore_color, is ignored

    run = tmp_path / "run"
    argv = ["segment", "--data", str(data), "--backbone", "none", "--run-dir", str(run), "--dry-run", "--", *TINY]
    code, out, err = _run("segment", argv[1:], capsys)
    assert code == 0 and f"0 of the 4 training images are smaller than the crop {CROP}x{CROP}" in out, err
    output = stage_fit("segment", data, run)
    shown = output[output.index("Validation at step 2:") :]
    assert [line.split(" | ")[0].removeprefix("| ") for line in shown.splitlines()[3:11]] == list(NAMES)
    ckpt = run / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["datamodule_hyper_parameters"]
    assert ClassTable.from_dict(saved["classes"]) == table

    code, _, err = _run("predict", [str(ckpt), "--num-workers", "0", "--out", "out"], capsys)
    assert code == 0, err
    mask = np.asarray(Image.open("out/masks/scene000.png"))  # a mask as the dataset's: its class colours
    assert mask.shape == (40, 64, 3)
    np.testing.assert_array_equal(mask, np.asarray(Image.open("out/color/scene000_color.png")))
    assert table.classes_of(mask)[1].size == 0


def test_the_example_layout_pairs_by_name_and_maps_mask_values(tmp_path):
    data = demo_segment.generate(tmp_path / "d", n_train=2, n_val=1, size=(16, 24))
    assert demo_segment.generate(tmp_path / "d", n_train=2, n_val=1, size=(16, 24)) == data  # once
    pairs = find_pairs(data, "train")
    assert [(p.name, p.image.name, p.label.name) for p in pairs] == [
        ("scene000", "scene000.jpg", "scene000.png"),
        ("scene001", "scene001.jpg", "scene001.png"),
    ]
    table = ClassTable.read(data / "classes.yaml")
    assert table.names == NAMES and table.ignore_index == 0
    classes, unknown = table.classes_of(np.array([[7, 26, 0], [23, 8, 8]], np.uint8))
    assert classes.tolist() == [[0, 7, 255], [5, 1, 1]] and unknown.size == 0
    classes, unknown = table.classes_of(np.array([[7, 99, 3]], np.uint16))
    assert unknown.tolist() == [3, 99] and classes.tolist() == [[0, 255, 255]]
    assert table.class_values.tolist() == [7, 8, 11, 17, 21, 23, 24, 26]
    dataset = FolderDataset(data, "val", table)
    image, label = dataset[0]
    assert image.shape == (3, 16, 24) and label.shape == (16, 24) and set(label.unique().tolist()) <= {*range(8), 255}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(DatasetError, match="is not empty and holds no marker"):
        demo_segment.generate(tmp_path / "mine")


def test_the_documented_classes_files_are_the_examples():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "your-data.md").read_text()
    shown = [block.split("```", 1)[0] for block in doc.split("```yaml\n")[1:]]
    assert len(shown) == 2  # index masks, then colour masks
    for text, mask_format in zip(shown, ("index", "color")):
        example = demo_segment.classes_yaml(mask_format)
        assert ClassTable.parse(yaml.safe_load(text)) == ClassTable.parse(yaml.safe_load(example))


def test_classes_file_defaults_and_names():
    table = ClassTable.parse({"classes": ["background", "cat"]})
    assert table.ignore_index == 255 and table.mask_values == ((0, 0), (1, 1))
    assert table.colors == ((0, 0, 0), (128, 0, 0)) and voc_palette(3)[2] == (0, 128, 0)
    table = ClassTable.parse({"classes": ["a", "b"], "ignore_index": None, "mask_values": {10: "b", 20: 0, "30": 1}})
    assert table.class_values.tolist() == [20, 10] and table.classes_of(np.array([30]))[0].tolist() == [1]
    assert ClassTable.parse({"classes": ["a", "b"], "mask_values": {300: "a", 0: "b"}}).class_values.dtype == np.uint16
    assert cityscapes.CLASSES.class_values.tolist() == cityscapes.TRAIN_TO_LABEL_ID.tolist()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("classes: [road, car\n", "is not valid YAML: "),
        ("- road\n- car\n", "expected a mapping with the class names"),
        ("classes: [road, car]\ncolours: []\n", "unknown key 'colours' (the keys are classes, colors, ignore_index"),
        ("classes: [road, road]\n", "class 'road' is named twice"),
        ("classes: [road, 7]\n", "classes must be a list of class names"),
        ("classes: [road, car]\ncolors: [[1, 2, 3]]\n", "colors must hold one [R, G, B] (each 0..255) per class, 2"),
        ("classes: [road, car]\nignore_index: 0\n", "ignore_index 0 is also the mask value of class 'road'"),
        ("classes: [road, car]\nmask_values: {7: road}\n", "class 'car' has no mask value in mask_values"),
        ("classes: [road, car]\nmask_values: {7: road, 8: bus}\n", "8 maps to 'bus', not a class name or index"),
        ("classes: [road]\nmask_values: {255: road}\n", "mask_values: 255 is also the ignore_index"),
        ("classes: [road]\nmask_format: rgb\n", "mask_format='rgb': index (a value per pixel) or color"),
        ("classes: [road]\nmask_format: color\nmask_values: {7: road}\n", "mask_values applies to index masks"),
        ("classes: [road]\nmask_format: color\nignore_index: 0\n", "ignore_index applies to index masks"),
        ("classes: [road]\nignore_color: [0, 0, 0]\n", "ignore_color applies to colour masks (mask_format: color)"),
        ("classes: [a, b]\ncolors: [[1, 2, 3], [1, 2, 3]]\nmask_format: color\n", "[1, 2, 3] is the colour of both"),
        (
            "classes: [a]\ncolors: [[1, 2, 3]]\nmask_format: color\nignore_color: [1, 2, 3]\n",
            "[1, 2, 3] is the colour of both 'a' and 'ignore_color'",
        ),
        ("classes: [a]\nmask_format: color\nignore_color: black\n", "ignore_color must be one [R, G, B]"),
        ("classes: [road]\n", "1 class ('road'): a segmentation needs at least 2 classes, e.g. classes: [background,"),
        (
            "classes: [a, b]\nweights: [1e-3, 1.0]\n",
            "reads '1e-3' as text, not a number (it takes an exponent only after a dot",
        ),
    ],
)
def test_a_classes_file_that_does_not_parse_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "classes.yaml"
    path.write_text(text)
    with pytest.raises(DatasetError) as err:
        ClassTable.read(path)
    assert str(err.value).startswith(f"classes file {path}") and message in str(err.value), err.value
    assert "\n" not in str(err.value)
    if "YAML" in message:
        with pytest.raises(yaml.YAMLError):
            yaml.safe_load(text)


def test_the_segment_stage_reads_both_recipes_and_needs_the_layout(tmp_path, capsys):
    profile = launch.PROFILES["segment"]
    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    with pytest.raises(launch.LaunchError, match=f"missing file {tmp_path / 'classes.yaml'} "):
        profile.resolve(tmp_path)
    (tmp_path / "classes.yaml").write_text("classes: [a]\n")
    assert profile.resolve(tmp_path) == (["cityscapes.yaml", "segment.yaml"], tmp_path)
    configs, root = profile.resolve(None)
    assert configs == ["cityscapes.yaml", "segment.yaml", "demo/cityscapes.yaml"] and root == Path("data/demo-segment")
    assert capsys.readouterr().out.startswith("No dataset given (DATA=...)")
    with pytest.raises(launch.LaunchError, match="no stage-1 backbone pretrain/resnet101-mabn.pt"):
        launch.build_args("segment", tmp_path, "mabn", 0, 1, [])  # the stage-2 rule: a backbone, or none
    args = launch.build_args("segment", tmp_path, "mabn", 0, 1, [], backbone="none")
    first = Path(args[args.index("--trainer.default_root_dir") + 1])
    assert first.parent.parent == Path("runs/segment") and first.name == "mabn"
    assert first.parent.name.startswith(f"{tmp_path.name}-")  # named by the dataset's folder
    # A second dataset in a folder of the same name (v1/seg, v2/seg): a run folder of its own.
    other = tmp_path / "v2" / tmp_path.name
    other.mkdir(parents=True)
    for name in ("images", "masks"):
        shutil.copytree(tmp_path / name, other / name)
    shutil.copy(tmp_path / "classes.yaml", other / "classes.yaml")
    args = launch.build_args("segment", other, "mabn", 0, 1, [], backbone="none")
    second = Path(args[args.index("--trainer.default_root_dir") + 1])
    assert second.parent.name.startswith(f"{tmp_path.name}-") and second != first
