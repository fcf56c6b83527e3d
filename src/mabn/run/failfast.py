"""FailFast: when one DDP process raises, every process stops within seconds and names that error.

Left alone, the other processes of a DDP run wait in their next collective. Over gloo a peer that exits
closes its sockets, so they fail at once, but with "Connection closed by peer" instead of the cause; over
NCCL, and over gloo when the failing process does not exit (a hung DataLoader worker, a teardown stuck in
a collective), they wait for the process group's timeout (30 minutes under Lightning).

The failing process writes its one-line error into the process group's key-value store (the TCPStore every
process already reaches). A watcher thread in every process polls that key: on seeing a peer's failure it
says so on stderr and gives its own process ``grace_s`` seconds to end by itself, then ends it. The failing
process waits, briefly, until the others have read its message (the store lives in rank 0's process and
ends with it), and it too is ended after ``grace_s`` if its own exit hangs.

When that error is one the user acts on (the CLI's one ``error:`` line: a full disk, a quota, a corrupt image,
CUDA out of memory in a training step), its line goes into the store with it, and every other process that then
stops by an error of its own ends with that same line and exit status 2, instead of a traceback.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytorch_lightning as pl
import torch.distributed as dist

from ..compat import default_store
from ..distributed import rank, world_size
from ..errors import explain, own_message, user_error

FAILED_KEY = "mabn/failfast/failed"  # the first failing process's one-line error
SEEN_KEY = "mabn/failfast/seen"  # how many other processes have read it
STORE_GONE = "rank 0 is gone (the process group's store does not answer)"
# FAILED_KEY holds "<rank R failed: ...>" and, after this separator, the user's line for that error, if it has one.
USER_LINE = "\n"


def one_line(err: BaseException) -> str:
    """``Type: message`` on one line: the first line of the error's own message (``own_message``)."""
    lines = [line.strip() for line in own_message(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def user_line(err: BaseException) -> str:
    """The CLI's one-line message for ``err`` when it is a user error, else ""."""

    message = user_error(err) or ""
    return message.splitlines()[0] if message else ""


class FailFast(pl.Callback):
    """Ends every process of a multi-process run within ``grace_s`` seconds of one raising, each process's
    error starting with ``rank R failed: <error>``. Single-process runs start no thread and store nothing."""

    def __init__(self, grace_s: float = 15.0, poll_s: float = 1.0) -> None:
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._store: dist.Store | None = None
        self._stop = threading.Event()
        self._failure: str | None = None  # the message this process stops for
        self._user_line = ""  # the user's line of that failure, if it has one
        self._deadline: float | None = None  # monotonic time at which the watcher ends this process

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if world_size() < 2 or self._store is not None:
            return
        self._store = default_store()
        self._failure = self._deadline = None  # a grace armed as a previous stage ended no longer applies
        self._stop = threading.Event()  # one per watcher: a stopped one may not have woken up yet
        threading.Thread(target=self._watch, args=(self._store, self._stop), name="mabn-failfast", daemon=True).start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A finished stage: peers that end earlier take the store with them, which is no failure.
        self._stop.set()
        self._store = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # KeyboardInterrupt and Lightning's SIGTERM exit are no error of this process: every process gets them.
        if self._store is None or not isinstance(exception, Exception):
            return
        mine = f"rank {rank()} failed: {one_line(exception)}"
        record = f"{mine}{USER_LINE}{user_line(exception)}"
        try:
            first, _, shown = self._store.compare_set(FAILED_KEY, "", record).decode().partition(USER_LINE)
        except Exception:  # the store went with rank 0: what the watcher read, if anything, is all there is
            first, shown = self._failure or STORE_GONE, self._user_line
        if first == mine:
            self._await_readers()
        else:
            # Lightning re-raises this very exception: its message is what the user reads last, or the failing
            # process's own line when that is a user error (the same line, and exit status 2, on every process).
            exception.args = (f"{first} (rank {rank()} then stopped with {one_line(exception)})",)
            if shown:
                explain(exception, shown)
        self._stop_within_grace(first, shown)

    def _await_readers(self) -> None:
        """Waits up to ``grace_s`` until every other process has read this process's error."""
        end = time.monotonic() + self.grace_s
        while time.monotonic() < end:
            try:
                if self._store.add(SEEN_KEY, 0) >= world_size() - 1:
                    return
            except Exception:
                return
            time.sleep(self.poll_s / 4)

    def _stop_within_grace(self, message: str, shown: str = "") -> None:
        if self._deadline is None:
            self._failure, self._user_line = message, shown
            self._deadline = time.monotonic() + self.grace_s

    def _watch(self, store: dist.Store, stop: threading.Event) -> None:
        while not stop.wait(self.poll_s):
            if self._deadline is not None:
                if time.monotonic() >= self._deadline:
                    print(f"[rank {rank()}] {self._failure}: ending this process", file=sys.stderr, flush=True)
                    os._exit(1)
                continue
            try:
                if not store.check([FAILED_KEY]):
                    continue
                message, _, shown = store.get(FAILED_KEY).decode().partition(USER_LINE)
                if message.startswith(f"rank {rank()} "):
                    continue  # this process's own error: on_exception handles it
                store.add(SEEN_KEY, 1)
            except Exception:
                # Silent until the grace ends: at the end of a successful run rank 0 may exit first, and this
                # process's teardown then stops the watcher before the grace is over.
                self._stop_within_grace(STORE_GONE)
                continue
            print(f"[rank {rank()}] {message}: stopping", file=sys.stderr, flush=True)
            self._stop_within_grace(message, shown)
