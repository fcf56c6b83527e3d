"""The GPU check's ``chain`` section (``make gpu-check SECTIONS=chain``): the whole chain of a real stage-2 run,
each link one command of the product.

On a GPU this is the run a user's first cluster job makes, shrunk to a few steps: PSPNet-101 fits at crop 713 on
the recipe's configuration under DDP with one process, with MABN's phase switches (``norm_policy``) moved to steps
``PHASE_STEPS`` so that they happen inside the few steps, while the training step replays CUDA graphs:

- a fit on the default path (``cuda_graph: auto``) accumulating 2 batches per step, both switches in its first
  epoch, killed once it has saved that epoch's checkpoint and resumed with ``--resume auto``;
- the same fit eagerly (``cuda_graph: false``), killed and resumed alike: the graphed run's losses (its CSV log)
  up to the kill and weights at the kill (a copy of ``last.ckpt`` taken then) are held to the eager run's in this
  process, within ``LOSS_RTOL`` and ``WEIGHT_RTOL``; the graphed run's logged layers must renormalize from the
  policy's step on. Both compared fits choose their cuDNN algorithms deterministically (``COMPARED``): CUDA graphs
  replay the kernels the eager step runs, but cuDNN's benchmark, timing the two fits that share the GPU, picks
  other algorithms in each process, whose rounding the first steps of a fresh PSPNet-101 magnify. After the
  resume the differences are reported, not held: a resumed fit draws other augmentations than the uninterrupted
  one would, so two resumed runs train on other crops;
- ``test``, ``predict`` and ``export`` of the resumed run's checkpoint;
- two processes on the one device under ``bf16-mixed`` (two single-device nodes on localhost, started as
  ``torchrun`` starts them, over gloo), so that DDP's gradient all-reduce follows a CUDA-graphed backward.

Each link is a subprocess with a time limit (``LINK_TIMEOUT_S``, and ``deadline`` for the whole chain); a link
starts as soon as the links it needs have ended, so the independent fits run at the same time (one GPU holds
them all). The report (a Markdown table: command, exit status, seconds, what was checked) is rewritten as each
link ends, so a session cut short keeps what it ran. The data is the demo's generated street scenes at a size of
the recipe's order. Without CUDA the same chain runs on CPU processes (what the tests run, on a small model):
both fits are then eager, and the comparison holds eager against eager.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mabn.run import load_weights_file

LINK_TIMEOUT_S = 240  # one link's limit: a PSPNet-101 fit of a few steps starts, captures and saves within it
TRAIN_IMAGES = 16  # the generated training split: an epoch of 4 steps of 2 accumulated batches of 2 images
ACCUMULATE = 2  # batches per optimizer step of the compared fits
FIT_EPOCHS = 2  # of the compared fits, each killed after its first checkpoint (the first epoch's end) and resumed
FIT_STEPS = FIT_EPOCHS * TRAIN_IMAGES // (2 * ACCUMULATE)
KILL_STEP = FIT_STEPS // FIT_EPOCHS  # the optimizer step of the first epoch's checkpoint, at which the fits are killed
KILLED = "killed.ckpt"  # beside last.ckpt: a copy of it as the killed fit left it
PHASE_STEPS = (2, 4)  # every group's moving_stats_first_step and renorm_first_step: both switches in the first epoch
POLICY_GROUPS = ("encoder", "heads")  # configs/cityscapes.yaml's norm_policy groups
# The fits' checkpoints: the newest at every validation (the recipe's keeps the best mIoU); last.ckpt is written
# at every validation by mabn.run.LastCheckpoint.
CHECKPOINTS = [
    {
        "class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
        "init_args": {"filename": "step{step}", "auto_insert_metric_name": False},
    }
]
RANKS_PRECISION = "bf16-mixed"  # the two-rank fit's Trainer precision
LOSS_RTOL = 1e-3  # graphed against eager: each step's logged loss
WEIGHT_RTOL = 1e-3  # graphed against eager: |w_graphed - w_eager| / |w_eager| over the floating tensors of last.ckpt
# The compared fits' Trainer: cuDNN's algorithms chosen by its heuristics, the same in both processes, and
# deterministic where torch has them (``warn``: the adaptive pooling's backward has no deterministic kernel).
COMPARED = ("--trainer.benchmark", "false", "--trainer.deterministic", "warn")
GRAPHED = "run as CUDA graphs"  # what the default path logs when it captures (mabn.tasks.base)


@dataclass
class Link:
    """One command of the chain and what became of it."""

    name: str
    command: list[str]
    status: str = "not run"
    seconds: float | None = None
    checked: list[str] = field(default_factory=list)
    tail: str = ""

    def row(self) -> str:
        seconds = "" if self.seconds is None else f"{self.seconds:.1f}"
        return f"| {self.name} | {self.status} | {seconds} | {'; '.join(self.checked)} |"


@dataclass(frozen=True)
class Plan:
    """What the chain trains: the network depth, the crop, the generated images' size, where it works."""

    arch: str = "resnet101"
    crop: int = 713
    image_size: tuple[int, int] = (512, 1024)
    work: Path = Path("runs/gpu-check/chain")  # the chain's own folders: a new one per chain (``fresh``)
    # The recipe's loader workers: 8 processes pinning 713x713 batches while the first step captures its graphs,
    # the condition a capture that is not thread-local fails in
    workers: int = 8

    def fresh(self) -> Plan:
        """This plan in a new folder beside ``work``, created here: a chain never meets an earlier chain's run."""
        stem = f"chain-{time.strftime('%Y%m%d-%H%M%S')}"
        for n in range(1000):
            work = self.work.with_name(stem if n == 0 else f"{stem}-{n}")
            try:
                work.mkdir(parents=True)
            except FileExistsError:
                continue
            return replace(self, work=work)
        raise RuntimeError(f"no free folder {stem}-<n> beside {self.work}")

    @property
    def data(self) -> Path:
        return self.work.parent / "data"  # generated once, shared by every chain under the same parent

    def fit(
        self,
        run: Path,
        epochs: int,
        *launch: str,
        strategy: tuple[str, ...] = ("ddp",),
        accumulate: int = 1,
        cli: tuple[str, ...] = (),
    ) -> list[str]:
        """A stage-2 command of the chain into ``run``, ``epochs`` long: validation and ``last.ckpt``
        (``CHECKPOINTS``) at the end of every epoch, the phase switches at
        ``PHASE_STEPS``, the losses and the logged layers' statistics in ``run/metrics.csv`` at every step;
        ``launch``: more ``python -m mabn cityscapes`` options; ``strategy``: the Trainer's, with its arguments;
        ``cli``: more LightningCLI arguments."""
        phases = [
            (f"--model.init_args.norm_policy.groups.{group}.{key}", str(first))
            for group in POLICY_GROUPS
            for key, first in zip(("moving_stats_first_step", "renorm_first_step"), PHASE_STEPS)
        ]
        return [
            *_mabn("cityscapes", "--data", str(self.data), "--norm", "mabn", "--backbone", "none"),
            *("--gpus", "1", "--run-dir", str(run), *launch, "--"),
            *("--model.init_args.arch", self.arch, "--data.init_args.crop_size", str(self.crop)),
            *("--data.init_args.global_batch_size", "2", "--data.init_args.num_workers", str(self.workers)),
            *("--trainer.max_epochs", str(epochs), "--trainer.accumulate_grad_batches", str(accumulate)),
            *("--trainer.check_val_every_n_epoch", "1", "--trainer.limit_val_batches", "1"),
            *("--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false"),
            *("--trainer.logger", "mabn.run.loggers.CSVLogger", "--trainer.logger.save_dir", str(run)),
            *("--trainer.logger.flush_logs_every_n_steps", "1", "--trainer.log_every_n_steps", "1"),
            *("--trainer.callbacks", json.dumps(CHECKPOINTS)),
            *(arg for pair in phases for arg in pair),
            *("--model.init_args.norm_policy.log_every_n_steps", "1"),
            *("--trainer.strategy", *strategy, *cli),
        ]


