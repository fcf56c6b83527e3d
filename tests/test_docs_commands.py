"""Every command that README.md, pretrain/README.md and docs/**/*.md show runs here, one test case per command
(id ``file:line``): the project's rule is that a documented example that fails is a bug.

What counts as a command, and the kinds, are defined in ``tests/helpers/docs_commands.py``. A command that no rule there
classifies fails its case, naming what to add; ``NOT_RUN`` lists, with the reason, the few that cannot run in a
test (a weights download, minutes of torch.compile). The slow marker goes to the cases that run for real (below) and
to the docs/ pages' stage dry runs, fit checks and snippets; those of README.md and pretrain/README.md run in the
default suite (``docs_commands.slow_reason``).

Where the commands run. Each case gets its own sandbox: a temporary folder laid out like a checkout (links to
the Makefile, pyproject.toml, configs/, scripts/ and tests/), so the command runs exactly as written from "the
repository root" while runs/, data/, pretrain/ and docs/ outputs (``OUT=docs/plots-cityscapes``) land in the
sandbox, never in the working tree. Each shell command runs through ``bash -c`` in the sandbox, with real
``make`` and the real scripts; the sandbox's ``.venv/bin/python``, and ``python``, ``torchrun``, ``sbatch`` and
``srun`` on its PATH, are a recorder that notes each call (program, folder, arguments, environment) and exits 0.
The test then replays the recorded Python calls in its own process (``python -m mabn`` costs ~5 s of imports
as a subprocess), in order, with the call's folder and environment, and stops at the first that fails, as
make and ``set -e`` would:

- stages (``make pretrain|cityscapes|segment|slurm``, ``python -m mabn pretrain|cityscapes|segment``,
  ``scripts/slurm/submit.sh``,
  ``sbatch``/``srun`` of train.sbatch, ``torchrun ... -m mabn``) run as dry runs: make gets ``DRY_RUN=1`` (the
  Makefile passes ``--dry-run`` on, to submit.sh for slurm), submit.sh ``--dry-run``, and a replayed stage call
  that lacks it gets ``--dry-run`` (before ``--``). sbatch and srun run train.sbatch's stage inside a simulated
  allocation of its ``#SBATCH`` shape, as submit.sh's dry run does; torchrun's stage gets the variables torchrun
  sets (WORLD_SIZE, RANK, LOCAL_RANK, GROUP_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
  TORCHELASTIC_RUN_ID), and the case checks that Lightning's SLURM or TorchElastic environment was detected and
  agreed with. A dry run must write nothing in the sandbox;
- ``python -m mabn fit|validate`` is parsed and checked by ``mabn.cli.lightning.check`` (its dry run),
``--print_config``
  runs as is;
- ``bench``, ``ablation``, ``scripts/gpu/check.py`` and ``make bench|ablation|gpu-check`` run their ``--dry-run``
  plan; the GPU tests that ``make gpu-check`` starts are checked (files exist, ``MABN_TEST_DEVICE=cuda``), not run;
- ``make test``, ``test-slow``, ``test-gpu`` (this suite inside itself, or a GPU) are ``make -n``: every recipe
  line must be a known ruff or pytest line naming existing test files;
- ``export``, ``test-split``, ``predict``, ``plots`` (make targets and ``python -m mabn`` commands) and
  ``demo-data`` run for real (slow marker) on a two-step PSPNet/ResNet-18 fit at crop 32 made once per session:
  its run folder is linked to the path the command names (``CKPT=runs/cityscapes/mabn/checkpoints/last.ckpt``,
  ``RUN=runs/demo/cityscapes/mabn``, make plots' default; a path with ``segment`` gets a like fit of
  ``python -m mabn segment`` on the generated dataset of one's own). ``export`` gets ``--input-size 64 128`` when the
  command gives none: its default 512x1024 float64 check takes a minute on 2 cores;
- a bare ``make export|test-split|predict`` must print the target's usage and exit 2; a command's bare name or
  its synopsis (``python -m mabn test CKPT [--data ROOT] ...``) must have a ``--help`` that names every option;
- ``python -m pytest ...`` is collected only (it must select tests); ``python -c`` and ```python blocks run.

Placeholders: ``<...>`` and elided values (``CKPT=...``, ``--norm ...``) take the values of
``docs_commands.PLACEHOLDERS`` / ``ELIDED``; /data/imagenet, /path/to/imagenet, /path/to/imagefolder are a
generated ImageNet layout (train/<wnid>/*.JPEG, enough images for a batch of 32 on 16 devices), /data/cityscapes
and /path/to/cityscapes a generated Cityscapes layout (leftImg8bit and gtFine, splits train, val, test),
/data/my-data and /path/to/my-data a generated dataset of one's own (images/, masks/, classes.yaml),
/path/to/images a folder of PNGs, /path/to/out a folder in the sandbox; a command or snippet that names a demo
set's folder (data/demo-cityscapes, data/demo-segment) finds a small one generated there, one that names a
stage-2 checkpoint under runs/ finds the session's short fit there. Files a command takes as given are
created where it expects them, the way the product writes them: stage 2 runs after stage 1, so its sandbox holds
``pretrain/[demo/]<arch>-<norm>.pt`` (or the ``BACKBONE=`` file the command names, a torchvision state dict for
``*.pth``), and a warm start of stage 1 finds the ``INIT=`` file it names likewise, written by ``save_backbone``
from a ResNet of the norm built on the meta device with zero-strided tensors (every key and shape of the real
file, a few hundred kB: a dry run reads it, nothing loads its weights); the ablation snippets read
``runs/ablation*/results.json`` written by the ablation's own writer. The failing examples of docs/reliability.md
get the file the row describes (``SETUPS``).

A documented failure (a table row with an ``error:`` cell, ``docs_commands.EXPECTED``, a bare target's usage) must
exit 2 and print that line; everything else must exit 0.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import docs_commands as dc
from helpers.backbone_files import Backbones

ROOT = dc.ROOT
VENV = ROOT / ".venv"
# The checkout a sandbox stands for.
LINKED = ("Makefile", "pyproject.toml", "constraints.txt", "configs", "scripts", "tests")
HIDDEN = {".venv", ".bin", "tmp"}  # sandbox entries that are the harness's, not outputs of a command
EXPORT_SIZE = ["--input-size", "64", "128"]
# Variables of the caller's shell that must not reach a case: a launcher's layout, an outer make's flags, and the
# Makefile's and the SLURM scripts' settings (make's `?=` and the scripts read them from the environment).
MAKE_VARIABLES = re.findall(r"^([A-Z_]+)\s*\?=", (ROOT / "Makefile").read_text(), re.M)
FOREIGN_ENV = re.compile(
    r"^(SLURM_\w+|WORLD_SIZE|RANK|LOCAL_RANK|GROUP_RANK|LOCAL_WORLD_SIZE|ROLE_\w+|MASTER_ADDR|MASTER_PORT|"
    r"TORCHELASTIC_\w+|MAKEFLAGS|MFLAGS|MAKELEVEL|GPUS|NODES|AFTER|PYTHON|TIME|PARTITION|ACCOUNT|CPUS_PER_TASK|"
    + "|".join(MAKE_VARIABLES)
    + ")$"
)
IGNORED_ENV = {"PWD", "OLDPWD", "SHLVL", "_", "PATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKE_TERMOUT",
               "MAKE_TERMERR", "DOCS_RECORD_DIR"}  # fmt: skip
RECORDER = """#!/usr/bin/env bash
# tests/test_docs_commands.py: notes this call (program, folder, arguments, environment) for the test to replay
# in its own process, and succeeds.
set -eu
n=$(ls "$DOCS_RECORD_DIR" | wc -l)
f="$DOCS_RECORD_DIR/$(printf %04d $((n / 2)))"
env -0 > "$f.env"
printf '%s\\0' "$(basename "$0")" "$PWD" "$@" > "$f.args"
"""
ABLATION_RUNS = {  # the rows of the two ablation commands of docs/ablation/ablation.md, by output folder
    "runs/ablation": ("bn32", "bn2", "brn2", "mbn2", "mabn2"),
    "runs/ablation-locate": ("bn32", "mbn32", "mabn_nowc2", "mabn_smas2", "mabn_emas2"),
}

COMMANDS = dc.all_commands()


def _params() -> list:
    params, seen = [], {}
    for command in COMMANDS:
        if dc.not_run_reason(command):
            continue
        seen[command.id] = seen.get(command.id, 0) + 1
        case_id = command.id + (f"+{seen[command.id]}" if seen[command.id] > 1 else "")
        slow = dc.slow_reason(command, dc.classify(command))
        params.append(pytest.param(command, id=case_id, marks=[pytest.mark.slow] if slow else []))
    return params


# ---------------------------------------------------------------------------------------------------------------
# Session fixtures: data layouts, backbone files, a tiny stage-2 run.


@dataclass(frozen=True)
class Assets:
    imagenet: Path
    cityscapes: Path
    images: Path
    own: Path  # a dataset of one's own (python -m mabn segment)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    from mabn.data.synthetic import cityscapes as demo_cityscapes
    from mabn.data.synthetic import segment as demo_segment

    root = tmp_path_factory.mktemp("docs-data")
    # ImageNet: 2 classes; 600 training images, enough for a batch of 32 on each of 16 devices (2 nodes x 8).
    first = root / "first.JPEG"
    Image.new("RGB", (8, 8), (120, 30, 60)).save(first)
    for split, count in (("train", 300), ("val", 2)):
        for wnid in ("n01440764", "n01443537"):
            folder = root / "imagenet" / split / wnid
            folder.mkdir(parents=True)
            for i in range(count):
                os.link(first, folder / f"{wnid}_{i}.JPEG")
    # Cityscapes: 32 training images (a global batch of 16 over up to 16 devices), a val and a test split.
    cityscapes = demo_cityscapes.generate(root / "cityscapes", n_train=32, n_val=3, size=(32, 64), seed=5)
    for kind in ("leftImg8bit", "gtFine"):
        shutil.copytree(cityscapes / kind / "val", cityscapes / kind / "test")
    images = root / "images"
    images.mkdir()
    for path in sorted((cityscapes / "leftImg8bit" / "val").rglob("*.png"))[:2]:
        shutil.copy(path, images / path.name)
    own = demo_segment.generate(root / "my-data", n_train=32, n_val=3, size=(32, 64), seed=5)
    return Assets(root / "imagenet", cityscapes, images, own)


@pytest.fixture(scope="session")
def tiny_run(stage2_run) -> Path:
    """The session's short stage-2 fit (conftest.py's ``stage2_run``), its norm statistics logged at every step."""
    return stage2_run.folder


@pytest.fixture(scope="session")
def tiny_segment_run(segment_run) -> Path:
    """The session's short fit of ``python -m mabn segment`` on a generated dataset of one's own."""
    return segment_run.folder


# ---------------------------------------------------------------------------------------------------------------
# The failing examples of docs/reliability.md: the file each row describes.


def _truncated_checkpoint(w: Path) -> None:
    path = w / "cut.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"norm": "mabn"}, "global_step": 1}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


SETUPS: dict[str, Callable[[Path, Backbones], object]] = {
    "make cityscapes DATA=cityscapes": lambda w, b: (w / "cityscapes" / "leftImg8bit").mkdir(parents=True),
    "make segment DATA=mine": lambda w, b: [(w / "mine" / part).mkdir(parents=True) for part in ("images", "masks")],
    "make export CKPT=cut.ckpt": lambda w, b: _truncated_checkpoint(w),
    "make export CKPT=b.pt": lambda w, b: b.place(b.stage1("mabn", "resnet18"), w / "b.pt"),
    "make plots RUN=runs/nothing": lambda w, b: (w / "runs" / "nothing").mkdir(parents=True),
}


# ---------------------------------------------------------------------------------------------------------------
# Running one command.


@dataclass
class Call:
    program: str
    cwd: Path
    argv: list[str]
    env: dict[str, str]


@dataclass
class Case:
    command: dc.Command
    kind: str
    sandbox: Path
    calls: Path  # the recorder's folder
    env: dict[str, str]  # what bash runs with
    request: pytest.FixtureRequest
    monkeypatch: pytest.MonkeyPatch
    capfd: pytest.CaptureFixture
    output: list[str] = field(default_factory=list)
    created: set[Path] = field(default_factory=set)  # files the harness put in the sandbox
    replayed: int = 0
    dry_run_asked: bool = False  # the shell text asks for a dry run (DRY_RUN=1, --dry-run): the stage must get it

    def say(self, text: str) -> None:
        self.output.append(text)


def _sandbox(root: Path, real_python: bool = False) -> tuple[Path, Path, dict[str, str]]:
    """(sandbox, recorder folder, bash environment) of a checkout-like folder under ``root``."""
    sandbox, calls, bin_dir = root / "repo", root / "calls", root / "repo" / ".bin"
    for folder in (sandbox, calls, bin_dir, sandbox / "tmp"):
        folder.mkdir(parents=True)
    for name in LINKED:
        (sandbox / name).symlink_to(ROOT / name)
    recorder = bin_dir / "record"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    if real_python:  # the venv itself, with a stamp of its own: make must never reinstall the real one
        (sandbox / ".venv").mkdir()
        for name in ("bin", "lib", "lib64", "pyvenv.cfg"):
            if (VENV / name).exists():
                (sandbox / ".venv" / name).symlink_to(VENV / name)
        (sandbox / ".venv" / ".installed").touch()
    else:
        (sandbox / ".venv" / "bin").mkdir(parents=True)
        for name in ("python", "ruff"):
            (sandbox / ".venv" / "bin" / name).symlink_to(recorder)
        (sandbox / ".venv" / ".installed").touch()  # newer than the files it depends on: make installs nothing
    for name in ("python", "python3", "torchrun", "sbatch", "srun"):
        if not real_python or name in ("torchrun", "sbatch", "srun"):
            (bin_dir / name).symlink_to(recorder)
    env = {k: v for k, v in os.environ.items() if not FOREIGN_ENV.match(k)}
    path = [str(bin_dir)] + ([str(VENV / "bin")] if real_python else [])
    env.update(
        PATH=os.pathsep.join([*path, env.get("PATH", "")]),
        DOCS_RECORD_DIR=str(calls),
        TMPDIR=str(sandbox / "tmp"),
        WANDB_MODE="disabled",
        NODE_RANK="0",  # the torchrun example's shell variables (docs/scaling.md)
        MASTER="127.0.0.1",
    )
    return sandbox, calls, env


def _files(sandbox: Path) -> set[Path]:
    found = set()
    for top, dirs, names in os.walk(sandbox):
        here = Path(top)
        dirs[:] = [d for d in dirs if not (here / d).is_symlink() and not (here == sandbox and d in HIDDEN)]
        found |= {here / d for d in dirs} | {here / n for n in names if not (here / n).is_symlink()}
    return found


def _data_paths(text: str, case: Case) -> str:
    assets: Assets = case.request.getfixturevalue("assets")
    paths = {
        "/data/imagenet": assets.imagenet,
        "/path/to/imagenet": assets.imagenet,
        "/path/to/imagefolder": assets.imagenet,
        "/data/cityscapes": assets.cityscapes,
        "/path/to/cityscapes": assets.cityscapes,
        "/data/my-data": assets.own,
        "/path/to/my-data": assets.own,
        "/path/to/images": assets.images,
        "/path/to/out": case.sandbox / "out",
    }

    def replace(match: re.Match) -> str:
        if match.group(1) not in paths:
            raise dc.PlaceholderError(f"no generated data for {match.group(1)}: add it to _data_paths")
        return str(paths[match.group(1)])

    return re.sub(r"(?<![\w./-])(/data/[\w-]+|/path/to/[\w-]+)", replace, text)


def prepared(command: dc.Command, kind: str, case: Case) -> str:
    """The shell text a case runs: placeholders filled, data paths generated, and the dry-run switches."""
    text = command.text if kind == dc.SNIPPET else _data_paths(dc.fill(command.text), case)
    argv = dc.program(text)
    if kind == dc.STAGE and argv[0] == "make" and not any(w.startswith("DRY_RUN=") for w in argv):
        text += " DRY_RUN=1"
    if kind == dc.STAGE and argv[0].endswith("submit.sh") and "--dry-run" not in argv:
        text = re.sub(r"(scripts/\S*submit\.sh)", r"\1 --dry-run", text, count=1)
    if kind == dc.MAKE_N:
        text = re.sub(r"(^|\s)make(\s)", r"\1make -n\2", text, count=1)
    return text


def _read_call(args: Path) -> Call:
    program, cwd, *argv = args.read_bytes().split(b"\0")[:-1]
    env = dict(item.split("=", 1) for item in args.with_suffix(".env").read_bytes().decode().split("\0") if "=" in item)
    return Call(program.decode(), Path(cwd.decode()), [a.decode() for a in argv], env)


@contextlib.contextmanager
def _as_called(call: Call, case: Case) -> Iterator[None]:
    """The call's folder and environment for an in-process replay, restored afterwards."""
    with case.monkeypatch.context() as mp:
        mp.chdir(call.cwd)
        for key in [k for k in os.environ if FOREIGN_ENV.match(k)]:
            mp.delenv(key)
        for key, value in call.env.items():
            if key not in IGNORED_ENV and case.env.get(key) != value:
                mp.setenv(key, value)
        yield


