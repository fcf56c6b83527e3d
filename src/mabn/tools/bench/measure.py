"""Timing and peak-memory measurement that works the same way on CPU and CUDA."""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(fns: dict[str, Callable[[], None]], device: torch.device, repeats: int, warmup: int = 3) -> dict:
    """Median wall time (s) of each callable; repeats are interleaved so all candidates share the noise, in
    a new order every round (seeded) so that none always runs after the same other one: a heavier predecessor
    can leave the device's clocks or caches in another state."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    names, order = list(fns), random.Random(0)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name in order.sample(names, len(names)):
            fn = fns[name]
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


@contextlib.contextmanager
def _quiet_stderr():
    """The CPU profiler prints start/stop lines on the C++ side; keep the bench output readable."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_memory(fn: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated when it started.

    CUDA: the caching allocator's peak counter. CPU: the profiler's allocation trace, whose
    "Total Allocated" field follows every allocation and free in order.
    """
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - start
    with _quiet_stderr():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0
    totals = [e["args"]["Total Allocated"] for e in events]
    start = totals[0] - events[0]["args"]["Bytes"]
    return max(totals) - start


def environment(device: torch.device) -> str:
    """One line naming the device and the versions, for table headers."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({torch.get_num_threads()} threads)"
    return f"{name}, torch {torch.__version__}"
