#!/usr/bin/env python
"""``make gpu-check`` (``python scripts/gpu/check.py``): what a GPU session checks and measures, as sections in order
of value, each with its own time limit, so that one GPU call of ``total_limit()`` seconds (under 8 minutes) brings
back the most it can. A tool of the checkout, not of the package: it runs the checkout's tests, and measures with
the package's benchmarks (``mabn.tools.bench``), imported from the ``src/`` on its path.

0. ``kernels``: the recipe's kernel variants and the history shift on the device (``devicetests.RECIPE_KERNELS``):
   the compiled Triton kernels against the float64 references, before anything is measured with them;
1. ``stage2``: stage 2's training step, PSPNet-101 at batch 2 and crop 713, MABN against BN in float32 through CUDA
   graphs, captured whole and per stage (``graph_segments: stages``), the paper's claim on the default path;
2. ``chain``: the chain of a real stage-2 run (``chain.py``): fits killed and resumed, graphed against eager, test,
   predict, export, two ranks under bf16-mixed;
3. ``stage1``: stage 1's training step, ResNet-101 at 32 images of 224 px in ghost batches of 2 against BN over
   the 32 (the ``bn32`` backbone), CUDA graphs and eager, with the hours of the recipe on 8 GPUs;
4. ``profile``: where each stage's eager step spends its GPU time, kernel by kernel, BN beside MABN
   (``mabn.tools.bench.profile``), so that a ratio that misses its target names the kernels behind it;
5. ``stage2_more``: stage 2's step eager in float32, and through CUDA graphs and eager in bf16-mixed;
6. ``more_kernels``: the other kernel tests on the device (``devicetests.KERNELS``);
7. ``compiled``: a compiled MABN step against the eager one on the device (``devicetests.COMPILED``), then stage
   2's step through ``torch.compile``, the first (compiling) step's seconds included: a GPU call of its own
   (``--sections compiled``), since compiling PSPNet-101 takes minutes.

``--sections`` runs the sections it names in the order it names them.

Where each runs. The chain's links are commands of the product and stay subprocesses, started from this process,
which stops them at the section's limit itself. The step sections run one after another in ONE child process
(multiprocessing, spawn), so that CUDA, cuDNN and MABN's Triton kernels are set up once for all of them; the child
reports each section's result, its progress lines and its tables through a queue. A section past its limit is
stopped by killing that child (a hung CUDA call or a compile cannot be interrupted from inside), reported as
"timed out after N s" with the lines it printed before, and the check goes on to the next section in a new child.
A child, rather than ``python -m mabn bench step`` per section, because the sections then share that setup and
return their measurements as values instead of text to parse.

The report (``runs/bench/bench-cuda.md``, or ``--out``) is rewritten, whole and atomically, whenever a section
(or a link of the chain) ends: the sections' table, the targets (each ratio MABN / BN measured against its goal,
met or not met), then each section's tables. Every row of the two tables names the checkout's commit and the path
MABN's steps took where the section ran them (Triton with the fast launch, Triton, or torch ops and why; the
capture mode of CUDA graphs). The step sections time bn and mabn alone, ``repeats`` interleaved
rounds each, medians, cuDNN's benchmark mode off (as ``bench step``).
--dry-run: check the options, print the sections, their limits, what each measures and the report's path; measure
and write nothing (planned for CUDA on any machine).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import queue
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import chain  # chain, devicetests: the modules beside this script, whose folder is on the path
import devicetests
import torch
import yaml

from mabn.cli.help import HelpFormatter, positive
from mabn.norm import fused
from mabn.recipes import CONFIGS
from mabn.run import device_batch, loader_batches, total_iterations
from mabn.tools.bench import profile, report, workloads
from mabn.tools.bench.command import REPORTS

# The goals each measured ratio MABN / BN is held to (the report says met or not met).
TIME_TARGETS = {"graphs": 1.05, "eager": 1.15, "compiled": 1.05}
SEGMENTS_TARGET = 1.01  # MABN's step captured per stage against captured whole: at most 1 % of the step
MEMORY_TARGET = 1.02
FIRST_STEP_TARGET = 2.0  # compiled: MABN's first (compiling) step against BN's
# The recipe's training splits, for its hours on 8 GPUs: ImageNet-1k's and Cityscapes fine's training images.
TRAIN_IMAGES = {1: 1_281_167, 2: 2975}
RECIPE_GPUS = 8


def recipe_iterations(stage: int, gpus: int = RECIPE_GPUS) -> int:
    """The optimizer steps of stage ``stage``'s recipe (configs/pretrain.yaml, configs/cityscapes.yaml) on
    ``gpus`` GPUs of one node: its epochs of its training split, at its per-device batch (``mabn.run.scaling``)."""
    config = yaml.safe_load((CONFIGS / ("pretrain.yaml" if stage == 1 else "cityscapes.yaml")).read_text())
    data, model = config["data"]["init_args"], config["model"]["init_args"]
    if stage == 1:
        per_device = data["batch_size"]
    else:
        per_device = device_batch(data["global_batch_size"], gpus, model["norm_batch_size"])
    batches = loader_batches(TRAIN_IMAGES[stage], per_device, gpus)
    return total_iterations(batches, config["trainer"]["max_epochs"], None, 1)


@dataclass(frozen=True)
class Options:
    """What the sections take from the command line."""

    device: str = "cuda"
    repeats: int = 5
    compile_mode: str = "reduce-overhead"
    plan: chain.Plan = chain.Plan()  # the chain's network, crop and images (the tests': a small one on the CPU)


@dataclass(frozen=True)
class Job:
    """A section's run: its options, when its limit ends (``time.monotonic()``), and where it reports: ``say`` a
    progress line (kept for the report should the section be cut short), ``show`` its report so far."""

    options: Options
    deadline: float
    say: Callable[[str], None]
    show: Callable[[str], None]


@dataclass(frozen=True)
class Measured:
    """A section's result: its Markdown, its ratios MABN / BN by target label, what failed in it, and the path
    MABN's steps took where it ran them (``steps_path``; empty where the section runs tests or commands)."""

    markdown: str
    ratios: dict[str, float] = field(default_factory=dict)
    failures: tuple[str, ...] = ()
    path: str = ""