def _in_process(case: Case, fn: Callable[[], object]) -> int:
    """Run ``fn`` as a command would run: its exit status, its output kept in the case's output."""
    case.capfd.readouterr()
    try:
        result = fn()
        code = result if isinstance(result, int) else 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else (0 if exit_info.code is None else 1)
    except Exception:
        code = 1
        case.say(traceback.format_exc())
    out = case.capfd.readouterr()
    case.say(out.out + out.err)
    return code


def _option(argv: list[str], name: str) -> str | None:
    cut = argv.index("--") if "--" in argv else len(argv)
    for i, word in enumerate(argv[:cut]):
        if word == name and i + 1 < cut:
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def _after_cut(argv: list[str], name: str) -> str | None:
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    return rest[rest.index(name) + 1] if name in rest[:-1] else None


def _named_backbone(target: Path, arch: str, backbones: Backbones) -> Path | None:
    """The light file a command names: torchvision's state dict for ``*.pth``, a stage-1 file of the norm and arch
    for ``<arch>-<norm>.pt`` (of BN over the whole batch under ``bn32/``); None for another name."""
    named = re.fullmatch(r"(resnet\d+)-(\w+)\.pt", target.name)
    if target.suffix == ".pth":
        return backbones.torchvision(arch)
    if named:
        return backbones.stage1(named.group(2), named.group(1), None if target.parent.name == "bn32" else 2)
    return None


