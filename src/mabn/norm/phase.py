"""The phase rule of MABN2d and BatchRenorm2d: whether training step t (1-based) uses moving statistics, and whether
it renormalizes, given the first step of each phase.

Written once, as one function that Python ints, torch tensors and Triton values all evaluate: MABN2d's own timeline
(torch ops on its step counter, ``mabn.py``), its Triton kernels (this function compiled into them,
``mabn_kernels.py``, so a captured CUDA graph follows the counter on the device) and MABNCallback's policy per module
group (Python ints at each optimizer step, ``mabn.callbacks.policy``).
"""


# No annotations and no module-level names: Triton compiles this function's source as it stands.
def phase(t, moving_first, renorm_first):
    """(moving statistics, renormalization) at step ``t``: moving statistics from step ``moving_first`` on;
    renormalization from step ``renorm_first`` on, and never before the step after the first with moving
    statistics (r compares the moving statistic with the EMA, so it waits for one)."""
    moving = t >= moving_first
    renorm = (t >= renorm_first) & (t > moving_first)
    return moving, renorm
