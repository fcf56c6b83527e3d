"""The commands that README.md, pretrain/README.md and docs/**/*.md show, for ``tests/test_docs_commands.py``.

What counts as a command (``extract``):

- in a fenced block marked ``bash``, ``sh``, ``shell``, ``console`` or unmarked, and in an indented (4-space)
  code block: every line that starts a command of this product: ``make``, ``python``/``python3`` (``-m mabn``,
  ``-m pytest``, ``-c "..."``, a script), ``scripts/...``, ``sbatch``, ``srun``,
  ``torchrun``, each possibly after ``NAME=value`` environment words. Backslash continuations are joined, a
  quoted argument that spans lines (``python -c "..."`` over several lines) is kept whole with its newlines,
  and a trailing ``# comment`` is removed. ``git``, ``cd``, ``wandb``, ``csEval...`` and other tools' commands
  are not this product's and are not extracted;
- in a ``text`` block only the lines starting with ``$ `` (the shown command; the other lines are its output);
- in prose, table cells and headings: every inline code span that starts the same way (a span may run over a
  line break). Spans such as ``ARGS="..."`` alone are settings, and a program's bare name (`make`) names the
  tool: neither is a command;
- every ``python`` fenced block, as a snippet.

A table row that shows a command and, in a later cell, an ``error: ...`` code span documents that the command
fails with exit status 2 and that line (docs/reliability.md's table of bad inputs).

``classify`` sorts each command into the kind that says how the test runs it; a command it cannot sort is
``UNKNOWN``, and its test case fails with the line to add here. Commands that cannot run in a test (network,
minutes of compiling) are listed in ``NOT_RUN`` with the reason; ``test_docs_commands`` checks that each entry
still matches a command of the docs.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHELL_FENCES = {"bash", "sh", "shell", "console", ""}
PROGRAMS = r"(?:make|python3?|torchrun|sbatch|srun|scripts/\S+)"
ENV_WORD = r"""[A-Za-z_][A-Za-z0-9_]*=(?:"[^"]*"|'[^']*'|\$\([^)]*\)|[^\s"'])*"""
COMMAND = re.compile(rf"^(?:{ENV_WORD}\s+)*{PROGRAMS}(?:\s|$)")
BARE_PROGRAMS = {"make", "python", "python3", "torchrun", "sbatch", "srun"}  # a tool's name in prose, no command
FENCE = re.compile(r"^\s*```\s*([\w-]*)\s*$")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)

# Kinds (see test_docs_commands.py for how each runs).
STAGE = "stage"  # a training stage: run as a dry run (DRY_RUN=1, --dry-run, simulated SLURM / torchrun)
FIT = "fit"  # python -m mabn fit|validate: parsed and checked by mabn.cli.lightning.check (--print_config runs as is)
PLAN = "plan"  # bench, ablation, gpu-check (scripts/gpu/check.py): their --dry-run plan
MAKE_N = "make -n"  # make test, test-slow, test-gpu, lint: the recipe printed by make -n and checked
REAL = "real"  # on a checkpoint or a run: export, test-split, predict, plots, demo-data, run for real
USAGE = "usage"  # a bare `make export|test-split|predict`: the target's usage line and exit status 2
HELP = "help"  # a command's name or synopsis (CKPT [--out DIR]): its --help, which names every option of the synopsis
SCRIPT_NAME = "script name"  # a bare script path: the script exists and is executable
PYTEST = "pytest"  # python -m pytest ...: collected (--collect-only), not run, and must select a test
SNIPPET = "snippet"  # python -c "..." and python blocks: executed
UNKNOWN = "unknown"

STAGE_TARGETS = {"pretrain", "cityscapes", "segment", "slurm"}
REAL_TARGETS = {"export", "test-split", "predict", "plots"}
USAGE_TARGETS = {"export", "test-split", "predict"}  # a usage line and exit status 2 without CKPT
PLAN_TARGETS = {"bench", "bench-norm", "ablation", "gpu-check"}
MAKE_N_TARGETS = {"test", "test-slow", "test-gpu", "lint"}  # make test would run this suite inside itself
STAGES = {"pretrain", "cityscapes", "segment"}
REAL_COMMANDS = {"export", "test", "predict", "plots", "demo-data"}
PLAN_COMMANDS = {"bench", "ablation"}
GPU_CHECK = "scripts/gpu/check.py"  # make gpu-check's tool of the checkout: its --dry-run plan