def _place(source: Path | None, target: Path, case: Case) -> None:
    target = target if target.is_absolute() else Path.cwd() / target
    if source is not None and not target.exists():
        case.created.add(case.request.getfixturevalue("backbones").place(source, target))


def _stage2_backbone(argv: list[str], case: Case) -> None:
    """Stage 2 runs after stage 1: the backbone file the command reads, where it reads it."""
    from mabn.cli.launch import STAGE1_PRESETS
    from mabn.norm import NORM_PRESETS
    from mabn.tasks.classification import backbone_path

    norm, given = _option(argv, "--norm") or "mabn", _option(argv, "--backbone")
    arch = _after_cut(argv, "--model.init_args.arch") or "resnet101"
    if norm in STAGE1_PRESETS or norm not in NORM_PRESETS or given == "none":
        return
    backbones: Backbones = case.request.getfixturevalue("backbones")
    if given is None:
        target = backbone_path(Path("pretrain") / ("demo" if _option(argv, "--data") is None else ""), norm, arch)
        _place(backbones.stage1(norm, arch), target, case)
    else:
        _place(_named_backbone(Path(given), arch, backbones), Path(given), case)


def _stage1_init(argv: list[str], case: Case) -> None:
    """A warm start (``INIT=``, ``--init``) reads the BN network's file it names, where it names it."""
    given = _option(argv, "--init")
    if given is not None:
        arch = _after_cut(argv, "--model.init_args.arch") or "resnet101"
        _place(_named_backbone(Path(given), arch, case.request.getfixturevalue("backbones")), Path(given), case)