def steps_path(graphs: bool) -> str:
    """The path MABN's steps took in this process: the kernels' (``fused.path``), and with ``graphs`` the capture
    mode of CUDA graphs."""
    from mabn.tasks.cudagraph import capture_mode  # here: it imports torchvision, which the kernel tests need not

    return fused.path() + (f"; CUDA graphs {capture_mode()}" if graphs else "")


@dataclass(frozen=True)
class Target:
    """A goal for one ratio MABN / BN: its label (the key of ``Measured.ratios``) and the largest value meeting it."""

    label: str
    limit: float

    def row(self, ratio: float | None, commit: str, path: str) -> str:
        verdict = "not measured" if ratio is None else "met" if ratio <= self.limit else "not met"
        shown = "" if ratio is None else f"{ratio:.3f}"
        return f"| {self.label} | {shown} | <= {self.limit:g} | {verdict} | {commit} | {path or '-'} |"


@dataclass(frozen=True)
class StepPath:
    """How a training step runs: ``graphs`` (CUDA graphs, the stages' default path; captured whole or per stage,
    as ``segments`` says), ``eager`` or ``compiled`` (torch.compile), in float32 or ``precision``."""

    how: str
    precision: str | None = None
    segments: str = "whole"

    @property
    def label(self) -> str:
        how = {"graphs": "CUDA graphs", "eager": "eager", "compiled": "compiled"}[self.how]
        return f"{how}{' per stage' if self.segments == 'stages' else ''}, {self.precision or 'float32'}"


