"""``python -m mabn bench chain``: the whole chain of a real stage-2 run, each link one command of the product.

On a GPU this is the run a user's first cluster job makes, shrunk to a few steps: a PSPNet-101 fit at crop 713 on
the default path (``cuda_graph: auto``) under DDP with one process, killed once it has saved a checkpoint and
resumed with ``--resume auto``; ``test``, ``predict`` and ``export`` of the resumed run's checkpoint; then two
processes on the one device (two single-device nodes on localhost, started as ``torchrun`` starts them, over gloo)
so that DDP's gradient all-reduce follows a CUDA-graphed backward. Each link runs as a subprocess with a time
limit, and the report (a Markdown table: command, exit status, seconds, what was checked) is rewritten as each
link ends, so a session cut short keeps what it ran. The data is the demo's generated street scenes at a size of
the recipe's order; without CUDA the same chain runs on CPU processes (what the tests run, on a small model).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

LINK_TIMEOUT_S = 240  # one link's limit: a PSPNet-101 fit of a few steps starts, captures and saves within it
FIT_STEPS = 6  # the resumed fit ends here; the first run is killed after its first checkpoint (every 2 steps)


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

    def fit(self, run: Path, steps: int, *launch: str, strategy: tuple[str, ...] = ("ddp",)) -> list[str]:
        """A stage-2 command of the chain into ``run`` (validation and ``last.ckpt`` every 2 steps); ``launch``:
        more ``python -m mabn cityscapes`` options; ``strategy``: the Trainer's, with its arguments."""
        return [
            *_mabn("cityscapes", "--data", str(self.data), "--norm", "mabn", "--backbone", "none"),
            *("--gpus", "1", "--run-dir", str(run), *launch, "--"),
            *("--model.init_args.arch", self.arch, "--data.init_args.crop_size", str(self.crop)),
            *("--data.init_args.global_batch_size", "2", "--data.init_args.num_workers", "2"),
            *("--trainer.max_steps", str(steps), "--trainer.val_check_interval", "2"),
            *("--trainer.check_val_every_n_epoch", "null", "--trainer.limit_val_batches", "1"),
            *("--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false"),
            *("--trainer.logger", "null", "--trainer.strategy", *strategy),
        ]


