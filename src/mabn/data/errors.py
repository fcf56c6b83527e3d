"""The one error type for bad datasets: its message names the offending file or folder."""


class DatasetError(ValueError):
    """A dataset that is missing, incomplete or unreadable."""
