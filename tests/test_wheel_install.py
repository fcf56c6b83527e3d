"""The package installs as users install it. The recipes travel with it: a wheel built from this checkout, installed
(not editable) into a fresh virtual environment, runs ``python -m mabn cityscapes --dry-run`` from another folder
with the configs it carries (``mabn/configs``, package data), none of the checkout's. And ``pip install .`` keeps
the environment's own torch and torchvision where they are in pyproject.toml's ranges."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_COMMANDS = ("norm", "step", "infer", "all", "ops", "memory")  # python -m mabn bench's, each with --dry-run


def _run(*cmd: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert result.returncode == 0, f"{cmd}: {result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def _tree(tmp_path: Path) -> Path:
    """A copy of what the package is built from (pip builds in the source folder), symlinks kept as they are."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "configs", tree / "configs", ignore=skip)
    shutil.copytree(ROOT / "src", tree / "src", symlinks=True, ignore=skip)
    return tree


@pytest.mark.slow
def test_an_installed_wheel_runs_a_stage_with_its_own_configs(tmp_path):
    tree = _tree(tmp_path)
    pip = [sys.executable, "-m", "pip"]
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", tmp_path / "dist", tree)
    (wheel,) = (tmp_path / "dist").glob("mabn-*.whl")

    # A fresh environment with the wheel installed; torch and the other dependencies come from this one's
    # site-packages, appended to the new one's path once the wheel is in (so pip sees no other mabn).
    env = tmp_path / "env"
    _run(sys.executable, "-m", "venv", "--without-pip", env)
    python = env / "bin" / "python"
    _run(*pip, "--python", python, "install", "--no-deps", "--no-index", "-q", wheel)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "zz-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run(python, "-c", "import mabn.cli.launch as m; print(m.__file__); print(m.CONFIGS)", cwd=elsewhere)
    module, configs = (Path(line) for line in where.stdout.split())
    assert module.is_relative_to(site) and configs == site / "mabn" / "configs"
    assert (configs / "cityscapes.yaml").is_file() and (configs / "trainer" / "cpu.yaml").is_file()

    out = _run(python, "-m", "mabn", "cityscapes", "--norm", "mabn", "--dry-run", cwd=elsewhere).stdout
    command = next(line for line in out.splitlines() if line.startswith("python -m mabn fit "))
    assert f"--config {configs / 'cityscapes.yaml'} --config {configs / 'demo' / 'cityscapes.yaml'}" in command
    assert f"--trainer {configs / 'trainer' / 'cpu.yaml'}" in command
    assert str(ROOT) not in out

    # The cost benchmarks are the package's: each plans its run from the wheel. The GPU check runs the checkout's
    # tests, so it is the checkout's (make gpu-check), no command of the package.
    for what in BENCH_COMMANDS:
        plan = _run(python, "-m", "mabn", "bench", what, "--dry-run", cwd=elsewhere).stdout
        assert plan.startswith(f"dry run of python -m mabn bench {what}: nothing is measured or written"), plan
    assert not list(elsewhere.iterdir())  # nothing measured, nothing written
    for what in ("check", "chain"):
        refused = subprocess.run([python, "-m", "mabn", "bench", what, "--dry-run"], capture_output=True, text=True,
                                 cwd=elsewhere, timeout=300)  # fmt: skip
        assert refused.returncode == 2 and f"invalid choice: '{what}'" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_pip_install_keeps_the_environments_torch(tmp_path):
    """``pip install .`` into an environment that has a torch and torchvision of the ranges pyproject.toml asks for
    (the one running the tests: constraints.txt's in .venv, the second torch's under ``make test-torch``) installs
    neither: pip's report of what it would install names the package and no torch."""
    import torch
    import torchvision

    report = _run(
        sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", _tree(tmp_path)
    ).stdout
    names = {item["metadata"]["name"].lower() for item in json.loads(report)["install"]}
    assert "mabn" in names
    assert not names & {"torch", "torchvision"}, f"pip would replace torch {torch.__version__} or torchvision " + (
        f"{torchvision.__version__}: it would install {sorted(names)}"
    )