def _mabn(*args: str) -> list[str]:
    return [sys.executable, "-m", "mabn", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(link: Link, env: dict[str, str] | None = None, kill_when: Path | None = None) -> str:
    """Run ``link.command``; with ``kill_when``, SIGKILL its process group once that file exists. Returns the
    output and sets the link's status and seconds."""
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
                    if time.perf_counter() - start > LINK_TIMEOUT_S:
                        raise subprocess.TimeoutExpired(link.command, LINK_TIMEOUT_S)
                    time.sleep(0.2)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
            out, _ = proc.communicate(timeout=max(1.0, LINK_TIMEOUT_S - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            link.status = f"timed out after {LINK_TIMEOUT_S} s"
        else:
            link.status = "killed as planned" if killed else f"exit {proc.returncode}"
    link.seconds = time.perf_counter() - start
    link.tail = "\n".join(out.splitlines()[-15:])
    return out


def _check(link: Link, ok: bool, what: str) -> bool:
    link.checked.append(("ok: " if ok else "FAILED: ") + what)
    return ok


def _check_gpu_path(link: Link, out: str, device: torch.device) -> None:
    """On a GPU: the default path captured CUDA graphs, and torch kept no autograd node of an earlier step alive
    (its AccumulateGrad warning under CUDA graphs)."""
    if device.type == "cuda":
        _check(link, "run as CUDA graphs" in out, "captured CUDA graphs (cuda_graph auto)")
        _check(link, "AccumulateGrad" not in out, "no AccumulateGrad warning")


def report(links: list[Link], plan: Plan) -> str:
    """The chain's Markdown section: a row per link, the last lines of each failed link, every command."""
    rows = "\n".join(link.row() for link in links)
    failed = [link for link in links if any(c.startswith("FAILED") for c in link.checked)]
    tails = "".join(f"`{link.name}`, last lines:\n\n```text\n{link.tail}\n```\n\n" for link in failed)
    shown = {link.name: shlex.join(link.command).replace(sys.executable, "python") for link in links}
    commands = "\n".join(f"- {name}: `{command}`" for name, command in shown.items())
    return (
        f"### The chain of a stage-2 run\n\n`python -m mabn bench chain`: {plan.arch} PSPNet, crop {plan.crop}, "
        f"generated images of {plan.image_size[0]}x{plan.image_size[1]}, {FIT_STEPS} steps, each link a "
        f"subprocess limited to {LINK_TIMEOUT_S} s\n\n| link | status | s | checked |\n|---|---|---:|---|\n{rows}\n\n"
        f"{tails}Commands:\n\n{commands}"
    )


def run(plan: Plan, device: torch.device, save: Callable[[str], object]) -> list[Link]:
    """Every link in order, ``save(report)`` after each; a link whose input is missing (a checkpoint the fit did
    not write) is reported as not run. ``device``: where the product's commands will train (they pick it)."""
    from ..data import demo_cityscapes

    demo_cityscapes.generate(plan.data, n_train=8, n_val=2, size=plan.image_size)
    last = plan.work / "run" / "checkpoints" / "last.ckpt"
    links = [
        Link("fit, killed after its first checkpoint", plan.fit(plan.work / "run", FIT_STEPS)),
        Link("fit, resumed", plan.fit(plan.work / "run", FIT_STEPS, "--resume", "auto")),
        Link("test", _mabn("test", str(last), "--num-workers", "0")),
        Link("predict", _mabn("predict", str(last), "--out", str(plan.work / "predictions"))),
        Link("export", _mabn("export", str(last), "--input-size", "256", "512")),
        Link("two ranks on one device (gloo), CUDA graphs when on a GPU", []),
    ]

    fit, resumed, test, predict, export, ranks = links
    out_text = _run(fit, kill_when=last)
    _check(fit, fit.status == "killed as planned" and last.is_file(), "killed with last.ckpt written")
    _check_gpu_path(fit, out_text, device)
    save(report(links, plan))
    out_text = _run(resumed)
    _check(resumed, resumed.status == "exit 0", "exit 0")
    _check(resumed, "Resuming from" in out_text, "resumed from the killed run's checkpoint")
    save(report(links, plan))
    for link, expect in ((test, "mIoU"), (predict, "Wrote 2 predictions"), (export, "TorchScript")):
        if not last.is_file():
            continue
        out_text = _run(link)
        _check(link, link.status == "exit 0", "exit 0")
        _check(link, expect in out_text, f"its output names {expect}")
        save(report(links, plan))
    ranks.command = _two_ranks(plan)
    out_text = _run(ranks)
    _check(ranks, ranks.status == "exit 0", "both ranks exit 0")
    _check(ranks, "x 2 device(s) = global batch 4" in out_text, "one DDP run of 2 processes")
    _check_gpu_path(ranks, out_text, device)
    save(report(links, plan))
    return links


def _two_ranks(plan: Plan) -> list[str]:
    """Two single-device nodes on localhost as torchrun starts them, in one shell: gloo, since NCCL refuses two
    ranks on one GPU; each rank's node-local rank is 0, so both train on the one device."""
    gloo = ("pytorch_lightning.strategies.DDPStrategy", "--trainer.strategy.process_group_backend", "gloo")
    fit = plan.fit(plan.work / "ranks", 4, "--nodes", "2", strategy=gloo)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    node = [shlex.join([*torchrun, "--node_rank", str(rank), *fit[1:]]) for rank in (0, 1)]
    return ["bash", "-c", f"{node[1]} & {node[0]}; first=$?; wait $!; exit $(( first | $? ))"]


def failed(links: list[Link]) -> list[str]:
    """The names of the links with a failed check."""
    return [link.name for link in links if any(c.startswith("FAILED") for c in link.checked)]