@dataclass(frozen=True)
class StepWork:
    """A step section: ``model`` at ``batch`` x ``crop``, BN and MABN (ghost batches of 2) along each of ``paths``,
    and the stage whose recipe gives the hours on 8 GPUs."""

    stage: int
    model: str
    batch: int
    crop: int
    paths: tuple[StepPath, ...]

    @property
    def name(self) -> str:
        size = f"crop {self.crop}" if self.model == "pspnet101" else f"{self.crop} px"
        return f"stage {self.stage}, {workloads.MODELS[self.model].split(' (')[0]} batch {self.batch} {size}"

    def label(self, path: StepPath, quantity: str) -> str:
        """A measured ratio's name: the key of ``Measured.ratios`` and the label of its ``Target``."""
        return f"{self.name}, {path.label}: {quantity}"

    def targets(self) -> tuple[Target, ...]:
        out = []
        for path in self.paths:
            out.append(Target(self.label(path, "step time"), TIME_TARGETS[path.how]))
            out.append(Target(self.label(path, "peak memory"), MEMORY_TARGET))
            if path.how == "compiled":
                out.append(Target(self.label(path, "first step (compiling)"), FIRST_STEP_TARGET))
            if path.segments == "stages":
                out.append(Target(self.label(path, "MABN step time / captured whole"), SEGMENTS_TARGET))
        return tuple(out)

    def describe(self, options: Options) -> str:
        paths = "; ".join(
            p.label + (f" ({options.compile_mode}, first step timed)" if p.how == "compiled" else "")
            for p in self.paths
        )
        return (
            f"{workloads.MODELS[self.model]} training step, batch {self.batch}, {self.crop}x{self.crop}: MABN in ghost "
            f"batches of {workloads.NORM_BATCH_SIZE} against BN over the batch of {self.batch}; {paths}; "
            f"{options.repeats} interleaved repeats, "
            f"medians, peak memory; hours of the recipe's {recipe_iterations(self.stage):,} iterations on "
            f"{RECIPE_GPUS} GPUs"
        )


def measure_steps(work: StepWork, job: Job) -> Measured:
    """``work``'s step tables, ratios and hours (in the step process)."""
    options, device = job.options, torch.device(job.options.device)
    iterations = recipe_iterations(work.stage)
    parts, ratios = [], {}
    mabn_seconds: dict[StepPath, float] = {}
    for path in work.paths:
        compiled = path.how == "compiled"
        mode = options.compile_mode if compiled else None
        norms = ("bn compiled", "mabn compiled") if compiled else ("bn", "mabn")
        shape = {
            "model": work.model,
            "compile_mode": mode,
            "precision": path.precision,
            "graph_segments": path.segments,
        }
        from mabn.tools.bench import step  # here: it builds the models, which the kernel section needs not

        rows = step.run(device, options.repeats, work.crop, work.batch, cuda_graph=path.how == "graphs",
                        rows=norms, say=job.say, **shape)  # fmt: skip
        parts.append(step.table(rows, options.repeats, work.crop, work.batch, path.how == "graphs", **shape))
        bn, mabn = rows
        mabn_seconds[path] = mabn.seconds
        if path.segments == "stages":  # against the whole capture, measured earlier in the section
            whole = mabn_seconds[replace(path, segments="whole")]
            ratios[work.label(path, "MABN step time / captured whole")] = mabn.seconds / whole
        ratios[work.label(path, "step time")] = mabn.time_ratio
        ratios[work.label(path, "peak memory")] = mabn.mem_ratio
        if compiled:
            assert bn.first_step_s is not None and mabn.first_step_s is not None
            ratios[work.label(path, "first step (compiling)")] = mabn.first_step_s / bn.first_step_s
        hours = ", ".join(f"{r.norm} {r.seconds * iterations / 3600:.2f} h" for r in rows)
        line = (
            f"Stage {work.stage} on {RECIPE_GPUS} GPUs, {path.label}: {hours} ({iterations:,} iterations x s / step "
            "/ 3600, the training steps alone)."
        )
        job.say(line)
        parts.append(line)
        job.show("\n\n".join(parts))
        _release()  # step.run's models, whose CUDA graphs hold memory in reference cycles
    graphs = any(p.how == "graphs" for p in work.paths)
    return Measured("\n\n".join(parts), ratios, path=steps_path(graphs))


def run_chain(job: Job) -> Measured:
    """The chain section (in the check's process: its links are subprocesses it stops at the deadline)."""
    plan = job.options.plan.fresh()
    links = chain.run(plan, torch.device(job.options.device), job.show, job.deadline)
    return Measured(chain.report(links, plan), failures=tuple(chain.failed(links)))


def _describe_chain(options: Options) -> str:
    return chain.describe(options.plan)