def _mabn(*args: str) -> list[str]:
    return [sys.executable, "-m", "mabn", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(
    link: Link, env: dict[str, str] | None = None, kill_when: Path | None = None, limit: float | None = None
) -> str:
    """Run ``link.command`` for at most ``limit`` seconds (default ``LINK_TIMEOUT_S``); with ``kill_when``, SIGKILL
    its process group once that file exists. Returns the output and sets the link's status and seconds."""
    limit = LINK_TIMEOUT_S if limit is None else limit
    start = time.perf_counter()
    with subprocess.Popen(
        link.command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # its own process group: a kill reaches DDP's workers and loader processes
    ) as proc:
        killed = False
        try:
            if kill_when is not None:
                while proc.poll() is None and not kill_when.is_file():
                    if time.perf_counter() - start > limit:
                        raise subprocess.TimeoutExpired(link.command, limit)
                    time.sleep(0.2)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
            out, _ = proc.communicate(timeout=max(1.0, limit - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            link.status = f"timed out after {limit:.0f} s"
        else:
            link.status = "killed as planned" if killed else f"exit {proc.returncode}"
    link.seconds = time.perf_counter() - start
    link.tail = "\n".join(out.splitlines()[-15:])
    return out


def _check(link: Link, ok: bool, what: str) -> bool:
    link.checked.append(("ok: " if ok else "FAILED: ") + what)
    return ok


def _check_graphs(link: Link, out: str, device: torch.device) -> None:
    """On a GPU: the default path captured CUDA graphs."""
    if device.type == "cuda":
        _check(link, GRAPHED in out, "captured CUDA graphs (cuda_graph auto)")


def _metrics(path: Path) -> dict[str, dict[int, float]]:
    """Each column of a run's ``metrics.csv`` as {step: value}, the last value logged at a step winning (a killed
    run may log a step that its resumed run logs again)."""
    columns: dict[str, dict[int, float]] = {}
    if not path.is_file():
        return columns
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None) and row.get("step"):
                    columns.setdefault(key, {})[int(float(row["step"]))] = float(value)
    return columns


def _relative(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float, str]:
    """|a - b| / |b| (2-norms, float64) of all named pairs together, and the largest of one pair with its name
    (a pair whose tensors are near zero, as a bias a few steps from its zero start, can have a large one)."""
    diff = total = worst = 0.0
    where = ""
    for name, (a, b) in pairs.items():
        a, b = a.double(), b.double()
        d, n = (a - b).norm().item(), b.norm().item()
        diff, total = diff + d * d, total + n * n
        one = d / max(n, 1e-12)
        if not one <= worst:  # NaN wins too
            worst, where = one, name
    return math.sqrt(diff) / max(math.sqrt(total), 1e-12), worst, where


def compare(link: Link, graphed: Path, eager: Path, device: torch.device) -> None:
    """The graphed run (``graphed``, killed and resumed) against the eager one (``eager``): the losses up to the kill
    and the weights and buffers at the kill held to the tolerances, those after the resume reported; and the
    renormalization switch in the graphed run's log."""
    start = time.perf_counter()
    both = "graphed against eager" if device.type == "cuda" else "eager against eager (no CUDA)"
    logs = [_metrics(run / "metrics.csv") for run in (graphed, eager)]
    losses = [log.get("train/loss", {}) for log in logs]
    steps = sorted(losses[0])
    logged = steps == list(range(1, FIT_STEPS + 1)) == sorted(losses[1])  # a row per optimizer step done
    # Held to the tolerance: the steps before the kill, and the weights at the kill. After the resume both runs are
    # reported, not held: a resumed stage-2 fit does not draw its augmentations as the uninterrupted one would, so
    # two resumed runs see different crops (docs/reliability.md, "Resume").
    if _check(link, logged, f"both logged the losses of {FIT_STEPS} steps"):
        errors = {s: abs(losses[0][s] - losses[1][s]) / max(abs(losses[1][s]), 1e-12) for s in steps}
        before = [s for s in steps if s <= KILL_STEP]
        step = max(before, key=lambda s: (math.isnan(errors[s]), errors[s]))
        after = max(errors[s] for s in steps if s > KILL_STEP)
        _check(
            link,
            all(errors[s] <= LOSS_RTOL for s in before),
            f"losses {both} within rtol {LOSS_RTOL:g} up to the kill at step {KILL_STEP} (max {errors[step]:.1e} at "
            f"step {step}; after the resume, reported only: max {after:.1e})",
        )
    for name, at_step, held in ((KILLED, KILL_STEP, True), ("last.ckpt", FIT_STEPS, False)):
        states = [load_weights_file(run / "checkpoints" / name, "checkpoint", RuntimeError, mmap=True)
                  for run in (graphed, eager)]  # fmt: skip
        if not _check(link, all(s["global_step"] == at_step for s in states), f"both {name} at step {at_step}"):
            continue
        ours, theirs = (s["state_dict"] for s in states)
        pairs = {k: (v, theirs[k]) for k, v in ours.items() if v.is_floating_point() and k in theirs}
        together, worst, where = _relative(pairs)
        largest = f"; the largest of one tensor {worst:.1e}, {where}" if where else ""
        if held:
            ok = set(ours) == set(theirs) and together <= WEIGHT_RTOL
            _check(link, ok, f"weights and buffers at the kill {both} within {WEIGHT_RTOL:g} relative "
                             f"({together:.1e}{largest})")  # fmt: skip
        else:
            link.checked.append(f"reported: weights and buffers at step {at_step} {together:.1e} relative{largest}")
    # The renormalization switch in the graphed run: r is 1 in every logged layer before the policy's first step,
    # and moves from it on. (Moving statistics show only once a layer's buffer holds buffer_size statistics.)
    # A row's step is the optimizer steps done after its batch: the batch logged at PHASE_STEPS[1] is the first one
    # renormalized.
    rs = [by_step for key, by_step in logs[0].items() if key.endswith("/r_mean")]
    switched = bool(rs) and all(
        sorted(r) == list(range(1, FIT_STEPS + 1)) and all((r[s] == 1) == (s < PHASE_STEPS[1]) for s in r) for r in rs
    )
    _check(link, switched, f"the graphed run's logged layers renormalize from step {PHASE_STEPS[1]} on (r_mean)")
    link.status = "compared"
    link.seconds = time.perf_counter() - start


def describe(plan: Plan) -> str:
    """The chain in one line (``--dry-run``)."""
    return (
        f"the chain of a real stage-2 run: {plan.arch} PSPNet at crop {plan.crop} with {plan.workers} loader workers, "
        f"{FIT_STEPS} steps of {ACCUMULATE} "
        f"accumulated batches with MABN's phase switches at steps {PHASE_STEPS[0]} and {PHASE_STEPS[1]}; the "
        "default path (CUDA graphs on a GPU) killed after its first epoch's checkpoint and resumed, against the "
        f"same fit eager, killed and resumed alike (losses rtol {LOSS_RTOL:g}, weights {WEIGHT_RTOL:g} relative); "
        f"test, predict, export of its checkpoint; two ranks on one device over gloo under {RANKS_PRECISION}"
    )


def report(links: list[Link], plan: Plan) -> str:
    """The chain's Markdown section: a row per link, the last lines of each failed link, every command."""
    rows = "\n".join(link.row() for link in links)
    failed = [link for link in links if any(c.startswith("FAILED") for c in link.checked)]
    tails = "".join(f"`{link.name}`, last lines:\n\n```text\n{link.tail}\n```\n\n" for link in failed if link.tail)
    shown = {link.name: shlex.join(link.command).replace(sys.executable, "python") for link in links if link.command}
    commands = "\n".join(f"- {name}: `{command}`" for name, command in shown.items())
    return (
        f"### The chain of a stage-2 run\n\nThe check's `chain` section: {plan.arch} PSPNet, crop {plan.crop}, "
        f"generated images of {plan.image_size[0]}x{plan.image_size[1]}, {FIT_STEPS} steps of {ACCUMULATE} "
        f"accumulated batches, phase switches at steps {PHASE_STEPS[0]} and {PHASE_STEPS[1]}, a checkpoint at "
        f"each epoch's end ({TRAIN_IMAGES} images); each link a subprocess limited to {LINK_TIMEOUT_S} s, started "
        f"once the links it needs have ended; the comparison in the check's process, losses within rtol "
        f"{LOSS_RTOL:g}, weights within {WEIGHT_RTOL:g} relative\n\n"
        f"| link | status | s | checked |\n|---|---|---:|---|\n{rows}\n\n"
        f"{tails}Commands:\n\n{commands}"
    )


def run(plan: Plan, device: torch.device, save: Callable[[str], object], deadline: float | None = None) -> list[Link]:
    """Every link, each once the links it needs have ended, ``save(report)`` after each; a link whose input is
    missing (a checkpoint the fit did not write) is reported as not run. ``device``: where the product's commands
    will train (they pick it). ``deadline`` (``time.monotonic()``): links still running then are killed, links not
    started are not run."""
    from mabn.data.synthetic import cityscapes as demo_cityscapes

    demo_cityscapes.generate(plan.data, n_train=TRAIN_IMAGES, n_val=2, size=plan.image_size)
    graphed, eager = plan.work / "graphed", plan.work / "eager"
    last, eager_last = (folder / "checkpoints" / "last.ckpt" for folder in (graphed, eager))
    fits = {"accumulate": ACCUMULATE, "cli": COMPARED}
    eager_fits = {"accumulate": ACCUMULATE, "cli": (*COMPARED, "--model.init_args.cuda_graph", "false")}
    links = [
        Link("fit, killed after its first checkpoint", plan.fit(graphed, FIT_EPOCHS, **fits)),
        Link("fit, resumed", plan.fit(graphed, FIT_EPOCHS, "--resume", "auto", **fits)),
        Link("fit eager, killed after its first checkpoint", plan.fit(eager, FIT_EPOCHS, **eager_fits)),
        Link("fit eager, resumed", plan.fit(eager, FIT_EPOCHS, "--resume", "auto", **eager_fits)),
        Link("graphed fit against eager fit", []),
        Link("test", _mabn("test", str(last), "--num-workers", "0")),
        Link("predict", _mabn("predict", str(last), "--out", str(plan.work / "predictions"))),
        Link("export", _mabn("export", str(last), "--input-size", "256", "512")),
        Link(f"two ranks on one device (gloo), {RANKS_PRECISION}", _two_ranks(plan)),
    ]
    fit, resumed, eager_fit, eager_resumed, compared, test, predict, export, ranks = links

    def left() -> float:
        return LINK_TIMEOUT_S if deadline is None else min(LINK_TIMEOUT_S, deadline - time.monotonic())

    def fitting(link: Link, checkpoint: Path, graphs: bool, killed: bool) -> Callable[[], None]:
        """A fit killed once ``checkpoint`` exists, or one that resumes from it."""

        def job() -> None:
            out = _run(link, kill_when=checkpoint if killed else None, limit=left())
            if killed:
                ok = link.status == "killed as planned" and checkpoint.is_file()
                if _check(link, ok, f"killed with {checkpoint.name} written"):
                    # The weights at the kill, which the comparison holds to the other run's: the resume rewrites
                    # last.ckpt.
                    shutil.copyfile(checkpoint, checkpoint.with_name(KILLED))
            else:
                _check(link, link.status == "exit 0", "exit 0")
                _check(link, "Resuming from" in out, "resumed from the killed run's checkpoint")
            if graphs:
                _check_graphs(link, out, device)
            else:
                _check(link, GRAPHED not in out, "trained eagerly (cuda_graph false)")

        return job

    def product(link: Link, expect: str) -> Callable[[], None]:
        def job() -> None:
            out = _run(link, limit=left())
            _check(link, link.status == "exit 0", "exit 0")
            _check(link, expect in out, f"its output names {expect}")

        return job

    def two_ranks() -> None:
        out = _run(ranks, limit=left())
        _check(ranks, ranks.status == "exit 0", "both ranks exit 0")
        _check(ranks, "x 2 device(s) = global batch 4" in out, "one DDP run of 2 processes")
        losses = _metrics(plan.work / "ranks" / "metrics.csv").get("train/loss", {})
        finite = bool(losses) and all(math.isfinite(v) for v in losses.values())
        _check(ranks, finite, f"finite {RANKS_PRECISION} losses logged ({len(losses)} steps)")
        _check_graphs(ranks, out, device)

    # link -> (the links it waits for, what it needs on disk, its work)
    work: dict[str, tuple[tuple[Link, ...], tuple[Path, ...], Callable[[], None]]] = {
        fit.name: ((), (), fitting(fit, last, True, killed=True)),
        resumed.name: ((fit,), (last,), fitting(resumed, last, True, killed=False)),
        eager_fit.name: ((), (), fitting(eager_fit, eager_last, False, killed=True)),
        eager_resumed.name: (
            (eager_fit,),
            (eager_last,),
            fitting(eager_resumed, eager_last, graphs=False, killed=False),
        ),
        compared.name: (
            (resumed, eager_resumed),
            (last, eager_last),
            lambda: compare(compared, graphed, eager, device),
        ),
        test.name: ((resumed,), (last,), product(test, "| **mean** |")),
        predict.name: ((resumed,), (last,), product(predict, "Wrote 2 predictions")),
        export.name: ((resumed,), (last,), product(export, "TorchScript")),
        ranks.name: ((), (), two_ranks),
    }
    _run_when_ready(links, work, lambda: save(report(links, plan)), left)
    return links


def _run_when_ready(
    links: list[Link],
    work: dict[str, tuple[tuple[Link, ...], tuple[Path, ...], Callable[[], None]]],
    saved: Callable[[], object],
    left: Callable[[], float],
) -> None:
    """Each link's work in a thread of its own, started once the links it waits for have ended; a link whose files
    are missing then, or that would start with no time left, is reported as not run. ``saved()`` after each link
    ends, one at a time."""
    ended = {link.name: threading.Event() for link in links}
    lock = threading.Lock()

    def one(link: Link) -> None:
        waits, files, job = work[link.name]
        try:
            for other in waits:
                ended[other.name].wait()
            missing = [str(path) for path in files if not path.is_file()]
            if missing:
                link.status = f"not run: no {', '.join(missing)}"
            elif left() <= 0:
                link.status = "not run: the time limit had passed"
            else:
                job()
        except Exception as err:  # this process's own error (a checkpoint it cannot read): the link failed
            _check(link, False, f"{type(err).__name__}: {err}")
        finally:
            with lock:
                saved()
                print(f"chain: {link.name}: {link.status}", flush=True)
            ended[link.name].set()

    threads = [threading.Thread(target=one, args=(link,), name=link.name) for link in links]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _two_ranks(plan: Plan) -> list[str]:
    """Two single-device nodes on localhost as torchrun starts them, in one shell: gloo, since NCCL refuses two
    ranks on one GPU; each rank's node-local rank is 0, so both train on the one device."""
    gloo = ("pytorch_lightning.strategies.DDPStrategy", "--trainer.strategy.process_group_backend", "gloo")
    fit = plan.fit(plan.work / "ranks", 1, "--nodes", "2", strategy=gloo, cli=("--trainer.precision", RANKS_PRECISION))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    node = [shlex.join([*torchrun, "--node_rank", str(rank), *fit[1:]]) for rank in (0, 1)]
    return ["bash", "-c", f"{node[1]} & {node[0]}; first=$?; wait $!; exit $(( first | $? ))"]


def failed(links: list[Link]) -> list[str]:
    """The names of the links with a failed check, or not run (once ``run`` has returned)."""
    return [
        link.name
        for link in links
        if link.status.startswith("not run") or any(c.startswith("FAILED") for c in link.checked)
    ]
