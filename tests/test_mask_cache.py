"""The mask check's cache (``mabn.data.masks.MaskCache``): it lives in the user's cache folder, never in the data
folder; a mask replaced with its times kept loses its verdict; any file of the cache's name that is not the cache,
and a write that fails, is one warning line and the check goes on decoding; every spelling of ``--data`` shares
one entry; only a launch's first process writes it, and no write leaves a temporary file. A mask of no class
read during the fit is one ``DatasetError`` naming the file and the value, whatever the cache said."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers.commands import run_mabn
from mabn.data import folder, masks
from mabn.data.synthetic import segment as demo_segment
from mabn.run.files import write_atomic

BATCH = ["--data.init_args.global_batch_size", "2"]  # the set below has 3 training images
MASK = "masks/train/scene001.png"


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """A small healthy set (3 train, 2 val images of 64x32) in ``tmp_path/d``, the working folder ``tmp_path``,
    the user's cache folder ``tmp_path/xdg`` (as ``XDG_CACHE_HOME``), no scan in memory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MABN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(masks.MaskCache, "_memory", {})  # each check reads what the disk holds, as a new process
    # A file's change time cannot be set back: masks written just before a scan are cached here all the same.
    monkeypatch.setattr(masks, "RECENT_NS", 0)
    return demo_segment.generate(tmp_path / "d", n_train=3, n_val=2, size=(32, 64))


def _dry_run(root: Path | str, capsys) -> tuple[int, list[str], str]:
    """(exit code, ``error:`` lines, stderr) of the dry run on ``root``, in a fresh process's memory."""
    masks.MaskCache._memory.clear()
    argv = ["segment", "--data", str(root), "--backbone", "none", "--dry-run", "--", *BATCH]
    code, _, err = run_mabn(argv, capsys)
    return code, [line.removeprefix("error: ") for line in err.splitlines() if line.startswith("error: ")], err


def _fit_scan(root: Path | str) -> None:
    """What a fit checks of the data before its first step (``FolderDataModule.setup``), in a fresh process."""
    masks.MaskCache._memory.clear()
    module = folder.FolderDataModule(str(root), crop_size=32, num_workers=0)
    for split, train in (("train", True), ("val", False)):
        module.make_dataset(split, train)


def _cache(root: Path) -> masks.MaskCache:
    return masks.MaskCache(root, folder.ClassTable.read(root / "classes.yaml"))