def _device_tests(job: Job, suite: devicetests.Suite, deadline: float) -> Measured:
    """``suite`` run on the device as a subprocess stopped at ``deadline``; a failure fails the check."""
    outcome = devicetests.run(suite, job.options.device, deadline)
    job.say(outcome.line)  # kept should the section be cut short
    job.show(outcome.markdown)
    return Measured(outcome.markdown, failures=() if outcome.passed else (suite.title,))


def run_kernel_tests(suite: devicetests.Suite, job: Job) -> Measured:
    """A kernels section (in the check's process)."""
    return _device_tests(job, suite, job.deadline)


def _describe_kernel_tests(suite: devicetests.Suite, options: Options) -> str:
    return (
        f"the kernel tests of the default suite ({', '.join(suite.tests)}) with "
        f"MABN_TEST_DEVICE={options.device}: the compiled Triton kernels against the float64 references"
    )


COMPILE_TESTS_S = 90  # of the compiled section: the inductor builds a small ResNet's kernels from a cold cache


def measure_compiled(job: Job) -> Measured:
    """The compiled section (in the step process): a compiled MABN step against the eager one on the device, in at
    most COMPILE_TESTS_S, then the timed steps."""
    tests = _device_tests(job, devicetests.COMPILED, min(job.deadline, time.monotonic() + COMPILE_TESTS_S))
    steps = measure_steps(COMPILED, job)
    return Measured(f"{tests.markdown}\n\n{steps.markdown}", steps.ratios, tests.failures)


def _describe_compiled(options: Options) -> str:
    return (
        f"{', '.join(devicetests.COMPILED.tests)} with MABN_TEST_DEVICE={options.device} (at most "
        f"{COMPILE_TESTS_S} s): compiled MABN steps against eager ones; then {COMPILED.describe(options)}"
    )


# Each stage's step: stage 1's the bulk of the recipe's compute, with its largest ratio; stage 2's the paper's.
PROFILED = ((1, "resnet101", 32, 224), (2, "pspnet101", 2, 713))


def run_profile(job: Job) -> Measured:
    """The profile section (in the step process)."""
    device = torch.device(job.options.device)
    parts = []
    for stage, model, batch, crop in PROFILED:
        results = profile.run(device, model, batch, crop, say=job.say)
        title = f"{workloads.MODELS[model].split(' (')[0]} (stage {stage}) batch {batch}, {crop}x{crop}, eager, float32"
        parts.append(profile.table(results, title, device))
        job.show("\n\n".join(parts))
        _release()
    return Measured("\n\n".join(parts), path=steps_path(graphs=False))


def _describe_profile(options: Options) -> str:
    steps = " and ".join(
        f"{workloads.MODELS[model].split(' (')[0]} (stage {stage}) batch {batch}, {crop}x{crop}"
        for stage, model, batch, crop in PROFILED
    )
    return (
        f"each stage's eager training step ({steps}): each kernel's GPU time per step under torch.profiler, "
        f"{' and '.join(profile.NORMS)} side by side"
    )


@dataclass(frozen=True)
class Section:
    """One part of the check: ``key`` (for ``--sections``), its time limit, what it runs (``run``, in the step
    process unless ``here``), what it measures in words, the targets its ratios are held to, and whether it needs a
    GPU call of its own (``alone``: run only when named, it is not in the default plan)."""

    key: str
    limit_s: int
    run: Callable[[Job], Measured]
    describe: Callable[[Options], str]
    targets: tuple[Target, ...] = ()
    here: bool = False
    alone: bool = False


def _steps(key: str, limit_s: int, work: StepWork) -> Section:
    return Section(key, limit_s, partial(measure_steps, work), work.describe, work.targets())