def _run_folder(folder: Path, case: Case, checkpoint: Path | None = None) -> None:
    """The session's tiny run, linked to ``folder`` (and its last checkpoint to ``checkpoint``)."""
    if folder.exists() and (checkpoint is None or checkpoint.exists()):
        return  # the command's own file (a failing example's), or one made earlier in the case
    run: Path = case.request.getfixturevalue("tiny_segment_run" if "segment" in folder.parts else "tiny_run")
    if not folder.exists():
        shutil.copytree(run, folder, copy_function=os.link)
        case.created |= {folder / p.relative_to(run) for p in run.rglob("*")}
    if checkpoint is not None and not checkpoint.exists():
        os.link(run / "checkpoints" / "last.ckpt", checkpoint)
        case.created.add(checkpoint)


def _ablation_results(code: str, case: Case) -> None:
    """The results.json files a snippet reads, written by the ablation's writer for the rows of their command."""
    from mabn.tools.ablation import report
    from mabn.tools.ablation.command import DEFAULT_SEEDS, DEFAULT_STEPS
    from mabn.tools.ablation.train import RunResult

    for folder in sorted(set(re.findall(r"(runs/ablation[\w-]*)/results\.json", code))):
        assert folder in ABLATION_RUNS, f"{folder}: which rows? add them to ABLATION_RUNS"
        results = [
            RunResult(row, seed, 1.0 + 0.5 * k + 0.1 * ((3 * seed + len(row) + k) % 5), 60.0, 0.1 + 0.01 * k,
                      losses=[2.0 / (1 + step) + 0.01 * k for step in range(DEFAULT_STEPS)])
            for k, row in enumerate(ABLATION_RUNS[folder]) for seed in range(DEFAULT_SEEDS)
        ]  # fmt: skip
        path = case.sandbox / folder / "results.json"
        if not path.exists():
            report.write_results(path, {"command": f"python -m mabn ablation --out {folder}"}, results)
            case.created |= {path, path.parent}


EXAMPLE_SETS = {"data/demo-cityscapes": "cityscapes", "data/demo-segment": "segment"}


def _example_sets(text: str, case: Case) -> None:
    """The demo sets a command or snippet names (``data/demo-segment/...``), small, generated where it reads them."""
    import importlib

    for folder, module in EXAMPLE_SETS.items():
        root = case.sandbox / folder
        if re.search(rf"(?<![\w/.-]){re.escape(folder)}\b", text) and not root.exists():
            generator = importlib.import_module(f"mabn.data.synthetic.{module}")
            with contextlib.redirect_stdout(None):
                generator.generate(root, n_train=16, n_val=2, size=(32, 64), seed=5)
            case.created |= {root, *root.rglob("*")}


def _checkpoints(code: str, case: Case) -> None:
    """The stage-2 checkpoints a snippet loads (``runs/.../checkpoints/<file>.ckpt``): the session's short fit."""
    for run, name in re.findall(r"(?<![\w/.-])(runs/[\w/.-]+?)/checkpoints/([\w.-]+\.ckpt)", code):
        _run_folder(case.sandbox / run, case, case.sandbox / run / "checkpoints" / name)


def _snippet(code: str, name: str, case: Case) -> int:
    _ablation_results(code, case)
    _example_sets(code, case)
    _checkpoints(code, case)
    return _in_process(case, lambda: exec(compile(code, name, "exec"), {"__name__": "__main__"}))


