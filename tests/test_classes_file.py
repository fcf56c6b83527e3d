"""A ``classes.yaml`` that is not UTF-8, or whose class names could not be printed as they are (a line break, an
escape code, ``|``, a name too long for a table row), stops ``python -m mabn segment`` with exit code 2 and one
``error:`` line naming the file and the class, the name shown escaped: no traceback, and nothing of the name
reaches the terminal raw (``mabn.data.classes``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers.commands import run_mabn
from mabn.data.cityscapes import CLASS_NAMES, CLASSES
from mabn.data.classes import ClassTable
from mabn.data.synthetic import segment as demo_segment


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    """A small set the dry run passes (3 train, 2 val images of 64x32)."""
    return demo_segment.generate(tmp_path_factory.mktemp("set") / "d", n_train=3, n_val=2, size=(32, 64))


@pytest.fixture
def data(healthy, tmp_path, monkeypatch) -> Path:
    """The healthy set's classes.yaml beside links to its images and masks, the working folder beside it."""
    root = tmp_path / "d"
    root.mkdir()
    for name in ("images", "masks"):
        (root / name).symlink_to(healthy / name)
    (root / "classes.yaml").write_bytes((healthy / "classes.yaml").read_bytes())
    monkeypatch.chdir(tmp_path)
    return root


def _dry_run(root: Path, capsys) -> tuple[int, list[str]]:
    """Exit code and stderr lines of ``python -m mabn segment --data ROOT --dry-run``, less Lightning's seed line."""
    argv = ["segment", "--data", str(root), "--backbone", "none", "--dry-run", "--"]
    code, _, err = run_mabn([*argv, "--data.init_args.global_batch_size", "2"], capsys)
    return code, [line for line in err.splitlines() if not line.startswith("Seed set to")]


def _with_name(root: Path, name: str) -> None:
    """The set's classes.yaml with its class ``road`` (class 0) renamed ``name``, written as YAML escapes it."""
    raw = yaml.safe_load((root / "classes.yaml").read_text())
    raw["classes"][0] = name
    raw["mask_values"] = {value: (name if target == "road" else target) for value, target in raw["mask_values"].items()}
    (root / "classes.yaml").write_text(yaml.safe_dump(raw, allow_unicode=False))


def test_the_healthy_set_and_names_of_any_script_pass(data, capsys):
    assert _dry_run(data, capsys) == (0, [])
    _with_name(data, "Straße (nass) – 道路")
    assert _dry_run(data, capsys) == (0, [])


def test_a_classes_file_that_is_not_utf8_is_one_line_with_the_byte_and_its_offset(data, capsys):
    text = (data / "classes.yaml").read_text().replace("sidewalk", "trottoir élevé")
    (data / "classes.yaml").write_bytes(text.encode("latin-1"))
    offset = text.encode("latin-1").index(b"\xe9")
    assert _dry_run(data, capsys) == (
        2,
        [f"error: classes file {data}/classes.yaml is not UTF-8 text: byte 0xe9 at offset {offset}; save it as UTF-8"],
    )


RULE = "a class name is printable text without '|', at most 64 characters"
# (id, the name, the line's words after the name)
NAMES = [
    ("line-break", "road\nerror: forged", r"'road\nerror: forged' holds '\n', which is not printable"),
    ("escape-code", "road\x1b[2J", r"'road\x1b[2J' holds '\x1b', which is not printable"),
    ("bar", "road | 99.00", "'road | 99.00' holds '|', which splits a row of the validation table"),
    ("65-characters", "r" * 65, f"'{'r' * 64}'... has 65 characters"),
    ("20000-characters", "r" * 20000, f"'{'r' * 64}'... has 20000 characters"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "expected"), [n[1:] for n in NAMES], ids=[n[0] for n in NAMES])
def test_a_class_name_that_cannot_be_printed_as_it_is_is_one_escaped_line(data, capsys, name, expected):
    _with_name(data, name)
    assert _dry_run(data, capsys) == (2, [f"error: classes file {data}/classes.yaml: class 0 {expected}; {RULE}"])


def test_the_cityscapes_names_are_class_names():
    assert ClassTable.parse({"classes": list(CLASS_NAMES)}).names == CLASSES.names