STAGE2 = StepWork(2, "pspnet101", 2, 713, (StepPath("graphs"), StepPath("graphs", None, "stages")))
STAGE2_MORE = StepWork(
    2, "pspnet101", 2, 713, (StepPath("eager"), StepPath("graphs", workloads.BF16), StepPath("eager", workloads.BF16))
)
STAGE1 = StepWork(1, "resnet101", 32, 224, (StepPath("graphs"), StepPath("eager")))
COMPILED = StepWork(2, "pspnet101", 2, 713, (StepPath("compiled"),))
# The order is the value: the recipe's kernel variants say whether what follows runs MABN's maths; stage 2's step
# on the default path (float32, captured whole and per stage) is the paper's claim; the chain finds what breaks a
# real run; stage 1's step gives its hours, and both stages' profiles the kernels behind their ratios; then stage
# 2's other paths and the kernels' other configurations. Compiling PSPNet-101 takes minutes (the first compiled
# step 82 s for BN, 302 s for MABN on an H200, docs/bench-compiled-cuda.md): ``compiled`` is a GPU call of its own.
# The kernel tests' limit holds their Triton compiles from a cold cache; the step sections' keep room over what
# their paths took on an H200 (about 10 s a path of stage 2, 9 s for stage 1: docs/bench-cuda.md), so that the
# plan stays within one call of under 8 minutes.
SECTIONS = (
    Section(
        "kernels",
        110,
        partial(run_kernel_tests, devicetests.RECIPE_KERNELS),
        partial(_describe_kernel_tests, devicetests.RECIPE_KERNELS),
        here=True,
    ),
    _steps("stage2", 40, STAGE2),
    Section("chain", 150, run_chain, _describe_chain, here=True),
    _steps("stage1", 30, STAGE1),
    Section("profile", 60, run_profile, _describe_profile),
    _steps("stage2_more", 45, STAGE2_MORE),
    Section(
        "more_kernels",
        40,
        partial(run_kernel_tests, devicetests.KERNELS),
        partial(_describe_kernel_tests, devicetests.KERNELS),
        here=True,
    ),
    Section("compiled", 480, measure_compiled, _describe_compiled, COMPILED.targets(), alone=True),
)
# The budget of one GPU call that each plan keeps to (tests/test_gpu_check.py): a section's limit in the default
# plan, and the sum of a plan's limits.
MAX_SECTION_S = 240
MAX_TOTAL_S = 480


def total_limit(sections: tuple[Section, ...] | list[Section] = SECTIONS) -> int:
    return sum(s.limit_s for s in sections)


