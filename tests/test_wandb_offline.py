"""A wandb server that cannot be reached never ends the training (``mabn.run.loggers.WandbLogger``): wandb asked to
go online (``WANDB_MODE=online``, an API key, as on a cluster's compute nodes) against a server that refuses the
connection or never answers gives up after ``online_timeout`` seconds, and the run goes on offline, its metrics
in the offline run and in ``metrics.csv``, with one line naming the folder to ``wandb sync`` later."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import wandb

from helpers.cli_tiny import CONFIG
from helpers.commands import run_mabn
from helpers.wandb_reader import history, offline_run, wandb_session

TIMEOUT_S = 5  # online_timeout for the test; the product's default is 45 s


@pytest.fixture
def silent_server():
    """A port that accepts connections and never answers: a request to it waits until its deadline, as one to a
    firewalled or unroutable host does."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # the kernel completes the handshakes; nothing ever reads
        yield server.getsockname()[1]


def _fit(cfg: Path, request, monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m mabn fit --config cfg``, run in this process, wandb online."""
    wandb_session(request, monkeypatch, "online")
    return run_mabn(["fit", "--config", str(cfg), "--trainer.max_epochs", "2"], capsys)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # free again once closed: connections are refused


def test_online_timeout_is_wandbs_init_timeout(tmp_path):
    from mabn.run.loggers import WandbLogger

    assert WandbLogger(save_dir=str(tmp_path))._wandb_init["settings"] == {"init_timeout": 45.0}
    logger = WandbLogger(save_dir=str(tmp_path), online_timeout=7, settings={"init_timeout": 3, "quiet": True})
    assert logger._wandb_init["settings"] == {"init_timeout": 3, "quiet": True}  # wandb settings given win


@pytest.mark.slow  # a fit whose wandb start fails
def test_a_failed_online_start_continues_the_same_run_offline(tmp_path, request, monkeypatch, capsys):
    """wandb.init failing online, as it does without a server (no network here: the failure is stood in for),
    is followed by the same run offline in the same folder, the line said once, logged metrics in the run."""
    from mabn.run.loggers import WandbLogger

    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.invalid")  # never reached: wandb.init is stood in for
    wandb_session(request, monkeypatch, "online")
    monkeypatch.chdir(tmp_path)
    real_init, modes = wandb.init, []

    def init(**kwargs):
        modes.append(kwargs.get("mode"))
        if kwargs.get("mode") != "offline":
            raise wandb.errors.CommError("Failed to get resume status for run x: context deadline exceeded\nmore")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    logger = WandbLogger(save_dir="runs", project="tiny")
    assert logger.experiment is logger.experiment  # started once
    logger.log_metrics({"train/loss": 0.5}, step=3)
    logger.experiment.finish()

    run = offline_run(tmp_path / "runs")
    assert modes == [None, "offline"]
    assert run.name.endswith("-" + (tmp_path / "runs" / "wandb-id").read_text().strip())
    shown = f"runs/wandb/{run.name}"
    said = capsys.readouterr().err.splitlines()
    assert [line for line in said if "no online run" in line] == [
        "wandb: no online run at http://wandb.invalid (CommError: Failed to get resume status for run x: context"
        f" deadline exceeded): logging offline to {shown}; upload it later with: wandb sync {shown}"
    ]
    assert [(r["trainer/global_step"], r["train/loss"]) for r in history(run)] == [(3, 0.5)]


@pytest.mark.slow
@pytest.mark.parametrize("server", ["refused", "silent"])
def test_a_fit_with_wandb_unreachable_goes_on_offline(server, tmp_path, request, monkeypatch, capsys):
    """The real failure, through ``python -m mabn fit`` (in this process) on the tiny task: a closed port (refused
    at once; wandb retries until its deadline) and a port that never answers (the deadline of a request to an
    unroutable host)."""
    port = request.getfixturevalue("silent_server") if server == "silent" else _closed_port()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef" * 2 + "01234567")  # 40 hex characters, no account
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # cli_tiny, for the CLI's class paths
    folder = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    text = CONFIG.format(root=folder).replace("project: tiny}", f"project: tiny, online_timeout: {TIMEOUT_S}}}")
    assert "online_timeout" in text
    cfg.write_text(text)
    monkeypatch.chdir(tmp_path)

    start = time.monotonic()
    code, out, err = _fit(cfg, request, monkeypatch, capsys)
    seconds = time.monotonic() - start
    assert code == 0, err[-3000:]
    # online_timeout, wandb's login (up to 10 s: two 5 s account look-ups) and a few seconds of training: about
    # 20 s. wandb's own 90 s init_timeout would take over 100 s
    assert seconds < 90

    assert wandb.run is not None and wandb.run.settings.mode == "offline"
    wandb.run.finish()  # as the process's exit would: the run's records are all written
    run = offline_run(folder)
    lines = [line for line in (out + err).splitlines() if "no online run" in line]
    shown = run.relative_to(tmp_path)  # shown relative to the working folder
    assert len(lines) == 1, lines
    assert re.fullmatch(
        re.escape(f"wandb: no online run at http://127.0.0.1:{port} (")
        + r"CommError: [^\n]+"
        + re.escape(f"): logging offline to {shown}; upload it later with: wandb sync {shown}"),
        lines[0],
    ), lines[0]
    assert run.name.endswith("-" + (folder / "wandb-id").read_text().strip())  # the same run id, in its folder

    # Every training loss logged in metrics.csv is in the offline run, at the same step, and so is val/acc.
    with open(folder / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    logged = history(run)
    for key in ("train/loss", "val/acc"):
        csv_values = {int(r["step"]): float(r[key]) for r in rows if r.get(key)}
        wandb_values = {int(r["trainer/global_step"]): r[key] for r in logged if key in r}
        assert csv_values and wandb_values.keys() == csv_values.keys(), key
        assert all(math.isclose(wandb_values[s], v, rel_tol=1e-6) for s, v in csv_values.items()), key


def _run_record(run_dir: Path) -> dict:
    """The run record of an offline run (its name, group and tags), read by ``wandb leet inspect``."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return next(r["run"] for r in records if r["type"] == "run")


# A fit with an offline wandb run and its service process; test_the_wandb_identity_of_a_segmentation_run checks the
# same identity by default.
@pytest.mark.slow
def test_a_fit_names_groups_and_tags_its_run(tmp_path, request, monkeypatch, capsys):
    """``python -m mabn fit`` (in this process, wandb offline) with the stage and dataset a stage launch passes:
    the run is ``<stage>-<norm>-<run folder name>``, grouped and tagged by stage, norm and dataset (the tiny
    task has no decoder), and tags given in the config are kept."""
    from mabn.__main__ import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # cli_tiny, for the CLI's class paths
    folder = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(root=folder).replace("project: tiny}", "project: tiny, tags: [mine]}"))
    monkeypatch.chdir(tmp_path)
    wandb_session(request, monkeypatch, "offline")
    args = ["fit", "--config", str(cfg), "--trainer.max_epochs", "1"]
    args += ["--trainer.logger.init_args.stage", "cityscapes", "--trainer.logger.init_args.dataset", "tiny"]
    assert main(args) in (0, None), capsys.readouterr().err[-3000:]
    wandb.run.finish()

    run = _run_record(offline_run(folder))
    assert run["display_name"] == "cityscapes-bn-run"
    assert run["run_group"] == "cityscapes-bn-tiny"
    assert run["tags"] == ["stage:cityscapes", "norm:bn", "data:tiny", "mine"]


