"""The checks that the batch-statistic norms share: their constructor arguments, a training input and its split
into ghost batches, and the error for a non-finite statistic."""

from __future__ import annotations

from torch import Tensor


def check_input(layer: str, x: Tensor, num_features: int, norm_batch_size: int | None, training: bool) -> int:
    """Validate a 4-D NCHW input and return G, the number of normalization groups in it.

    Runs before any state is touched, so a rejected batch leaves every buffer as it was. Only a
    training forward takes statistics, so only it needs a non-empty batch split into whole groups.
    """
    if x.dim() != 4:
        raise ValueError(f"{layer} expects 4-D input (N, C, H, W), got shape {tuple(x.shape)}")
    n, c, h, w = x.shape
    if c != num_features:
        raise ValueError(f"{layer} was built for {num_features} channels, got input with {c} (shape {tuple(x.shape)})")
    if not training:
        return 1
    if n * h * w == 0:
        raise ValueError(f"{layer} got an empty batch (shape {tuple(x.shape)}): statistics of nothing are undefined")
    b = norm_batch_size or n
    if n % b != 0:
        raise ValueError(
            f"{layer}: batch of {n} samples is not divisible by norm_batch_size={b}; "
            "use a batch size that is a multiple of it (e.g. drop_last=True in the data loader)"
        )
    return n // b


def check_norm_args(layer: str, momentum: float, norm_batch_size: int | None) -> None:
    """The constructor checks that MABN2d and BatchRenorm2d share."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{layer}: momentum must be in [0, 1), got {momentum}")
    if norm_batch_size is not None and norm_batch_size < 1:
        raise ValueError(f"{layer}: norm_batch_size must be >= 1 or None, got {norm_batch_size}")


def nonfinite_error(layer: str, what: str) -> FloatingPointError:
    """The error for a non-finite statistic, which the layer refused to store."""
    return FloatingPointError(
        f"{layer}: non-finite {what} (input or gradient holds NaN/inf or overflows); buffers left unchanged"
    )
