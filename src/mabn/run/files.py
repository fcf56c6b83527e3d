"""Files the stages write and read: every artefact lands whole or not at all, and weights load without pickle.

``atomic_path`` is the one way this project writes a file: into a temporary file in the target's own folder,
fsynced, then renamed over the target (a rename within one filesystem is atomic), so a crash or a kill at any
moment leaves either the old file or the new one, never a truncated mix, also on NFS or Lustre where a copy
from ``$TMPDIR`` would not be atomic.

A write that the operating system refuses for a reason the user can fix (``WRITE_FAULTS``: no space, quota,
a read-only folder, permissions) raises ``WriteError``, one line naming the file and the cause, after the
temporary file is removed: the target keeps its previous, whole content.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from ..errors import ConfigError, WriteError

DIGEST_KEY = "content_sha256"  # in a checkpoint the product saved: ``content_digest`` of the rest of it
TMP_SUFFIX = ".tmp"  # what a write in progress (or one killed half-way) is called: <folder>/.<name>.<random>.tmp
# The OSErrors of a write that are the disk's or the folder's, not the program's: one line, no traceback.
WRITE_FAULTS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type when the message is empty), without terminal
    colours, and cut to its first sentence when a library wrote a paragraph on one line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line.split(". ")[0] if len(line) > 120 else line


def _fsync(path: str | Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(path: str | Path, err: BaseException) -> WriteError | None:
    """``WriteError`` naming ``path`` for an OSError of ``WRITE_FAULTS``, also one behind another error (torch's
    writer turns a failed write into a RuntimeError); None for anything else."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in WRITE_FAULTS:
            return WriteError(path, cause.strerror or os.strerror(cause.errno))
        cause = cause.__cause__ or cause.__context__
    return None


@contextmanager
def write_faults(path: str | Path) -> Iterator[None]:
    """The block's OSErrors of ``WRITE_FAULTS`` raised as ``WriteError`` naming ``path``."""
    try:
        yield
    except OSError as err:
        fault = write_error(path, err)
        if fault is None:
            raise
        raise fault from err


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for the caller to write; renamed onto ``path`` when the block ends
    without error (after fsync of the file and then of the folder), removed when it raises. A fault of the
    disk or folder (``WRITE_FAULTS``), in the block or here, is raised as ``WriteError`` naming ``path``."""
    path = Path(path)
    with write_faults(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide results from the rest of a team
        yield tmp
        _fsync(tmp)  # a full disk may show only here, when delayed allocation finds no room for the data
        os.replace(tmp, path)
        _fsync(path.parent, directory=True)
    except BaseException as err:
        with suppress(FileNotFoundError):
            tmp.unlink()
        fault = write_error(path, err)
        if fault is None:
            raise
        raise fault from err


def write_atomic(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` into a temporary file, then renamed onto ``path`` (see ``atomic_path``)."""
    with atomic_path(path) as tmp:
        write(tmp)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"tensor {flat.dtype} {tuple(value.shape)}\0".encode())
        digest.update(flat.view(torch.uint8).numpy())  # the bytes of any dtype, bfloat16 included
    elif isinstance(value, dict):
        digest.update(f"dict {len(value)}\0".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, list | tuple):
        digest.update(f"{type(value).__name__} {len(value)}\0".encode())
        for item in value:
            _feed(digest, item)
    else:  # numbers (repr round-trips a float exactly), text, None
        digest.update(f"{type(value).__name__} {value!r}\0".encode())


def content_digest(value: Any) -> str:
    """The SHA-256 of a checkpoint's content: every tensor's dtype, shape and bytes and every other value, in
    order. torch checks none of a file's bytes as it loads it, so bytes overwritten inside a tensor load as other
    values; the digest of what loaded then differs from the one recorded at the save."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def intact(checkpoint: dict[str, Any]) -> bool | None:
    """Whether a loaded ``checkpoint`` holds what was saved (its ``content_digest`` is the recorded one); None where
    it records none (saved by something else)."""
    recorded = checkpoint.get(DIGEST_KEY)
    if recorded is None:
        return None
    return content_digest({key: value for key, value in checkpoint.items() if key != DIGEST_KEY}) == recorded


def file_identity(path: str | os.PathLike) -> tuple[int, ...]:
    """The file at ``path`` as its device, inode, size and modification time: another identity is another file, or
    the same one rewritten (a write through ``atomic_path`` gives a new inode); another name of it (a link) is the
    same identity."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, writing through ``atomic_path`` in the checkpoint's own folder and loading
    with ``weights_only=True`` whatever the caller or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` asks: a checkpoint
    holds tensors and plain containers only, and loading one never runs code from the file. Each checkpoint
    records the digest of its content (``DIGEST_KEY``, ``content_digest``), which a resume checks (``intact``).

    A checkpoint whose content is that of the file this IO wrote last (``last.ckpt`` saved right after
    ModelCheckpoint's best of the same step), that file unchanged since, is a hard link to it, not a second copy:
    a checkpoint of PSPNet-101 is 551 MB. A later save of either name replaces that name alone (a rename), so the
    other keeps its content; a filesystem without hard links gets the copy."""

    _written: tuple[str, Path, tuple[int, ...]] | None = None  # (digest, path, ``file_identity``) of the last file

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        digest = content_digest(checkpoint)
        checkpoint = {**checkpoint, DIGEST_KEY: digest}  # Lightning's dict stays as it was
        path = Path(path)
        same = self._same_file(digest, path)
        write_atomic(
            path, lambda tmp: self._write(checkpoint, tmp) if same is None else self._link(same, checkpoint, tmp)
        )
        self._written = (digest, path, file_identity(path))

    def _same_file(self, digest: str, path: Path) -> Path | None:
        """The file last written, where it holds ``digest``'s content, is unchanged and is not ``path`` itself (a
        rename onto another name of the same file would leave the temporary name)."""
        if self._written is None:
            return None
        written_digest, written, identity = self._written
        if written_digest != digest or written == path:
            return None
        try:
            return written if file_identity(written) == identity else None
        except OSError:  # removed since
            return None

    @classmethod
    def _link(cls, existing: Path, checkpoint: dict[str, Any], tmp: Path) -> None:
        tmp.unlink()
        try:
            os.link(existing, tmp)
        except OSError:  # no hard links here (some network filesystems), or the file went: a copy of its own
            cls._write(checkpoint, tmp)

    @staticmethod
    def _write(checkpoint: dict[str, Any], tmp: Path) -> None:
        # Through a Python file: torch.save to a path reports a full disk as a RuntimeError without errno
        # ("unexpected pos ..."), a Python file raises the OSError that names the cause.
        with open(tmp, "wb") as file:
            torch.save(checkpoint, file)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not Path(path).is_file():  # Lightning's own answer to a missing file
            raise FileNotFoundError(f"checkpoint not found: {path}")
        return load_weights_file(Path(path), "checkpoint", ConfigError, map_location=map_location)


def load_weights_file(
    path: Path, what: str, error: type[Exception], mmap: bool = False, map_location: Any = None
) -> Any:
    """The one reader of the product's checkpoints and weight files: ``torch.load`` of ``path``, weights only, on
    the CPU unless ``map_location`` says otherwise; ``error`` naming ``what`` and the path when the file is missing
    or unreadable. ``mmap`` maps the tensors instead of reading them (for the metadata alone)."""
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises several types for a corrupt or foreign file
        raise error(f"{path} is not a readable {what}: {first_line(err)}") from err