def select(keys: str | None, limits: str | None = None) -> list[Section]:
    """The sections named in ``keys`` (comma-separated, e.g. ``stage2,stage1``; None: the default plan, every
    section but those that need a call of their own, in the check's order) in the order named, with the time limits
    ``limits`` gives (``key=seconds,...``) in place of their own. A ValueError names an unknown or repeated key or a
    bad limit."""
    known = [s.key for s in SECTIONS]
    default = [s.key for s in SECTIONS if not s.alone]
    wanted = default if keys is None else [k.strip() for k in keys.split(",") if k.strip()]
    seconds: dict[str, int] = {}
    for item in (limits or "").split(","):
        key, _, value = item.strip().partition("=")
        if key and (not value.isdigit() or int(value) < 1):
            raise ValueError(f"a limit is key=seconds, seconds a whole number >= 1, got {item.strip()!r}")
        if key:
            seconds[key] = int(value)
    unknown = [k for k in [*wanted, *seconds] if k not in known]
    if unknown or not wanted:
        raise ValueError(f"unknown section(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    repeated = sorted({k for k in wanted if wanted.count(k) > 1})
    if repeated:
        raise ValueError(f"section(s) named twice: {', '.join(repeated)}")
    by_key = {s.key: s for s in SECTIONS}
    return [replace(by_key[k], limit_s=seconds.get(k, by_key[k].limit_s)) for k in wanted]


def plan_lines(sections: list[Section], options: Options, out: Path) -> list[str]:
    """What ``--dry-run`` prints: each section with its limit and what it measures, the total, the report."""
    lines = [
        f"section {n} of {len(sections)}: {s.key}, limit {s.limit_s} s: {s.describe(options)}"
        for n, s in enumerate(sections, 1)
    ]
    return [
        *lines,
        f"total limit: {total_limit(sections)} s (a section past its limit is stopped and reported as timed out; "
        "the check goes on to the next)",
        f"report: {out}, rewritten as each section ends",
    ]


@dataclass
class Outcome:
    """What became of a section: its status, seconds, report so far, progress lines and ratios."""

    section: Section
    status: str = "not run"
    seconds: float | None = None
    markdown: str = ""
    lines: list[str] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    path: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def row(self, commit: str) -> str:
        seconds = "" if self.seconds is None else f"{self.seconds:.0f}"
        path = self.path or "-"
        return f"| {self.section.key} | {self.section.limit_s} | {self.status} | {seconds} | {commit} | {path} |"

    def part(self) -> str:
        """The section's Markdown in the report: its tables, and for one cut short what it said before."""
        text = self.markdown
        if self.lines and not self.ok and self.status != "running":
            said = "\n".join(self.lines[-30:])
            text += f"\n\n`{self.section.key}` {self.status}; its last lines before that:\n\n```text\n{said}\n```"
        return text.strip()


def report_parts(outcomes: list[Outcome], commit: str) -> list[str]:
    """The report's sections: the sections' table, the targets, each section's own Markdown; each row names
    ``commit`` and the path the section's steps took."""
    total = sum(o.section.limit_s for o in outcomes)
    sections = "\n".join(o.row(commit) for o in outcomes)
    targets = "\n".join(t.row(o.ratios.get(t.label), commit, o.path) for o in outcomes for t in o.section.targets)
    parts = [
        f"### Sections\n\n`python scripts/gpu/check.py`: each section stopped at its limit (in all {total} s)\n\n"
        f"| section | limit (s) | status | s | commit | path |\n|---|---:|---|---:|---|---|\n{sections}"
    ]
    if targets:
        parts.append(
            "### Targets: MABN / BN\n\nEach ratio of a step section against its goal (time: median s / step; "
            "memory: peak above the weights; compiled: also the first, compiling step).\n\n"
            f"| MABN / BN | measured | target | | commit | path |\n|---|---:|---:|---|---|---|\n{targets}"
        )
    return parts + [o.part() for o in outcomes if o.part()]


class _StepProcess:
    """The child process that runs the step sections, one after another (see the module's description)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.tasks = context.SimpleQueue()
        self.results = context.Queue()
        self.process = context.Process(target=_serve, args=(self.tasks, self.results), name="gpu-check", daemon=True)
        self.process.start()

    def run(self, section: Section, job: Job) -> tuple[str, Measured | str | None]:
        """("done", Measured), ("error", traceback) or ("timeout", None) for ``section`` run until ``job.deadline``;
        its lines and partial reports go to ``job.say`` and ``job.show`` as they come."""
        self.tasks.put((section.run, job.options, job.deadline))
        while True:
            try:
                kind, payload = self.results.get(timeout=max(0.0, min(1.0, job.deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= job.deadline:
                    return "timeout", None
                if not self.process.is_alive():
                    return "error", f"the step process ended (exit code {self.process.exitcode})"
                continue
            if kind == "say":
                job.say(payload)
            elif kind == "show":
                job.show(payload)
            else:
                return kind, payload

    def stop(self, kill: bool = False) -> None:
        if not kill:
            self.tasks.put(None)
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.results.cancel_join_thread()


def _serve(tasks: multiprocessing.SimpleQueue, results: multiprocessing.Queue) -> None:
    """The step process: each task a section's ``run``, its lines and partial reports sent as they come."""

    def say(line: str) -> None:
        print(line, flush=True)
        results.put(("say", line))

    while (task := tasks.get()) is not None:
        run, options, deadline = task
        try:
            results.put(("done", run(Job(options, deadline, say, lambda text: results.put(("show", text))))))
        except Exception:
            results.put(("error", traceback.format_exc()))
        finally:
            _release()


def _release() -> None:
    """Free what the last measurement left: its models, their CUDA graphs and cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(sections: list[Section], options: Options, write: Callable[[list[Outcome]], object]) -> list[Outcome]:
    """Each section in order within its limit, ``write(outcomes)`` when it starts, whenever its report grows and
    when it ends; returns the outcomes (``ok`` when a section ran to its end and nothing in it failed)."""
    outcomes = [Outcome(section) for section in sections]
    steps: _StepProcess | None = None
    try:
        for outcome in outcomes:
            section = outcome.section
            start = time.monotonic()
            outcome.status = "running"
            write(outcomes)

            def show(text: str, outcome: Outcome = outcome) -> None:
                outcome.markdown = text
                write(outcomes)

            job = Job(options, start + section.limit_s, outcome.lines.append, show)
            if section.here:
                kind, result = _here(section, job)
            else:
                steps = steps or _StepProcess()
                kind, result = steps.run(section, job)
                if kind != "done":  # stopped mid-section or broken: the next section gets a new process
                    steps.stop(kill=True)
                    steps = None
            outcome.seconds = time.monotonic() - start
            if isinstance(result, Measured):
                outcome.markdown, outcome.ratios, outcome.path = result.markdown, result.ratios, result.path
            late = outcome.seconds > section.limit_s
            if kind == "timeout" or (kind == "done" and late):
                outcome.status = f"timed out after {section.limit_s} s"
            elif kind == "error":
                outcome.status = f"failed: {str(result).strip().splitlines()[-1]}"
                outcome.lines.append(str(result))
            elif isinstance(result, Measured) and result.failures:
                outcome.status = f"failed: {', '.join(result.failures)}"
            else:
                outcome.status = "ok"
            write(outcomes)
            print(f"check: {section.key}: {outcome.status} ({outcome.seconds:.0f} s of {section.limit_s})", flush=True)
    finally:
        if steps is not None:
            steps.stop()
    return outcomes


def _here(section: Section, job: Job) -> tuple[str, Measured | str]:
    try:
        return "done", section.run(job)
    except Exception:
        return "error", traceback.format_exc()


PROG = "python scripts/gpu/check.py"


def commit() -> str:
    """The checkout's commit (short hash, "+ changes" where its files differ from it), or why it is not known."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "unknown (no git)"
    if head.returncode:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" + changes" if status.stdout.strip() else "")


