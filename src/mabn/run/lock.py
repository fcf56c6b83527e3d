"""One run per experiment folder at a time: ``<folder>/.lock``, held with ``flock`` by the run's first process.

Why an operating-system lock: the kernel drops it when the holder ends, however it ends (an exception, SIGKILL,
the out-of-memory killer; on NFS the server drops the locks of a client that is gone), so a killed or requeued
run leaves nothing to clean up and its ``--resume auto`` simply locks again. A marker or pid file would outlive
a killed run, and whether its pid still runs cannot be checked from another node.

Only the launch's first process locks (``mabn.distributed.first_process``): the further processes of a DDP or
multi-node run belong to the same run and never wait on the lock. The lock is held until the process exits
(its descriptor stays open), so it covers what happens after ``fit`` returns as well (the loggers' last writes
at exit). Forked DataLoader workers share the descriptor: after a SIGKILL of the run they hold the lock until
they notice that their parent is gone (seconds). A process that locks a folder it already holds (the check
before a launch's run, several runs of one folder in one test process) keeps that lock.

What it needs of the filesystem: ``flock`` that every machine which can start a run on the folder sees. Local
filesystems have it. NFS has it with NFSv4, or NFSv3 with lockd (Linux turns ``flock`` into an NFS byte-range
lock; with the ``nolock`` mount option a lock is seen on its own machine only). Lustre has it when mounted with
``-o flock`` (``-o localflock``: its own node only; by default the call fails). Where the call fails (ENOLCK,
EOPNOTSUPP, ENOSYS) the run goes on, and one line says that the folder is not locked.

The lock file is opened with ``O_NOFOLLOW`` and used only when it is a regular file of one name, as the open
descriptor's ``fstat`` says (no race between the check and the use): a ``.lock`` that is a symbolic link or a
hard link (the holder's record would overwrite the file it points to, or the other name's file, which is the
same data), a folder, a device, a pipe or a socket stops the run with ``<folder>/.lock is not a regular file
(a symbolic link); remove it`` before anything is written.

A requeued SLURM job (``SLURM_RESTART_COUNT`` above 0) may start on another node while the server still keeps the
lock of its dead predecessor: an NFS server drops a vanished client's locks only after its lease (90 s by
default). A lock held from another host is therefore retried for ``$MABN_LOCK_LEASE_S`` seconds (default 120,
at most 3600) before the folder counts as in use; a first start, or a holder on this host (whose end the kernel
sees at once), waits only the moment ``SETTLE_S``. Settings are environment variables, as elsewhere in mabn
(``MABN_FUSED``); the lease is checked at every start, a first one included, so that a wrong value stops the
run the user watches rather than a requeue at night.

After locking, the holder writes its host, process id and start time into the lock file; a refused run reads
them back for its error line. The file itself is never removed: a lock file that nobody holds is free.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import socket
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .files import write_faults

LOCK_FILE = ".lock"
# flock fails with these where the filesystem has no (shared) locks: Lustre without -o flock, some FUSE mounts.
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
# A dry run's probe holds a shared lock for an instant, and a holder writes its line just after locking: both
# are waited out this long before a folder counts as taken, or a holder as unrecorded.
SETTLE_S = 1.0
# How long a requeued SLURM job retries a lock held from another host (NFS keeps a dead client's locks ~90 s).
LEASE_ENV = "MABN_LOCK_LEASE_S"
DEFAULT_LEASE_S = 120.0
# Linux's NFS server takes lease times of 10 to 3600 s (nfsd's nfsv4leasetime): a longer wait outlives any
# server's lease, and a value beyond it (1e9, a unit mistaken for ms) would hold a requeued job without end.
MAX_LEASE_S = 3600.0

_held: dict[Path, int] = {}  # folder (resolved) -> the open descriptor that holds its lock in this process
_unlockable: set[Path] = set()  # folders whose filesystem has no locks, said once per process


class FolderInUse(ConfigError):
    """Another process holds the experiment folder's lock."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str

    def __str__(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


def in_use_message(folder: Path, holder: Holder | None) -> str:
    who = str(holder) if holder is not None else f"its holder not yet recorded in {folder / LOCK_FILE}"
    return f"{folder} is in use by another run ({who})"


def _gone(holder: Holder) -> bool:
    """Whether ``holder`` ran on this machine and has ended: the record of an earlier run, read in the instant
    between a new holder's lock and its own record."""
    if holder.host != socket.gethostname():
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        pass
    return False


def _read_holder(fd: int) -> Holder | None:
    """The holder recorded in the lock file open as ``fd``; read through that descriptor, never by opening the
    file again (on NFS, closing any descriptor of a file drops this process's lock on it)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode())
            holder = Holder(str(record["host"]), int(record["pid"]), str(record["started"]))
            if not _gone(holder):
                return holder
        except (ValueError, KeyError, TypeError, OSError):
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _requeued() -> bool:
    """Whether this is a SLURM job that has been requeued (its predecessor may have held the lock elsewhere)."""
    count = os.environ.get("SLURM_RESTART_COUNT", "")
    return count.isdigit() and int(count) > 0


def lease_s() -> float:
    """``$MABN_LOCK_LEASE_S`` (default 120): how long a requeued job retries a lock held from another host;
    a ``ConfigError`` unless it is a number of seconds 0..``MAX_LEASE_S`` (``float`` also reads inf and nan)."""
    value = os.environ.get(LEASE_ENV, "")
    if not value:
        return DEFAULT_LEASE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_LEASE_S:  # also false for nan
        raise ConfigError(f"{LEASE_ENV}={value!r} is not a number of seconds from 0 to {MAX_LEASE_S:g}")
    return seconds


def _foreign(fd: int) -> bool:
    """Whether the holder recorded in the lock file ``fd`` ran on another host (or is not recorded)."""
    try:
        return json.loads(os.pread(fd, 4096, 0).decode())["host"] != socket.gethostname()
    except (ValueError, KeyError, TypeError, OSError):
        return True


# What an open() of the lock file fails with when the name is not a regular file: O_NOFOLLOW met a symbolic link;
# a folder cannot be opened for writing; a socket (or a device without a driver) cannot be opened at all.
_OPEN_REFUSALS = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a folder", errno.ENXIO: "a socket or a device"}
# What an opened lock file is, by its type, when that is not a regular file.
_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFIFO: "a named pipe"}


def _not_a_file(st: os.stat_result) -> str | None:
    """What an open lock file is when it is not a regular file of one name, for the error line; None when it is."""
    if not stat.S_ISREG(st.st_mode):
        return _KINDS.get(stat.S_IFMT(st.st_mode), "a special file")
    # Another name of the same data: the holder's record would overwrite that file as well.
    if st.st_nlink > 1:
        return f"a hard link: {st.st_nlink} names"
    return None


def _open_lock_file(path: Path, flags: int) -> int:
    """``path`` opened with ``flags`` and ``O_NOFOLLOW`` (``O_NONBLOCK``: a named pipe would block the open);
    a ``ConfigError`` unless it is a regular file of one name, judged on the open descriptor so that the file
    checked is the file used."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as err:
        if err.errno in _OPEN_REFUSALS:
            raise ConfigError(f"{path} is not a regular file ({_OPEN_REFUSALS[err.errno]}); remove it") from None
        raise
    kind = _not_a_file(os.fstat(fd))
    if kind is not None:
        os.close(fd)
        raise ConfigError(f"{path} is not a regular file ({kind}); remove it")
    return fd


def _holds(folder: Path) -> bool:
    """Whether this process holds ``folder``'s lock, on the lock file that is there now (not one of a folder
    that was removed and made again)."""
    fd = _held.get(folder.resolve())
    if fd is None:
        return False
    try:
        if os.fstat(fd).st_ino == os.stat(folder / LOCK_FILE).st_ino:
            return True
    except OSError:
        pass
    os.close(_held.pop(folder.resolve()))
    return False


def lock(folder: Path) -> None:
    """Lock ``folder`` (made if missing) for the life of this process. ``FolderInUse`` naming the holder when
    another process holds it; ``WriteError`` when the lock file cannot be written (a read-only folder, no
    space); a one-line warning, and no lock, where the filesystem has no locks."""
    folder = Path(folder)
    if _holds(folder):
        return
    lease = lease_s()  # checked at a first start too, where it is not used (see the module's doc)
    if not _requeued():
        lease = 0.0
    path = folder / LOCK_FILE
    with write_faults(path):
        folder.mkdir(parents=True, exist_ok=True)
        # Read-write: NFS grants an exclusive lock only on a descriptor open for writing.
        fd = _open_lock_file(path, os.O_RDWR | os.O_CREAT)
    try:
        start = time.monotonic()
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if lease > SETTLE_S and waited > SETTLE_S and waited <= lease and _foreign(fd):
                    if not said:
                        said = True
                        print(
                            f"{in_use_message(folder, _read_holder(fd))}; this requeued job retries for up to "
                            f"{lease:g} s ({LEASE_ENV}) while the lock of its predecessor expires",
                            file=sys.stderr,
                            flush=True,
                        )
                    time.sleep(0.5)
                    continue
                if waited > SETTLE_S:
                    raise FolderInUse(
                        f"{in_use_message(folder, _read_holder(fd))}: wait for it to end, or pick another folder "
                        "with --run-dir (--trainer.default_root_dir)"
                    ) from None
                time.sleep(0.05)
            except OSError as err:
                if err.errno not in UNSUPPORTED:
                    raise
                if folder.resolve() not in _unlockable:
                    _unlockable.add(folder.resolve())
                    print(
                        f"warning: {folder} is not locked against a second run: this filesystem has no locks "
                        f"({err.strerror}); see docs/reliability.md",
                        file=sys.stderr,
                        flush=True,
                    )
                os.close(fd)
                return
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started})
        with write_faults(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (record + "\n").encode(), 0)
    except BaseException:
        os.close(fd)  # also releases the lock, if it was taken
        raise
    _held[folder.resolve()] = fd


def in_use(folder: Path) -> str | None:
    """``in_use_message`` when another process holds ``folder``'s lock now, found without taking it (for a dry
    run); None when nobody does (or this process does, or the filesystem has no locks). Creates nothing. A
    ``ConfigError``, as the run's own ``lock``, for a lease that is no number of seconds and a lock file that is
    not a regular file of one name: a dry run refuses what the run would."""
    folder = Path(folder)
    lease_s()
    if folder.resolve() in _held:
        return None
    try:
        fd = _open_lock_file(folder / LOCK_FILE, os.O_RDONLY)
    except OSError:  # never locked, or not readable: the run itself says so
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: a holder's exclusive lock refuses it
        except BlockingIOError:
            return in_use_message(folder, _read_holder(fd))
        except OSError:
            return None
        return None
    finally:
        os.close(fd)