def _with_dry_run(argv: list[str]) -> list[str]:
    if "--dry-run" in argv:
        return argv
    cut = argv.index("--") if "--" in argv else len(argv)
    return [*argv[:cut], "--dry-run", *argv[cut:]]


def _mabn(argv: list[str], call: Call, case: Case) -> int:
    """``python -m mabn <argv>`` in this process, as the case's kind runs it."""
    from mabn.__main__ import main
    from mabn.cli import lightning as cli
    from mabn.errors import UserError

    sub = argv[0] if argv else None
    if sub in dc.STAGES:
        if case.dry_run_asked and "--dry-run" not in argv:
            case.say(f"DRY_RUN=1 / --dry-run did not reach the stage: python -m mabn {shlex.join(argv)}")
            return 1
        argv = _with_dry_run(argv)
        with _as_called(call, case):
            (_stage2_backbone if sub in ("cityscapes", "segment") else _stage1_init)(argv, case)
    elif sub in ("fit", "validate") and not {"--print_config", "--help", "-h"} & set(argv):

        def check() -> int:
            try:
                print("\n".join(cli.check(argv) or []))
            except UserError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            return 0

        with _as_called(call, case):
            return _in_process(case, check)
    elif sub in dc.PLAN_COMMANDS:
        argv = [*argv, "--dry-run"] if "--dry-run" not in argv else argv
    elif sub in ("export", "test", "predict") and argv[1:] and not argv[1].startswith("-"):
        target = call.cwd / argv[1]
        with _as_called(call, case):
            _run_folder(target.parent.parent if target.parent.name == "checkpoints" else target.parent, case, target)
        if sub == "export" and "--input-size" not in argv:
            argv = [*argv, *EXPORT_SIZE]
    elif sub == "plots" and argv[1:] and not argv[1].startswith("-"):
        with _as_called(call, case):
            _run_folder(call.cwd / argv[1], case)
    with _as_called(call, case):
        if sub in dc.STAGES:
            return _dry_run_once(argv, call, case)
        return _in_process(case, lambda: main(argv))


# A stage's dry run reads its arguments, its folder, its environment and the sandbox's files, and writes nothing:
# the same call with the same files (``make cityscapes`` is documented in a dozen places) runs once per test
# process, and its later cases get its exit status and output. Keys and outputs name the sandbox ``<sandbox>``.
_DRY_RUNS: dict[tuple, tuple[int, str]] = {}


def _dry_run_once(argv: list[str], call: Call, case: Case) -> int:
    from mabn.__main__ import main

    box = str(case.sandbox)
    env = sorted((k, v) for k, v in call.env.items() if k not in IGNORED_ENV and case.env.get(k) != v)
    files = sorted(p.relative_to(case.sandbox).as_posix() for p in _files(case.sandbox))
    key = tuple(repr(part).replace(box, "<sandbox>") for part in (argv, call.cwd, env, files))
    if key in _DRY_RUNS:
        code, output = _DRY_RUNS[key]
        case.say(output.replace("<sandbox>", box))
        return code
    start = len(case.output)
    code = _in_process(case, lambda: main(argv))
    _DRY_RUNS[key] = code, "".join(case.output[start:]).replace(box, "<sandbox>")
    return code


def _test_files(argv: list[str], case: Case) -> list[str] | None:
    """The test files a pytest command names, or None (said) when one is missing."""
    files = [a.split("::")[0] for a in argv if a.startswith("tests/")]
    missing = [f for f in files if not (ROOT / f).is_file()]
    if missing:
        case.say(f"pytest names missing test files: {missing}")
        return None
    return files


def _gpu_tests(argv: list[str], env: dict[str, str], case: Case) -> int:
    """make's GPU tests (test-gpu, gpu-check): the tests marked gpu, run with MABN_TEST_DEVICE=cuda; not run."""
    if _test_files(argv, case) is None:
        return 1
    if env.get("MABN_TEST_DEVICE") != "cuda":
        case.say(f"make's GPU tests run without MABN_TEST_DEVICE=cuda: {shlex.join(argv)}")
        return 1
    if "-m" not in argv or argv[argv.index("-m") + 1 :][:1] != ["gpu"]:
        case.say(f"make's GPU tests select other tests than those marked gpu: {shlex.join(argv)}")
        return 1
    case.say(f"(not run here) GPU tests: {shlex.join(argv)}\n")
    return 0


def _pytest(argv: list[str], call: Call, case: Case) -> int:
    """A pytest command the docs show: the files it names exist, and collected (not run) it selects tests."""
    if case.kind != dc.PYTEST:
        return _gpu_tests(argv, call.env, case)
    if _test_files(argv, case) is None:
        return 1
    run = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "pytest", *argv, "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=call.cwd, env=case.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    case.say(run.stdout[-3000:] + run.stderr[-3000:])
    return run.returncode  # 5 when nothing is selected