def _identity(logger) -> dict:
    """The name, group and tags the logger's run starts with: wandb's record of a run disabled by WANDB_MODE."""
    run = logger.experiment
    identity = {"name": run.name, "group": run.group, "tags": list(run.tags) or None}
    run.finish()  # the next logger starts a run of its own
    return identity


def test_the_wandb_identity_of_a_segmentation_run(tmp_path, request, monkeypatch):
    """A stage-2 run's name, group and tags from the stage launch's configuration as parsed (the norm and decoder
    from the task's arguments, the dataset from the data's folder); a name or group given wins."""
    from mabn.cli import launch
    from mabn.cli.config import name_wandb_runs
    from mabn.cli.lightning import run_cli
    from mabn.run.loggers import WandbLogger

    wandb_session(request, monkeypatch, "disabled")
    monkeypatch.chdir(tmp_path)
    args = launch.build_args("cityscapes", None, "mabn", 0, 1, [], dry_run=True)
    config = run_cli([*args, "--trainer.logger.init_args.dataset", "null"], dry_run=True).config
    (folder := tmp_path / "runs" / "cityscapes" / "mabn").mkdir(parents=True)
    for entry in config.trainer.logger:
        entry.init_args.save_dir = str(folder)
    name_wandb_runs(config)
    wandb_args = [e.init_args for e in config.trainer.logger if e.class_path == "mabn.run.loggers.WandbLogger"]
    assert [(a.norm, a.decoder, a.dataset) for a in wandb_args] == [("mabn", "pspnet", "demo-cityscapes")]
    assert _identity(WandbLogger(**dict(wandb_args[0]))) == {
        "name": "cityscapes-mabn-mabn",
        "group": "cityscapes-mabn-pspnet-demo-cityscapes",
        "tags": ["stage:cityscapes", "norm:mabn", "decoder:pspnet", "data:demo-cityscapes"],
    }
    named = WandbLogger(save_dir=str(tmp_path / "x"), name="mine", group="g", norm="mabn", decoder="pspnet")
    assert _identity(named) == {"name": "mine", "group": "g", "tags": ["norm:mabn", "decoder:pspnet"]}


def test_the_stage_launch_passes_stage_and_dataset_to_the_wandb_logger(tmp_path, monkeypatch):
    from mabn.cli import launch
    from mabn.cli.lightning import run_cli

    monkeypatch.chdir(tmp_path)
    args = launch.build_args("cityscapes", None, "mabn", 0, 1, [], dry_run=True)
    loggers = run_cli(args, dry_run=True).config.trainer.logger
    wandb_args = [lg.init_args for lg in loggers if lg.class_path == "mabn.run.loggers.WandbLogger"]
    assert [(a.stage, a.dataset) for a in wandb_args] == [("cityscapes", "demo-cityscapes")]
    assert all("stage" not in lg.init_args for lg in loggers if lg.class_path != "mabn.run.loggers.WandbLogger")
