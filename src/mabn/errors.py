"""The error a user can act on without a traceback: one line naming the value or file and what would work."""

from __future__ import annotations

import os
import sys
from contextlib import suppress
from pathlib import Path


class UserError(ValueError):
    """A mistake the user fixes (a configuration, a path, a dataset, a file): the entry points print its message
    as one ``error:`` line and exit with status 2. Every such error of the product derives from it."""


class ConfigError(UserError):
    """A configuration, path or checkpoint that cannot work as given."""


class UserErrors(ConfigError):
    """Several independent mistakes reported at once (a dry run names them all): ``messages``, one line each, the
    error's message their lines."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


def own_message(err: BaseException) -> str:
    """The message of ``err``, or for an error that a DataLoader worker re-raised ("Caught ... in DataLoader worker
    process N", then the worker's traceback) the original error's message, from the traceback's last line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        return lines[-1].split(": ", 1)[-1]
    return str(err)


class WriteError(ConfigError):
    """The operating system refused a write for a reason the user fixes (no space, quota, a read-only folder,
    permissions): ``cannot write <path>: <cause>``, the path shown relative to the working folder when it lies
    below it."""

    def __init__(self, path: str | os.PathLike, cause: str) -> None:
        self.path, self.cause = Path(path), cause
        shown = self.path
        if shown.is_absolute():
            with suppress(ValueError):
                shown = shown.relative_to(Path.cwd())
        super().__init__(f"cannot write {shown}: {cause}")


USER_MESSAGE = "mabn_user_message"  # the attribute ``explain`` sets


def explain(err: BaseException, message: str) -> None:
    """Give a library's error (torch's out-of-memory error, say) the one line the entry points print for it
    instead of its traceback; set where the context that makes the line useful is known."""
    setattr(err, USER_MESSAGE, message)


def explained(err: BaseException) -> str | None:
    """The line ``explain`` gave ``err``, if any."""
    return getattr(err, USER_MESSAGE, None)


def user_error(err: BaseException) -> str | None:
    """The message of the ``UserError`` (a dataset, backbone, configuration or argument mistake; ``WriteError``:
    a full disk, a quota, a read-only folder) behind ``err``, or the line ``mabn.errors.explain`` gave a library's
    error (CUDA out of memory in a training step), if there is one.

    jsonargparse wraps errors raised while it instantiates the data module, and a DataLoader worker
    re-raises with its traceback in the message: dig out the original, one-line message.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, UserError):
            return own_message(err)
        if explained(err) is not None:
            return explained(err)
        err = err.__cause__ or err.__context__
    return None


def exit_on_user_error(err: BaseException) -> None:
    """The one way a command fails (``mabn.__main__`` calls it for every command): a user error as one ``error:``
    line (a ``UserErrors``: one per mistake) and exit status 2; anything else is re-raised, a traceback."""
    message = user_error(err)
    if message is None:
        raise err
    print("\n".join(f"error: {line}" for line in message.splitlines()), file=sys.stderr)
    sys.exit(2)