def _allocation(script: Path, options: list[str]) -> dict[str, str]:
    """The simulated SLURM allocation of a job script: its #SBATCH lines, then ``options`` (as sbatch reads them)."""
    settings = {}
    for word in [*re.findall(r"^#SBATCH\s+(\S+)", script.read_text(), re.M), *options]:
        if word.startswith("--") and "=" in word:
            key, value = word[2:].split("=", 1)
            settings[key] = value
    nodes, tasks = int(settings.get("nodes", 1)), int(settings.get("ntasks-per-node", 1))
    return {"SLURM_JOB_ID": "0", "SLURM_JOB_NAME": settings.get("job-name", script.stem), "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_NTASKS": str(nodes * tasks), "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # fmt: skip


def _check_launcher(case: Case, start: int, code: int, name: str) -> int:
    if code == 0 and name not in "".join(case.output[start:]):
        case.say(f"the stage did not detect {name}: the launcher's layout was not checked")
        return 1
    return code


def _replay(call: Call, case: Case) -> int:
    argv, start = call.argv, len(case.output)
    if call.program in ("python", "python3"):
        if argv[:2] == ["-m", "mabn"]:
            code = _mabn(argv[2:], call, case)
            return _check_launcher(case, start, code, "SLURMEnvironment") if "SLURM_JOB_ID" in call.env else code
        if argv[:2] == ["-m", "pytest"]:
            return _pytest(argv[2:], call, case)
        if argv[:1] == ["-c"] and len(argv) == 2:
            with _as_called(call, case):
                return _snippet(argv[1], "<python -c>", case)
        if argv[:1] == [dc.GPU_CHECK]:  # make gpu-check's tool: its plan
            from helpers.gpu_check import check

            with _as_called(call, case):
                return _in_process(case, lambda: check.main(_with_dry_run(argv[1:])))
    if call.program == "torchrun":
        options = {}
        while argv and argv[0] != "-m":
            key, _, value = argv.pop(0).lstrip("-").partition("=")
            options[key] = value
        if argv[:2] != ["-m", "mabn"]:
            case.say(f"torchrun of something other than -m mabn: {argv}")
            return 1
        nodes, per_node, node = int(options["nnodes"]), int(options["nproc_per_node"]), int(options.get("node_rank", 0))
        env = {"WORLD_SIZE": str(nodes * per_node), "RANK": str(node * per_node), "LOCAL_RANK": "0",
               "GROUP_RANK": str(node), "LOCAL_WORLD_SIZE": str(per_node), "ROLE_RANK": str(node * per_node),
               "MASTER_ADDR": options.get("master_addr", "127.0.0.1"),
               "MASTER_PORT": options.get("master_port", "29500"), "TORCHELASTIC_RUN_ID": "docs"}  # fmt: skip
        inner = Call("python", call.cwd, argv, {**call.env, **env})
        return _check_launcher(case, start, _mabn(_with_dry_run(argv[2:]), inner, case), "TorchElasticEnvironment")
    if call.program in ("sbatch", "srun"):
        script = ROOT / "scripts" / "slurm" / "train.sbatch"
        if call.program == "sbatch":
            first = next(i for i, a in enumerate(argv) if not a.startswith("-"))
            options, script, args = argv[:first], call.cwd / argv[first], argv[first + 1 :]
            env = {**case.env, **_allocation(script, options), "SLURM_SUBMIT_DIR": str(call.cwd), "DRY_RUN": "1"}
            run = subprocess.run(["bash", str(script), *args], cwd=call.cwd, env=env, capture_output=True, text=True)
            case.say(run.stdout + run.stderr)
            return run.returncode  # the job's python calls were recorded, and are replayed next
        found = dc.mabn_command(argv)
        if found is None or found[0] not in dc.STAGES:
            case.say(f"srun of something other than a stage: {argv}")
            return 1
        inner = Call("python", call.cwd, argv, {**call.env, **_allocation(script, [])})
        return _check_launcher(case, start, _mabn(_with_dry_run(argv[3:]), inner, case), "SLURMEnvironment")
    case.say(f"a call the test cannot replay: {call.program} {shlex.join(argv)}")
    return 1


def command_targets(case: Case) -> list[str]:
    return dc.make_targets(dc.program(dc.fill(case.command.text)))


def _make_n(case: Case, stdout: str) -> int:
    """Every recipe line make -n prints for make test, test-slow, test-gpu: a known ruff or pytest line."""
    lines = [line for line in stdout.replace("\\\n", " ").splitlines() if line.strip()]
    if not lines:
        case.say("make -n printed no recipe")
        return 1
    for line in lines:
        words = shlex.split(line)
        env = {}
        while words and re.match(r"^[A-Z_]+=", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        linted = ["src", "tests", "scripts"]
        if words[:1] == [".venv/bin/ruff"] and words[1:] in (["check", *linted], ["format", "--check", *linted]):
            continue
        gpu = "test-gpu" in command_targets(case)
        # make test-gpu PY=python: the GPU machine's own Python, with the checkout's src/ on its path.
        if words[:3] == [".venv/bin/python", "-m", "pytest"] or gpu and words[:3] == ["python", "-m", "pytest"]:
            if _gpu_tests(words[3:], env, case) if gpu else 0 if _test_files(words[3:], case) is not None else 1:
                return 1
            # make test and test-slow keep the bytecode caches (KEEP_BYTECODE); test-gpu names its device and src/.
            known = set(env) <= {"MABN_TEST_DEVICE", "PYTHONPATH"} if gpu else env == {"PYTHONDONTWRITEBYTECODE": ""}
            if not known:
                case.say(f"unexpected environment of the test line: {env}")
                return 1
            continue
        case.say(f"a recipe line this test does not know (add it to _make_n): {line}")
        return 1
    return 0


def run_command(command: dc.Command, case: Case) -> int:
    """Run ``command`` as its kind says (module docstring); its exit status, its output in ``case.output``."""
    kind = case.kind
    if kind == dc.HELP:
        from mabn.__main__ import main

        argv = dc.program(command.text)
        sub = dc.mabn_command(argv)[0]
        code = _in_process(case, lambda: main([sub, "--help"] if sub else ["--help"]))
        shown = "".join(case.output)
        missing = [o for o in re.findall(r"--[\w-]+", command.text) if o not in shown]
        if missing:
            case.say(f"the synopsis names options that --help does not: {missing}")
            return 1
        return code
    if kind == dc.SCRIPT_NAME:
        path = ROOT / command.text
        runnable = path.is_file() and os.access(path, os.X_OK)
        case.say(f"{command.text}: {'an executable file' if runnable else 'missing or not executable'}\n")
        return 0 if runnable else 1
    if command.where == "python block":
        with case.monkeypatch.context() as mp:
            mp.chdir(case.sandbox)
            return _snippet(command.text, command.id, case)
    if command.text in SETUPS:
        SETUPS[command.text](case.sandbox, case.request.getfixturevalue("backbones"))
        case.created |= _files(case.sandbox)
    _example_sets(command.text, case)
    text = prepared(command, kind, case)
    case.dry_run_asked = kind == dc.STAGE and bool(re.search(r"(^|\s)(DRY_RUN=1|--dry-run)(\s|$)", text))
    case.say(f"$ {text}\n")
    run = subprocess.run(["bash", "-c", text], cwd=case.sandbox, env=case.env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    case.say(run.stdout + run.stderr)
    if kind == dc.MAKE_N:
        return run.returncode or _make_n(case, run.stdout)
    done = 0
    while True:  # in order; a replayed sbatch records the job's calls, replayed after it
        calls = sorted(case.calls.glob("*.args"))
        if done == len(calls):
            break
        code = _replay(_read_call(calls[done]), case)
        done += 1
        if code:
            return code
    case.replayed = done
    return run.returncode


def _check_classified(command: dc.Command) -> str:
    kind = dc.classify(command)
    if kind == dc.UNKNOWN:
        pytest.fail(
            f"{command.id}: {command.text!r} is a command this test does not know how to run: add a rule for it to "
            "classify() in tests/helpers/docs_commands.py (and a runner here if it is a new kind), fill its "
            "placeholders (PLACEHOLDERS, ELIDED), or list it in NOT_RUN with the reason it cannot run in a test"
        )
    return kind


@pytest.mark.parametrize("command", _params())
def test_docs_command_runs(command, tmp_path, request, monkeypatch, capfd):
    kind = _check_classified(command)
    sandbox, calls, env = _sandbox(tmp_path)
    case = Case(command, kind, sandbox, calls, env, request, monkeypatch, capfd)
    for key in [k for k in os.environ if FOREIGN_ENV.match(k)]:
        monkeypatch.delenv(key)
    before = _files(sandbox)
    code = run_command(command, case)
    want, line = dc.expected(command)
    output = "".join(case.output)
    print(output)  # what the command printed, for -rA
    where = f"{command.id} ({command.where}, {kind}): {command.text}"
    assert code == want, f"{where}\nexit status {code}, the docs expect {want}\n{output[-6000:]}"
    if line is not None:
        assert line in output, f"{where}\nthe docs show {line!r}; the output:\n{output[-6000:]}"
    written = {p for p in _files(sandbox) - before - case.created if not any(p in c.parents for c in case.created)}
    if kind in (dc.STAGE, dc.FIT, dc.PLAN, dc.MAKE_N, dc.HELP):
        assert not written, f"{where}\na dry run wrote {sorted(str(p.relative_to(sandbox)) for p in written)}"
    if kind == dc.REAL and code == 0 and _writes(command):
        assert written, f"{where}\nwrote nothing\n{output[-3000:]}"


def _writes(command: dc.Command) -> bool:
    """Whether a real run of ``command`` writes files (export, predict, plots, demo-data; test only prints)."""
    words = dc.program(dc.fill(command.text))
    if words[:1] == ["make"]:
        return dc.make_targets(words)[0] in ("export", "predict", "plots")
    return (dc.mabn_command(words) or (None,))[0] in ("export", "predict", "plots", "demo-data")


# ---------------------------------------------------------------------------------------------------------------
# The extractor, the classifier and the tables of this file.

SAMPLE = """# Title with `make bench`

Set up:

```bash
git clone <this repository> mabn && cd mabn
make pretrain NORM=gn \\
    DATA=/data/imagenet   # a comment
# a comment line
GPUS=2 scripts/slurm/submit.sh pretrain --norm mabn
python -c "
print('two lines')
"
```

```text
$ make cityscapes
make this is output
```

Every `make` target; run `python -m mabn
plots RUN` or `ARGS="--x 1"`.

| what | error |
|---|---|
| `make pretrain DATA=x` | `error: DATA=x: no such folder` |

    make export CKPT=a.ckpt

```python
print("block")
```

```yaml
make: not a command
```
"""


def test_the_extractor_finds_each_form_of_command(tmp_path):
    path = tmp_path / "docs" / "sample.md"
    path.parent.mkdir()
    path.write_text(SAMPLE)
    found = [(c.line, c.where, c.text, c.error) for c in dc.extract(path, tmp_path)]
    assert found == [
        (1, "heading", "make bench", None),
        (7, "bash block", "make pretrain NORM=gn DATA=/data/imagenet", None),
        (10, "bash block", "GPUS=2 scripts/slurm/submit.sh pretrain --norm mabn", None),
        (11, "bash block", "python -c \"\nprint('two lines')\n\"", None),
        (17, "text block", "make cityscapes", None),
        (21, "prose", "python -m mabn plots RUN", None),
        (26, "table", "make pretrain DATA=x", "error: DATA=x: no such folder"),
        (28, "indented block", "make export CKPT=a.ckpt", None),
        (31, "python block", 'print("block")', None),
    ]
    kinds = [dc.classify(c) for c in dc.extract(path, tmp_path)]
    assert kinds == [dc.PLAN, dc.STAGE, dc.STAGE, dc.SNIPPET, dc.STAGE, dc.HELP, dc.STAGE, dc.REAL, dc.SNIPPET]


@pytest.mark.parametrize("text", ["make venv", "make clean", "python setup.py", "srun hostname", "make x <unknown>"])
def test_a_command_no_rule_classifies_fails_its_case(text):
    command = dc.Command("docs/new.md", 1, text, "bash block")
    assert dc.classify(command) == dc.UNKNOWN
    with pytest.raises(pytest.fail.Exception, match="does not know how to run"):
        _check_classified(command)


def test_placeholders_and_elisions_are_filled():
    assert dc.fill("make export CKPT=<checkpoint>") == "make export CKPT=" + dc.PLACEHOLDERS["checkpoint"]
    assert dc.fill("make test-split CKPT=... SPLIT=val") == f"make test-split CKPT={dc.ELIDED['CKPT']} SPLIT=val"
    assert dc.fill("python -m mabn pretrain --data ... --norm ...") == (
        "python -m mabn pretrain --data /data/imagenet --norm mabn"
    )
    assert dc.fill("make pretrain ...") == "make pretrain"
    with pytest.raises(dc.PlaceholderError, match="<unknown>"):
        dc.fill("make x <unknown>")


def test_the_default_suite_replays_the_front_doors_dry_runs_and_the_pages_cheap_commands():
    def slow(file: str, text: str) -> bool:
        command = dc.Command(file, 1, text, "bash block")
        return dc.slow_reason(command, dc.classify(command)) is not None

    for text in (
        "make cityscapes NORM=gn",
        "python -m mabn fit --config configs/cityscapes.yaml",
        'python -c "print(1)"',
    ):
        assert not slow("README.md", text) and not slow("pretrain/README.md", text), text
        assert slow("docs/training.md", text), text
    for text in ("make test", "make bench", "make export"):
        assert not slow("docs/training.md", text), text
    # Every kind the docs show keeps cases in the default suite.
    kept = {dc.classify(c) for c in COMMANDS if not dc.not_run_reason(c) and not dc.slow_reason(c, dc.classify(c))}
    assert {dc.STAGE, dc.FIT, dc.PLAN, dc.MAKE_N, dc.USAGE, dc.HELP, dc.SNIPPET} <= kept


def test_the_docs_show_commands_of_every_kind():
    kinds = {dc.classify(c) for c in COMMANDS if not dc.not_run_reason(c)}
    assert len(COMMANDS) >= 100
    assert {dc.STAGE, dc.FIT, dc.PLAN, dc.MAKE_N, dc.REAL, dc.USAGE, dc.HELP, dc.SNIPPET} <= kinds


def test_every_exception_of_this_file_is_still_in_the_docs():
    """NOT_RUN, SLOW_TEXT, EXPECTED and SETUPS name commands of the docs: an entry whose command is gone is
    removed."""
    texts = [c.text for c in COMMANDS]
    for name, patterns in (("NOT_RUN", dc.NOT_RUN), ("SLOW_TEXT", dc.SLOW_TEXT)):
        for pattern in patterns:
            assert any(re.search(pattern, t, re.M) for t in texts), f"{name} entry matches no command: {pattern}"
    for text in [*dc.EXPECTED, *SETUPS]:
        assert text in texts, f"no such command in the docs any more: {text}"
    for folder in ABLATION_RUNS:
        assert any(f"{folder}/results.json" in t for t in texts), folder


def test_sbatch_of_the_job_script_runs_its_stage_in_a_simulated_allocation(tmp_path, request, monkeypatch, capfd):
    """The runner's sbatch path, on the example of scripts/slurm/train.sbatch's header (2 nodes x 8 GPUs)."""
    text = "sbatch scripts/slurm/train.sbatch cityscapes --norm mabn --data /data/cityscapes"
    command = dc.Command("scripts/slurm/train.sbatch", 6, text, "comment")
    sandbox, calls, env = _sandbox(tmp_path)
    case = Case(command, dc.classify(command), sandbox, calls, env, request, monkeypatch, capfd)
    code = run_command(command, case)
    output = "".join(case.output)
    assert code == 0, output[-4000:]
    assert "+ srun --kill-on-bad-exit=1" in output and "SLURMEnvironment: 2 node(s) x 8 process(es)" in output
    assert case.replayed == 2  # sbatch, then the job's python -m mabn cityscapes ... --dry-run


def test_the_recorder_notes_arguments_folder_and_environment(tmp_path):
    """The recorder stands in for the interpreter: what it notes is what python would have been given."""
    sandbox, calls, env = _sandbox(tmp_path)
    text = 'X=1 python -m mabn pretrain --data "/a b" -- --y "two words"; cd configs && python3 -c pass'
    run = subprocess.run(["bash", "-c", text], cwd=sandbox, env=env, capture_output=True)
    assert run.returncode == 0, run.stderr
    first, second = [_read_call(p) for p in sorted(calls.glob("*.args"))]
    assert (first.program, first.cwd) == ("python", sandbox) and first.env["X"] == "1"
    assert first.argv == ["-m", "mabn", "pretrain", "--data", "/a b", "--", "--y", "two words"]
    assert (second.program, second.cwd, second.argv) == ("python3", sandbox / "configs", ["-c", "pass"])
    assert "X" not in second.env


@pytest.mark.slow  # the venv's interpreter as a subprocess: ~10 s of imports
def test_a_slurm_dry_run_end_to_end_with_the_real_interpreter(tmp_path):
    """What the recorder replays in process, with nothing stood in for: make, submit.sh, train.sbatch, python."""
    sandbox, _, env = _sandbox(tmp_path, real_python=True)
    text = "make slurm STAGE=pretrain NORM=mabn GPUS=8 NODES=2 DRY_RUN=1"
    run = subprocess.run(["bash", "-c", text], cwd=sandbox, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "SLURMEnvironment: 2 node(s) x 8 process(es)" in run.stdout and "python -m mabn fit" in run.stdout
    assert not (sandbox / "runs").exists() and not (sandbox / "data").exists()


@pytest.mark.parametrize(
    ("text", "code", "shown"),
    [
        ("make cityscapes NORM=mabm", 2, "error: NORM=mabm: unknown norm"),
        ("python -m mabn export CKPT [--no-such-option]", 1, "names options that --help does not"),
        ("scripts/slurm/missing.sh", 1, "missing or not executable"),
        ("torchrun --nnodes=1 --nproc_per_node=2 -m mabn cityscapes --gpus 1", 2, "--nproc_per_node=GPUS"),
    ],
)
def test_the_runner_reports_a_failing_command(text, code, shown, tmp_path, request, monkeypatch, capfd):
    """A documented example that fails fails its case: a bad value, an option --help lacks, a missing script, a
    torchrun layout that disagrees with the stage's devices."""
    command = dc.Command("docs/example.md", 1, text, "bash block")
    sandbox, calls, env = _sandbox(tmp_path)
    case = Case(command, dc.classify(command), sandbox, calls, env, request, monkeypatch, capfd)
    assert run_command(command, case) == code
    assert shown in "".join(case.output)
