"""Run every (row, seed) of the ablation, in parallel processes where the cores allow, with progress."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Protocol

import torch

from .rows import Row
from .train import RunResult, TrainConfig, train_run


@dataclass(frozen=True)
class Task:
    row: Row
    seed: int
    probe: bool  # record the probe layer's statistics at every step (for the figures)
    init: dict[str, torch.Tensor] | None = None  # a warm-start row's BN network
    keep_state: bool = False  # return the trained weights (a warm start's source)

    def run(self, config: TrainConfig) -> RunResult:
        return train_run(self.row, self.seed, config, self.probe, self.init, self.keep_state)


class Runnable(Protocol):
    """A run of ``run_all``: a ``Task``, or another kind of run (``segment.FinetuneTask``)."""

    def run(self, config: TrainConfig) -> RunResult: ...


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers(threads: int) -> int:
    """As many concurrent runs as the cores hold at ``threads`` torch threads each."""
    return max(1, available_cores() // threads)


def _outcomes(tasks: list[Runnable], config: TrainConfig, workers: int) -> Iterator[RunResult]:
    """Results in order of completion; one worker runs in this process (no start-up cost)."""
    if workers == 1:
        for task in tasks:
            yield task.run(config)
        return
    # spawn: a forked child would inherit torch's thread pools and locks from the parent.
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(task.run, config) for task in tasks]
        try:
            for future in as_completed(futures):
                yield future.result()
        except BaseException:  # a failed run or Ctrl-C: do not start the queued ones
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def run_all(tasks: list[Runnable], config: TrainConfig, workers: int) -> list[RunResult]:
    """Every task's result, printing the overall progress and ETA after each finished run."""
    start = time.perf_counter()
    results = []
    for result in _outcomes(tasks, config, workers):
        results.append(result)
        done, elapsed = len(results), time.perf_counter() - start
        eta = elapsed / done * (len(tasks) - done)
        print(f"== {done}/{len(tasks)} runs finished after {elapsed:.0f} s, ETA {eta:.0f} s", flush=True)
    return results