# Commands the docs show that no test can run, with the reason (regular expressions on the command text).
NOT_RUN = {
    r"resnet101\(weights='IMAGENET1K_V2'\)": "downloads torchvision's ImageNet weights (tests have no network); the "
    "BACKBONE=resnet101-imagenet.pth line after it gets the same state dict saved with weights=None",
    r"from torch\._dynamo\.utils import compile_times": "compile_times.py of docs/compile.md: compiles ResNet-50 "
    "with torch.compile, 40-90 s per norm on 2 cores",
    r"^python compile_times\.py\b": "the compile_times.py script of docs/compile.md (see its block)",
    r"^make gpu-wheels\b|^scripts/gpu/wheels\.sh\b": "downloads about 54 MB of wheels from the package index, or "
    "installs them into a GPU machine's own Python",
    r"^make triton-compilers\b": "downloads a Triton wheel (about 150 MB) from the package index into "
    ".venv-triton<version>/; tests/test_kernels_compile.py compiles with what it installs",
    r"^make test-torch\b": "builds a second virtual environment (about 5 GB, torch downloaded from the package index) "
    "and runs this suite in it; CI runs it after make test-slow",
    r"runs/gpu-check/chain-\d": "a link of the GPU check's chain as its report lists it, on the chain's own generated "
    "data and run folders: tests/test_chain.py runs the chain's links",
}
# What a <placeholder> stands for, and an elided value (``NAME=...``, ``--flag ...``); a bare ``...`` word (more
# arguments) is dropped. Data paths (/data/..., /path/to/...) are the test's generated sets (test_docs_commands.py).
PLACEHOLDERS = {
    "checkpoint": "runs/cityscapes/mabn/checkpoints/last.ckpt",
    "run folder": "runs/cityscapes/mabn",
    "stage": "cityscapes",
    "norm": "mabn",
    "file": "backbones/resnet101-mabn.pt",
    "id": "4242",
}
ELIDED = {
    "CKPT": PLACEHOLDERS["checkpoint"],
    "--norm": "mabn",
    "--model.init_args.norm": "mabn",
    "--data": "/data/imagenet",  # the one elided --data: python -m mabn pretrain --data ... (docs/training.md)
    "--gpus": "8",  # srun python -m mabn <stage> --gpus ... --nodes ...: train.sbatch's default allocation
    "--nodes": "2",
}
# Documented failures outside a table with an error cell: (exit status, the line the output must hold).
EXPECTED = {
    "make cityscapes NORM=bn32": (2, "error: NORM=bn32 is a stage-1 preset"),  # docs/backbones.md
}
# Cases that cost more than the default suite affords (pytest's slow marker), by command kind or text.
SLOW_KINDS = {REAL, PYTEST}
# A stage's dry run, a fit's check or a snippet parses a LightningCLI or runs code (0.3-1 s a case, 35 s over the
# docs/ pages): the default suite replays those of the front door, the slow suite those of the docs/ pages.
FRONT_DOOR = ("README.md", "pretrain/README.md")
PAGE_SLOW_KINDS = {STAGE, FIT, SNIPPET}
SLOW_TEXT: dict[str, str] = {
    r"\bmabn\.load\(": "loads the session's short stage-2 fit, made for the docs",
    r"from mabn\.inference\.export import export": "exports the session's short stage-2 fit for real, ONNX included",
}


@dataclass(frozen=True)
class Command:
    file: str  # relative to the repository root
    line: int
    text: str  # as shown: continuations joined, "$ " and a trailing comment removed; a python block's code
    where: str  # "bash block", "text block", "indented block", "prose", "table", "python block"
    error: str | None = None  # the error line a table shows for it

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", root / "pretrain" / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _unbalanced(text: str) -> bool:
    """Whether ``text`` ends inside a quoted shell word."""
    try:
        shlex.split(text, comments=False)
    except ValueError:
        return True
    return False


def strip_comment(text: str) -> str:
    """``text`` without a trailing ``# comment`` (a # outside quotes that starts a word)."""
    quote = None
    for i, c in enumerate(text):
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.rstrip()


def _shell_commands(lines: list[tuple[int, str]], where: str, prompt_only: bool) -> list[tuple[int, str]]:
    """(line number, command) of a block's lines: continuations joined, prompts and comments removed."""
    found = []
    i = 0
    while i < len(lines):
        number, text = lines[i]
        i += 1
        stripped = text.strip()
        if prompt_only and not stripped.startswith("$ "):
            continue
        stripped = stripped.removeprefix("$ ")
        if not stripped or stripped.startswith("#"):
            continue
        while i < len(lines) and (stripped.endswith("\\") or _unbalanced(stripped)):
            nxt = lines[i][1].strip()
            if stripped.endswith("\\"):
                stripped = stripped[:-1].rstrip() + " " + nxt.removeprefix("$ ").removeprefix("> ")
            else:
                stripped += "\n" + lines[i][1]
            i += 1
        command = strip_comment(stripped)
        if COMMAND.match(command):
            found.append((number, command))
    return found


