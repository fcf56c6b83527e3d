"""The error a user can act on without a traceback: one line naming the value or file and what would work."""


class ConfigError(ValueError):
    """A configuration, path or checkpoint that cannot work as given; the entry points print its message as
    one ``error:`` line and exit with status 2."""