def _files(root: Path) -> dict[str, bytes | None]:
    """Every entry below ``root`` by its path, with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _save_mask(path: Path, value: int | None = None) -> None:
    """Rewrite the mask at ``path`` uncompressed, so that its size depends on its shape alone; with one pixel set
    to ``value``."""
    mask = np.asarray(Image.open(path)).copy()
    if value is not None:
        mask[3, 5] = value
    Image.fromarray(mask).save(path, compress_level=0)


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def test_a_mask_replaced_with_its_size_and_times_kept_is_caught_by_the_dry_run(data, capsys):
    mask = data / MASK
    _save_mask(mask)
    _fit_scan(data)  # every mask recorded clean
    before = mask.stat()
    _save_mask(mask, 99)  # in place, as ``cp bad.png`` does: the same inode
    os.utime(mask, ns=(before.st_atime_ns, before.st_mtime_ns))  # ``touch -r``
    after = mask.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    code, errors, _ = _dry_run(data, capsys)
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"mask {mask} holds value 99,"), errors


# (id, what is put where the cache file of the set d is, given its path)
PROBES = [
    ("null", lambda path: path.write_text("null")),
    ("list", lambda path: path.write_text("[]")),
    ("clean-not-a-mapping", lambda path: path.write_text('{"clean": 5}')),
    ("no-clean", lambda path: path.write_text('{"classes": "{}"}')),
    ("stamps-not-numbers", lambda path: path.write_text('{"clean": {"masks/train/scene001.png": "x"}}')),
    ("not-json", lambda path: path.write_text('{"clean": ')),
    ("not-utf8", lambda path: path.write_bytes(b"\xff\xfe\x00")),
    ("nested-past-the-parser", lambda path: path.write_text("[" * 100_000)),
    ("a-folder", lambda path: (path / "inside").mkdir(parents=True)),
]


@pytest.mark.parametrize("probe", [p[1] for p in PROBES], ids=[p[0] for p in PROBES])
def test_a_cache_that_is_not_one_is_ignored_with_one_line(data, decoded, capsys, probe):
    path = _cache(data).path
    path.parent.mkdir(parents=True, exist_ok=True)
    probe(path)
    code, errors, err = _dry_run(data, capsys)
    assert (code, errors) == (0, [])
    (line,) = _warnings(err)
    assert line.startswith(f"warning: ignoring {path}: ")
    assert len(decoded) == 5  # every mask decoded: none vouched for

    _save_mask(data / MASK, 99)
    with pytest.raises(folder.DatasetError, match=f"mask {data / MASK} holds value 99,"):
        _fit_scan(data)
    assert len(_warnings(capsys.readouterr().err)) == 1  # the fit's own read of it, no second line for its write
    if path.is_dir():
        assert (path / "inside").is_dir()  # left to the user, as the line says
    else:
        assert sorted(json.loads(path.read_text())["clean"]) == ["masks/train/scene000.png", "masks/train/scene002.png"]


def test_a_cache_that_cannot_be_written_is_one_line_and_no_temporary_file(data, decoded, capsys, monkeypatch):
    path = _cache(data).path

    def full_disk(tmp: Path) -> None:
        tmp.write_text("{")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    write_text_atomic = masks.write_text_atomic
    monkeypatch.setattr(masks, "write_text_atomic", lambda target, text: write_atomic(target, full_disk))
    capsys.readouterr()
    _fit_scan(data)
    assert _warnings(capsys.readouterr().err) == [
        f"warning: cannot write {path} (No space left on device): the next check decodes these masks again"
    ]
    assert os.listdir(path.parent) == []  # the temporary file removed with the failed write

    # An error of no kind the write names (a network filesystem's, a cache folder below a file): the same line.
    monkeypatch.setattr(masks, "write_text_atomic", write_text_atomic)
    monkeypatch.setenv("XDG_CACHE_HOME", str(data / "classes.yaml"))
    _fit_scan(data)
    (line,) = _warnings(capsys.readouterr().err)
    assert line.startswith(f"warning: cannot write {data}/classes.yaml/mabn/mask-check-") and "decodes" in line


def test_a_killed_write_s_temporary_file_is_removed_when_seen(data):
    path = _cache(data).path
    cache_dir, name = path.parent, path.name
    cache_dir.mkdir(parents=True)
    killed, writing = cache_dir / f".{name}.killed.tmp", cache_dir / f".{name}.writing.tmp"
    for tmp in (killed, writing):
        tmp.write_text("{")
    os.utime(killed, ns=(1, 1))  # long ago; ``writing`` is another process's write in progress
    _fit_scan(data)
    assert sorted(os.listdir(cache_dir)) == sorted([name, writing.name])


def test_relative_and_absolute_data_share_one_entry(data, decoded, capsys):
    _fit_scan(data)  # absolute
    decoded.clear()
    assert _dry_run("d", capsys)[:2] == (0, [])  # relative to the working folder
    assert decoded == []
    _save_mask(data / MASK, 7)  # a class's value: changed, still fine
    _fit_scan(Path("d/../d"))
    assert decoded == [Path("d/../d") / MASK]
    assert len(os.listdir(data.parent / "xdg/mabn")) == 1


def test_checks_write_nothing_into_the_data_folder(data, capsys):
    before = _files(data)
    _fit_scan(data)
    assert _dry_run(data, capsys)[:2] == (0, [])
    assert _files(data) == before
    assert len(list((data.parent / "xdg/mabn").glob("mask-check-*.json"))) == 1


def test_only_the_first_process_of_a_launch_writes_the_cache(data, decoded, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # a further DDP process
    _fit_scan(data)
    assert len(decoded) == 5 and not _cache(data).path.exists()


def test_a_mask_of_no_class_read_in_the_fit_names_the_file_and_value_whatever_the_cache_said(data):
    """The cache vouches for a bad mask (as a change within the file time's tick could leave it): the fit's own
    read is the error, not a check that ``python -O`` drops."""
    mask = data / MASK
    _fit_scan(data)
    pixels = _cache(data).pixels(mask)
    _save_mask(mask, 99)
    _cache(data).add({mask: pixels}, started_ns=mask.stat().st_ctime_ns + 1, save=True)
    dataset = folder.FolderDataset(data, "train", folder.ClassTable.read(data / "classes.yaml"))
    masks.MaskCache._memory.clear()
    with pytest.raises(folder.DatasetError) as info:
        dataset.read_pair(1)
    assert str(info.value) == (
        f"mask {mask} holds value 99, neither a class nor ignored by {data}/classes.yaml (class mask values 7, 8, 11, "
        f"17, 21, 23, 24, 26, ignore_index 0); 1 of the 3 masks in {data}/masks/train hold such values: map them to "
        f"a class (or ignore them) in {data}/classes.yaml, or correct the masks"
    )