def report_path(out: Path | None) -> Path:
    """The report: ``out`` when it names a markdown file, else ``bench-cuda.md`` in ``out`` or in runs/bench/."""
    if out is not None and out.suffix == ".md":
        return out
    return (out or REPORTS) / "bench-cuda.md"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--device", default="cuda", help="the CUDA device to check (default: cuda)")
    parser.add_argument(
        "--repeats", type=positive, default=5, help="step sections: timed repeats, interleaved (median reported)"
    )
    parser.add_argument("--compile", default="reduce-overhead", metavar="MODE", help="compiled: torch.compile's mode")
    parser.add_argument(
        "--sections",
        metavar="KEY,...",
        help="the sections to run, comma-separated, in the order given (default: "
        f"{', '.join(s.key for s in SECTIONS if not s.alone)}; "
        f"{', '.join(s.key for s in SECTIONS if s.alone)} in a GPU call of its own)",
    )
    parser.add_argument(
        "--limits", metavar="KEY=S,...", help="time limits in seconds in place of the sections' own, e.g. chain=240"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="the markdown report, or a folder for it as bench-cuda.md (default: runs/bench/; --out docs: the "
        "report the docs quote)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the options and print the plan; measure and write nothing"
    )
    args = parser.parse_args(argv)
    try:
        sections = select(args.sections, args.limits)
    except ValueError as err:
        parser.error(f"--sections/--limits: {err}")
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error(f"the check needs a CUDA device, got --device {args.device}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: the check runs on a GPU machine (--dry-run prints its plan anywhere)")
    options = Options(str(device), args.repeats, args.compile)
    out = report_path(args.out)
    if args.dry_run:
        here = "" if torch.cuda.is_available() else " (assumed by --dry-run: no CUDA device here)"
        shown = shlex.join([*PROG.split(), *(a for a in argv if a != "--dry-run")])
        lines = [f"dry run of {shown}: nothing is measured or written", f"device: {device}{here}"]
        print("\n".join([*lines, *plan_lines(sections, options, out)]))
        return 0
    env = report.header(device)
    print(env, flush=True)
    command = shlex.join([*PROG.split(), *argv])
    checkout = commit()
    print(f"commit: {checkout}", flush=True)

    def save(outcomes: list[Outcome]) -> None:
        report.write(out, device, command, report_parts(outcomes, checkout), [], [], env, title="GPU check")

    outcomes = run(sections, options, save)
    broken = [o.section.key for o in outcomes if not o.ok]
    print(f"check: report {out}" + (f"; not ok: {', '.join(broken)}" if broken else ""), flush=True)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