def _spans(unit: list[tuple[int, str]], where: str) -> list[tuple[int, str, str | None]]:
    """(line, command, shown error) of the code spans of one paragraph, heading or table row."""
    text = "\n".join(t for _, t in unit)
    starts = [0]
    for _, t in unit:
        starts.append(starts[-1] + len(t) + 1)
    spans = [(m.start(), " ".join(m.group(2).split())) for m in SPAN.finditer(text)]
    spans = [(offset, span) for offset, span in spans if span not in BARE_PROGRAMS]
    error = next((s for _, s in spans if s.startswith("error: ")), None) if where == "table" else None
    found = []
    for offset, span in spans:
        if COMMAND.match(span):
            line = unit[max(k for k, s in enumerate(starts[:-1]) if s <= offset)][0]
            found.append((line, span, error))
    return found


def extract(path: Path, root: Path = ROOT) -> list[Command]:
    """Every command of one markdown file, in order."""
    name = path.relative_to(root).as_posix()
    lines = path.read_text().splitlines()
    commands: list[Command] = []
    fence: str | None = None
    block: list[tuple[int, str]] = []
    unit: list[tuple[int, str]] = []
    indented: list[tuple[int, str]] = []

    def flush_unit(kind: str = "prose") -> None:
        for line, text, error in _spans(unit, kind):
            commands.append(Command(name, line, text, kind, error))
        unit.clear()

    def flush_indented() -> None:
        for line, text in _shell_commands(indented, "indented block", False):
            commands.append(Command(name, line, text, "indented block"))
        indented.clear()

    previous_blank = True
    for number, text in enumerate(lines, 1):
        opened = FENCE.match(text)
        if fence is not None:
            if opened and not opened.group(1):
                if fence == "python":
                    commands.append(Command(name, block[0][0] if block else number, "\n".join(t for _, t in block),
                                            "python block"))  # fmt: skip
                elif fence in SHELL_FENCES or fence == "text":
                    for line, command in _shell_commands(block, f"{fence} block", fence == "text"):
                        commands.append(Command(name, line, command, f"{fence or 'plain'} block"))
                fence, block = None, []
            else:
                block.append((number, text))
            continue
        if opened:
            flush_unit()
            flush_indented()
            fence = opened.group(1)
            previous_blank = False
            continue
        if text.startswith("    ") and text.strip() and (previous_blank or indented):
            flush_unit()
            indented.append((number, text))
            continue
        flush_indented()
        if not text.strip():
            flush_unit()
        elif text.lstrip().startswith("|") or text.startswith("#"):
            flush_unit()
            unit.append((number, text))
            flush_unit("table" if text.lstrip().startswith("|") else "heading")
        else:
            unit.append((number, text))
        previous_blank = not text.strip()
    flush_unit()
    flush_indented()
    return commands


def all_commands(root: Path = ROOT) -> list[Command]:
    return [command for path in doc_files(root) for command in extract(path, root)]


def not_run_reason(command: Command) -> str | None:
    return next((why for pattern, why in NOT_RUN.items() if re.search(pattern, command.text, re.M)), None)


class PlaceholderError(ValueError):
    """A placeholder or elision without a value in PLACEHOLDERS / ELIDED."""


def fill(text: str) -> str:
    """``text`` with its <placeholders> and elided values replaced (PLACEHOLDERS, ELIDED), bare ``...`` dropped."""

    def placeholder(match: re.Match) -> str:
        if match.group(1) not in PLACEHOLDERS:
            raise PlaceholderError(f"no value for the placeholder {match.group(0)}: add it to PLACEHOLDERS")
        return PLACEHOLDERS[match.group(1)]

    def elided(match: re.Match) -> str:
        name, sep = match.group(1), match.group(2)
        if name not in ELIDED:
            raise PlaceholderError(f"no value for the elided {name}{sep}...: add it to ELIDED")
        return f"{name}{sep}{ELIDED[name]}"

    text = re.sub(r"<([a-z][a-z ]*)>", placeholder, text)
    text = re.sub(r"(?<!\S)([A-Za-z_]\w*)(=)\.\.\.(?!\S)", elided, text)
    text = re.sub(r"(?<!\S)(--[\w.-]+)( )\.\.\.(?!\S)", elided, text)
    return re.sub(r"\s+\.\.\.(?=\s|$)", "", text)


