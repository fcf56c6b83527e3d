"""``make slurm`` checks a job where it is submitted: the stage's dry run, in a simulated allocation of the job's
shape, runs before ``sbatch``; a job that fails it is not submitted, and every independent problem is named.

The make and shell cases run in a checkout-like folder (the Makefile, scripts and configs linked, the venv with a
stamp of its own) with a stand-in ``sbatch`` on PATH that records its arguments; the stages only dry-run."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from mabn import errors
from mabn.cli import launch

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
SBATCH = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$(mktemp "$SBATCH_RECORD/call.XXXXXX")"
echo "Submitted batch job 4242"
"""
# The caller's launcher layout, make flags and the SLURM scripts' settings must not reach a case.
FOREIGN = re.compile(
    r"^(SLURM_\w+|WORLD_SIZE|RANK|LOCAL_RANK|MASTER_\w+|TORCHELASTIC_\w+|MAKEFLAGS|MFLAGS|MAKELEVEL|GPUS|NODES|"
    r"AFTER|PYTHON|TIME|PARTITION|ACCOUNT|CPUS_PER_TASK|NORM|DATA|BACKBONE|RUN_DIR|RESUME|ARGS|DRY_RUN|STAGE)$"
)


@pytest.fixture
def checkout(tmp_path) -> tuple[Path, dict[str, str]]:
    """(a checkout-like folder, the environment that puts the stand-in sbatch first on PATH)."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    repo.mkdir()
    bin_dir.mkdir()
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "configs", "scripts"):
        (repo / name).symlink_to(ROOT / name)
    (repo / ".venv").mkdir()
    for name in ("bin", "lib", "lib64", "pyvenv.cfg"):
        if (VENV / name).exists():
            (repo / ".venv" / name).symlink_to(VENV / name)
    (repo / ".venv" / ".installed").touch()  # newer than pyproject.toml and constraints.txt: make installs nothing
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(SBATCH)
    sbatch.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not FOREIGN.match(k)}
    env.update(PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]), SBATCH_RECORD=str(tmp_path / "sbatch"))
    env.update(WANDB_MODE="disabled")
    (tmp_path / "sbatch").mkdir()
    return repo, env


def make_slurm(repo: Path, env: dict[str, str], *settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "slurm", *settings], cwd=repo, env=env, capture_output=True, text=True
    )


def submitted(env: dict[str, str]) -> list[list[str]]:
    """The argument lists sbatch was called with, one per call."""
    return [call.read_text().splitlines() for call in sorted(Path(env["SBATCH_RECORD"]).iterdir())]


@pytest.mark.slow  # make and the sbatch and srun shims in subprocesses
def test_a_broken_job_submits_nothing_and_names_every_problem(checkout, tmp_path):
    """Device count, the job it waits for, norm, data, backbone and a LightningCLI argument: all of them, one
    ``error:`` line each, exit status 2, and sbatch never called."""
    repo, env = checkout
    out = make_slurm(
        repo, env, "STAGE=cityscapes", "NORM=mabm", f"DATA={tmp_path / 'missing'}", f"BACKBONE={tmp_path / 'no.pt'}",
        "GPUS=abc", "AFTER=x", "ARGS=--trainer.no_such 3",
    )  # fmt: skip
    assert submitted(env) == []
    assert "Submitted batch job" not in out.stdout
    assert "Error 2" in out.stderr  # make's report of the recipe's exit status 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    expected = [
        "GPUS >= 1 (GPUs per node) and NODES >= 1, got GPUS=abc",
        "AFTER=x: expected the id of a submitted job",
        "NORM=mabm: unknown norm",
        f"DATA={tmp_path / 'missing'}: no such folder",
        f"BACKBONE={tmp_path / 'no.pt'}: no such file",
        "unrecognized argument --trainer.no_such",
    ]
    assert len(errors) == len(expected), out.stderr
    for line, shown in zip(errors, expected, strict=True):
        assert shown in line, out.stderr
    assert "nothing submitted" in out.stderr
    assert not (repo / "runs").exists() and not (repo / "data").exists()


@pytest.mark.slow  # make and the sbatch and srun shims in subprocesses, then the job's stage
@pytest.mark.parametrize(
    ("stage_name", "after"),
    [
        pytest.param("cityscapes", None, id="cityscapes"),
        pytest.param("segment", "1001", id="segment-after"),
    ],
)
def test_a_good_job_is_checked_then_submitted_once(stage_name, after, checkout, tiny_cityscapes, tmp_path):
    """A job that passes its check is submitted once, in the layout it was checked in; with AFTER, with
    ``--dependency=afterok:<id>``, and its check knows the stage-1 backbone comes from that job."""
    from mabn.data.synthetic import segment as demo_segment

    repo, env = checkout
    data = tiny_cityscapes if stage_name == "cityscapes" else demo_segment.generate(tmp_path / "own", 4, 2, (32, 64))
    # 4 training images: a global batch of 4 gives each of the 2 devices one normalization batch of 2
    settings = [
        f"STAGE={stage_name}",
        "NORM=mabn",
        f"DATA={data}",
        "GPUS=2",
        "ARGS=--data.init_args.global_batch_size 4",
    ]
    settings += [f"AFTER={after}"] if after else ["BACKBONE=none"]
    out = make_slurm(repo, env, *settings)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Submitted batch job 4242" in out.stdout
    assert "SLURMEnvironment: 1 node(s) x 2 process(es) agree with the launcher" in out.stdout
    (call,) = submitted(env)
    assert {"--nodes=1", "--ntasks-per-node=2", "--gres=gpu:2", f"--job-name=mabn-{stage_name}"} <= set(call)
    script = call.index(str(repo / "scripts" / "slurm" / "train.sbatch"))
    assert call[script + 1 : script + 3] == [stage_name, "--norm"]
    assert call[-3:] == ["--", "--data.init_args.global_batch_size", "4"]
    dependency = [a for a in call if a.startswith("--dependency")]
    if after:
        assert dependency == [f"--dependency=afterok:{after}"] and "--kill-on-invalid-dep=yes" in call
        assert "to be written by the stage-1 job this one waits for" in out.stdout
    else:
        assert dependency == []
        assert "Backbone: none (BACKBONE=none)" in out.stdout
    assert (repo / "runs" / "slurm").is_dir()  # the job's --output folder
    assert not (repo / "data").exists()  # a check generates nothing


def test_the_launch_reports_each_independent_problem(tmp_path):
    """In process: devices (syncbn on one device), data and backbone together, in the plan's order."""
    found, problems = launch.checked_plan(
        "cityscapes", tmp_path / "missing", "syncbn", 1, 1, [], backbone=tmp_path / "no.pt", dry_run=True
    )
    assert len(problems) == 3, problems
    assert problems[0].startswith("NORM=syncbn synchronizes BatchNorm across GPUs")
    assert problems[1].startswith(f"DATA={tmp_path / 'missing'}: no such folder")
    assert problems[2] == f"BACKBONE={tmp_path / 'no.pt'}: no such file"
    assert found.backbone_args == ()  # stand-ins where a check failed
    with pytest.raises(launch.LaunchErrors) as raised:
        launch.plan("pretrain", tmp_path / "missing", "mabm", -1, 1, [])
    assert len(raised.value.messages) == 3  # norm, devices, data
    with pytest.raises(launch.LaunchError, match="^NORM=mabm: unknown norm") as raised:
        launch.plan("pretrain", None, "mabm", 0, 1, [])
    assert str(raised.value).count("\n") == 0  # one problem: one line


def test_one_problem_is_one_line_several_are_one_line_each(capsys):
    """The stage command's output: an ``error:`` line per problem, exit status 2."""
    with pytest.raises(SystemExit) as ended:
        errors.exit_on_user_error(launch.LaunchErrors(["first", "second"]))
    assert ended.value.code == 2
    assert capsys.readouterr().err == "error: first\nerror: second\n"
    with pytest.raises(SystemExit):
        errors.exit_on_user_error(launch.LaunchErrors(["only"]))
    assert capsys.readouterr().err == "error: only\n"
