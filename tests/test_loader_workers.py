"""Loader workers where the run gives none: the cores this process may use, shared by the node's devices, at most
8 (``mabn.data.loading.default_workers``), said in the plan's line."""

from __future__ import annotations

import os

import pytest

from helpers.own_dataset import bands, line, segment
from mabn.data.folder import FolderDataModule
from mabn.data.loading import default_workers


@pytest.fixture
def cores(monkeypatch):
    """Sets the cores this process may run on (its CPU affinity, as a SLURM job's share sets it)."""

    def take(count: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(count)), raising=False)

    return take


@pytest.mark.parametrize(("count", "devices", "workers"), [(2, 1, 2), (12, 4, 3), (32, 2, 8), (96, 1, 8), (1, 2, 0)])
def test_the_default_shares_the_cores_among_the_devices_up_to_8(cores, count, devices, workers):
    cores(count)
    assert default_workers(devices) == workers


def test_the_plan_says_the_workers_and_where_they_come_from(tmp_path, capsys, cores):
    cores(6)
    data = bands(tmp_path / "data", train=8)
    code, out, err = segment(data, tmp_path / "run", capsys, "--data.init_args.global_batch_size", "8")
    assert code == 0, err
    assert line(out, "loader workers:") == (
        "loader workers: 6 per device (num_workers null: 6 cores / 1 device(s), at most 8; "
        "--data.init_args.num_workers sets them)"
    )
    code, out, err = segment(data, tmp_path / "run", capsys, "--data.init_args.global_batch_size", "8",
                             "--data.init_args.num_workers", "3")  # fmt: skip
    assert code == 0, err
    assert line(out, "loader workers:") == "loader workers: 3 per device (num_workers as given)"


def test_a_data_module_without_num_workers_loads_with_the_default(tmp_path, cores):
    cores(3)
    module = FolderDataModule(str(bands(tmp_path / "data", train=8)), crop_size=32)
    module.setup("fit")
    assert module.train_dataloader().num_workers == 3
    assert FolderDataModule(str(tmp_path / "data"), crop_size=32, num_workers=0).hparams.num_workers == 0