def words(text: str) -> list[str]:
    """The shell words of ``text`` for classifying it (placeholders and $(...) as one word each)."""
    text = re.sub(r"<[^<>]*>", "X", re.sub(r"\$\([^)]*\)", "X", text))
    return shlex.split(text)


def program(text: str) -> list[str]:
    """The words of ``text`` from its program on (leading NAME=value words dropped)."""
    argv = words(text)
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv.pop(0)
    return argv


def make_targets(argv: list[str]) -> list[str]:
    return [w for w in argv[1:] if "=" not in w and not w.startswith("-")]


def mabn_command(argv: list[str]) -> tuple[str | None, list[str]] | None:
    """For ``python -m mabn ...``: (the command, its arguments); None for another python command (a module of the
    package run on its own is no entry point of the product)."""
    if len(argv) < 3 or argv[1] != "-m" or argv[2] != "mabn":
        return None
    return (argv[3] if len(argv) > 3 else None), argv[4:]


def classify(command: Command) -> str:
    """The kind of ``command`` (UNKNOWN when no rule applies)."""
    if command.where == "python block":
        return SNIPPET
    try:
        argv = program(fill(command.text))
    except PlaceholderError:
        return UNKNOWN
    if not argv:
        return UNKNOWN
    name = argv[0]
    if name == "srun":  # the job script's launcher: the stage inside train.sbatch's allocation
        return STAGE if mabn_command(argv[1:]) and mabn_command(argv[1:])[0] in STAGES else UNKNOWN
    if name == "make":
        targets = make_targets(argv)
        if len(targets) != 1:
            return UNKNOWN
        target = targets[0]
        if target in USAGE_TARGETS and len(argv) == 2:
            return USAGE
        for kind, names in ((STAGE, STAGE_TARGETS), (REAL, REAL_TARGETS), (PLAN, PLAN_TARGETS),
                            (MAKE_N, MAKE_N_TARGETS)):  # fmt: skip
            if target in names:
                return kind
        return UNKNOWN
    if name in ("python", "python3"):
        if argv[1:3] == ["-m", "pytest"]:
            return PYTEST
        if len(argv) > 1 and argv[1] == "-c":
            return SNIPPET
        if argv[1:2] == [GPU_CHECK]:
            return PLAN
        found = mabn_command(argv)
        if found is None:
            return UNKNOWN
        sub, rest = found
        synopsis = "[" in command.text or any(re.fullmatch(r"[A-Z]{2,}", w) for w in rest)  # CKPT [--out DIR]
        if sub is None or synopsis or (not rest and sub in REAL_COMMANDS - {"demo-data"}):
            return HELP
        if sub in STAGES:
            return STAGE
        if sub in ("fit", "validate"):
            return FIT
        if sub in PLAN_COMMANDS:
            return PLAN
        if sub in REAL_COMMANDS:
            return REAL
        return UNKNOWN
    if name.startswith("scripts/"):
        if len(argv) == 1:
            return SCRIPT_NAME
        return STAGE if name.endswith("submit.sh") else UNKNOWN
    if name == "sbatch":
        return STAGE if any(w.endswith(".sbatch") for w in argv[1:]) else UNKNOWN
    if name == "torchrun":
        return STAGE if "mabn" in argv and argv[argv.index("mabn") - 1] == "-m" else UNKNOWN
    return UNKNOWN


def expected(command: Command) -> tuple[int, str | None]:
    """The exit status the docs document for ``command`` and the line its output must hold."""
    if command.error is not None:
        return 2, command.error
    if command.text in EXPECTED:
        return EXPECTED[command.text]
    if classify(command) == USAGE:
        return 2, f"usage: make {make_targets(program(fill(command.text)))[0]} CKPT="
    return 0, None


def slow_reason(command: Command, kind: str) -> str | None:
    """Why the case belongs to the slow suite, or None."""
    for pattern, why in SLOW_TEXT.items():
        if re.search(pattern, command.text):
            return why
    if kind in SLOW_KINDS and expected(command)[0] == 0:
        return f"{kind}: runs for real"
    if kind in PAGE_SLOW_KINDS and command.file not in FRONT_DOOR:
        return f"{kind} of a docs/ page: the default suite replays the front door's"
    return None
