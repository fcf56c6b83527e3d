"""The error a user can act on without a traceback: one line naming the value or file and what would work."""


class ConfigError(ValueError):
    """A configuration, path or checkpoint that cannot work as given; the entry points print its message as
    one ``error:`` line and exit with status 2."""


def own_message(err: BaseException) -> str:
    """The message of ``err``, or for an error that a DataLoader worker re-raised ("Caught ... in DataLoader worker
    process N", then the worker's traceback) the original error's message, from the traceback's last line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        return lines[-1].split(": ", 1)[-1]
    return str(err)
