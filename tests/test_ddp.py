"""Several devices: MABN/BRN under DDP (2 CPU processes over gloo), exact resume, launching.

- sync_stats: two processes normalize as one batch (layers against a single process; a DDP fit against a
  single-process fit on both shards at once);
- per-device statistics (the default): parameters agree, streams differ, validation and checkpoints use the
  devices' mean EMA, every device's streams are checkpointed and a resume continues each one bit-identically;
- launching: trainer presets, syncbn refusals, and the SLURM script's dry run for 2 nodes x 8 GPUs.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Subset

from helpers.ddp_layers import (
    AGREE_FLAGS,
    STEPS,
    WORLD,
    B,
    G,
    agree_worker,
    layer_data,
    layer_worker,
    make_layer,
    run_layer,
)
from helpers.ddp_task import Tiny, tiny_dataset
from helpers.trainer import BARE, QUIET
from mabn import MABN2d, convert_norm
from mabn.callbacks import SyncBatchNormCheck, norm_callbacks
from mabn.callbacks.streams import STREAMS_KEY, PerDeviceStreams, configure_ddp
from mabn.run import RandomStateCallback
from mabn.run.rng import RNG_KEY, collect_rng_states

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def launch():
    """mabn.cli.launch, imported by the tests that use it: it pulls in the whole CLI (data, models), which the
    processes DDP spawns from this module would import for nothing."""
    from mabn.cli import launch

    return launch


@pytest.fixture(autouse=True)
def _fresh_port(monkeypatch):
    """Lightning's spawn launcher leaves MASTER_PORT in this process's environment and every later DDP fit
    reuses it; a port the previous process group has not released yet aborts the new one. Each test gets a
    free port of its own, and the environment is restored after it."""
    from lightning_fabric.plugins.environments.lightning import find_free_network_port

    monkeypatch.setenv("MASTER_PORT", str(find_free_network_port()))


@pytest.mark.slow  # two spawned processes, each importing torch: ~5 s of CPU
def test_agree_combines_host_flags_over_a_gloo_group_beside_an_nccl_default_group(tmp_path):
    """LastCheckpoint's per-batch agreement never goes through the device: under a default group that is NCCL (a GPU
    run's), the flags are a CPU tensor all-reduced over a gloo group of the same processes, made once; every rank
    gets each flag set on any rank. The process lets go of that group at its exit while Python is whole: freed as
    the interpreter tears down, a gloo group's pending work can abort the process after a successful run."""
    mp.spawn(agree_worker, args=(str(tmp_path),), nprocs=WORLD)
    expected = [any(flags) for flags in zip(*AGREE_FLAGS)]
    for r in range(WORLD):
        saved = torch.load(tmp_path / f"agree{r}.pt")
        assert saved["results"] == [expected, expected]
        assert saved["seen"] == [("cpu", "gloo"), ("cpu", "gloo")]
        assert saved["held"] == [True, False]


# ----------------------------------------------------------------------------------- layers, synced
def _as_one_batch(t: torch.Tensor) -> torch.Tensor:
    """(devices, G * B, ...) -> (G * devices * B, ...): group k of device 0, then group k of device 1, ..."""
    return t.reshape(WORLD, G, B, *t.shape[2:]).transpose(0, 1).reshape(G * WORLD * B, *t.shape[2:])


@pytest.mark.slow  # two DDP processes
def test_sync_stats_normalizes_two_devices_as_one_batch(tmp_path):
    """Ghost group k of both devices is one normalization batch: output, input gradient, the devices'
    summed affine gradients and every buffer equal one process normalizing the joined groups (float64)."""
    mp.spawn(layer_worker, args=(str(tmp_path),), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    xs, gs = layer_data()
    position = _as_one_batch(torch.arange(WORLD * G * B).view(WORLD, G * B))  # sample of the joined batch
    for kind in ("mabn", "brn"):
        ref = run_layer(
            make_layer(kind, WORLD * B, False), [_as_one_batch(x) for x in xs], [_as_one_batch(g) for g in gs]
        )
        for t in range(STEPS):
            for r in range(WORLD):
                rows = [int((position == r * G * B + i).nonzero()) for i in range(G * B)]
                for key in ("out", "grad_x"):
                    torch.testing.assert_close(ranks[r][kind][key][t], ref[key][t][rows], rtol=1e-10, atol=1e-12)
            for key in ("grad_w", "grad_b"):
                torch.testing.assert_close(sum(ranks[r][kind][key][t] for r in range(WORLD)), ref[key][t])
        for name, value in ref["state"].items():
            assert torch.equal(ranks[0][kind]["state"][name], ranks[1][kind]["state"][name]), (kind, name)
            torch.testing.assert_close(ranks[0][kind]["state"][name], value, rtol=1e-10, atol=1e-12)
    assert int(ranks[0]["mabn"]["state"]["count_x2"]) == STEPS * G  # one stream entry per joined group


def test_sync_stats_without_a_process_group_changes_nothing():
    xs, gs = layer_data()
    for kind in ("mabn", "brn"):
        plain = run_layer(make_layer(kind, B, False), [x[0] for x in xs], [g[0] for g in gs])
        synced = run_layer(make_layer(kind, B, True), [x[0] for x in xs], [g[0] for g in gs])
        for key in ("out", "grad_x", "grad_w"):
            assert all(torch.equal(a, b) for a, b in zip(plain[key], synced[key])), (kind, key)


def test_sync_stats_reaches_the_layers_through_convert_norm():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    assert all(m.sync_stats for m in convert_norm(model, "mabn", sync_stats=True).modules() if isinstance(m, MABN2d))
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    assert convert_norm(model, "brn", sync_stats=True)[1].sync_stats
    with pytest.raises(TypeError, match="sync_stats"):  # plain BN has no such option: SyncBN is NORM=syncbn
        convert_norm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), "bn", sync_stats=True)


# ------------------------------------------------------------------------------- a DDP fit on CPU
class Probe(pl.Callback):
    """Writes each device's model state at every epoch end, and the EMAs that validation runs with."""

    def __init__(self, out: Path) -> None:
        self.out = str(out)

    def on_train_epoch_end(self, trainer, pl_module):
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save(state, f"{self.out}/epoch{trainer.current_epoch}-rank{trainer.global_rank}.pt")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and not trainer.sanity_checking:
            ema = {
                k: v.clone() for k, v in pl_module.state_dict().items() if k.endswith(("running_var", "running_std"))
            }
            torch.save(ema, f"{self.out}/val{trainer.current_epoch}-rank{trainer.global_rank}.pt")


def _ddp_trainer(root: Path, **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=WORLD, strategy="ddp_spawn", logger=False, **QUIET,
                    default_root_dir=root, num_sanity_val_steps=0)  # fmt: skip
    return pl.Trainer(**{**defaults, **kwargs})


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)  # what Lightning's own loading accepts


@pytest.mark.slow
def test_per_device_statistics_mean_ema_and_exact_resume_on_two_processes(tmp_path):
    """Default (per-device) statistics under DDP on 2 CPU processes, 4 epochs of 4 steps (ghost batches of 2)."""
    train = DataLoader(tiny_dataset(32), batch_size=4, shuffle=True)  # DDP: a DistributedSampler seeded per epoch
    val = DataLoader(tiny_dataset(8, seed=1), batch_size=4)
    (tmp_path / "a").mkdir()
    saver = pl.callbacks.ModelCheckpoint(
        tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
    )
    callbacks = [Probe(tmp_path / "a"), RandomStateCallback(), saver]
    _ddp_trainer(tmp_path, max_epochs=4, callbacks=callbacks).fit(Tiny(), train, val)

    a = {(e, r): _load(tmp_path / "a" / f"epoch{e}-rank{r}.pt") for e in range(4) for r in range(WORLD)}
    params = [k for k, _ in Tiny().named_parameters()]
    for key in params:  # DDP keeps the replicas' parameters identical
        assert torch.equal(a[3, 0][key], a[3, 1][key]), key
    for key in ("model.1.running_var", "model.4.running_mean", "model.4.running_std"):
        assert not torch.equal(a[3, 0][key], a[3, 1][key]), f"{key}: per-device statistics were synchronized"
    # The oldest ring entries too: had DDP broadcast device 0's buffers before each forward, only the
    # latest step's two group entries would differ.
    assert not torch.equal(a[3, 0]["model.1.buffer_x2"][0], a[3, 1]["model.1.buffer_x2"][0])
    assert int(a[3, 0]["model.1.iters"]) == 16  # each device counted its own 16 forwards

    # Validation runs with the devices' mean EMA, on both devices.
    for epoch in range(4):
        seen = [_load(tmp_path / "a" / f"val{epoch}-rank{r}.pt") for r in range(WORLD)]
        for key in ("model.1.running_var", "model.4.running_std"):
            mean = (a[epoch, 0][key] + a[epoch, 1][key]) / 2
            assert torch.equal(seen[0][key], mean) and torch.equal(seen[1][key], mean), (epoch, key)

    # The checkpoint holds the mean EMA in its state_dict and every device's streams beside it.
    ckpt = _load(tmp_path / "ckpt" / "epoch=1-step=8.ckpt")
    for key in ("model.1.running_var", "model.1.running_psi", "model.4.running_mean", "model.4.running_std"):
        assert torch.equal(ckpt["state_dict"][key], (a[1, 0][key] + a[1, 1][key]) / 2), key
    streams = ckpt[STREAMS_KEY]
    assert streams["world_size"] == WORLD
    for r in range(WORLD):
        assert set(streams["ranks"][r]) == {k for k, _ in Tiny().named_buffers()}  # all of both norms' buffers
        for key, value in streams["ranks"][r].items():
            assert torch.equal(value, a[1, r][key]), (r, key)

    # Resumed after epoch 2 with a different init, every device ends exactly where it did uninterrupted.
    (tmp_path / "b").mkdir()
    resumed = Tiny(dropout=0.2)
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    trainer = _ddp_trainer(tmp_path, max_epochs=4, callbacks=[Probe(tmp_path / "b"), RandomStateCallback()])
    trainer.fit(resumed, train, val, ckpt_path=tmp_path / "ckpt" / "epoch=1-step=8.ckpt")
    for r in range(WORLD):
        b = _load(tmp_path / "b" / f"epoch3-rank{r}.pt")
        for key, value in a[3, r].items():
            assert torch.equal(b[key], value), (r, key)


class ShardedTiny(Tiny):
    """Tiny whose device r trains on samples r, r + 2, r + 4, ... in order (no DistributedSampler, which
    Lightning always makes shuffle for training)."""

    def train_dataloader(self):
        return DataLoader(Subset(tiny_dataset(16, torch.float64), range(self.global_rank, 16, WORLD)), batch_size=2)


@pytest.mark.slow  # two spawned processes, each importing Lightning, and a one-process fit: ~13 s
def test_sync_stats_ddp_fit_equals_one_process_on_both_shards(tmp_path):
    """sync_stats=True: the devices' buffers stay identical and match one process that trains on both
    devices' batches at once, with the sum of the two devices' losses at half the learning rate (DDP averages
    gradients, while the shared psi follows each device's own loss)."""
    kwargs = dict(sync=True, norm_batch_size=None, dropout=0.0)
    (tmp_path / "ddp").mkdir()
    trainer = _ddp_trainer(
        tmp_path, max_epochs=2, precision="64-true", use_distributed_sampler=False, callbacks=[Probe(tmp_path / "ddp")]
    )
    trainer.fit(ShardedTiny(**kwargs, lr=0.05))
    ranks = [_load(tmp_path / "ddp" / f"epoch1-rank{r}.pt") for r in range(WORLD)]
    for key, value in ranks[0].items():
        assert torch.equal(ranks[1][key], value), key  # one stream for both devices

    # One process, same 8 steps: step k of an epoch joins device 0's samples 4k, 4k + 2 and device 1's 4k + 1, 4k + 3.
    data = tiny_dataset(16, torch.float64)
    one = Tiny(**kwargs, lr=0.025).double()
    opt = one.configure_optimizers()
    for step in range(8):
        k = step % 4
        idx = [4 * k, 4 * k + 2, 4 * k + 1, 4 * k + 3]  # device 0's batch, then device 1's
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        opt.zero_grad()
        logits = one.model(x)  # one forward over both shards: one normalization batch
        (F.cross_entropy(logits[:2], y[:2]) + F.cross_entropy(logits[2:], y[2:])).backward()
        opt.step()
    for key, value in one.state_dict().items():
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-9, atol=1e-12, msg=key)


# ------------------------------------------------------------------------------------------ launching
@pytest.mark.parametrize(
    ("gpus", "nodes", "preset", "devices"),
    [(0, 1, "cpu", None), (1, 1, "gpu", "1"), (4, 1, "ddp", "4"), (8, 2, "multinode", "8")],
)
def test_gpus_and_nodes_pick_a_trainer_preset(launch, gpus, nodes, preset, devices):
    args = launch.trainer_args(gpus, nodes, cuda=True)
    assert args[:2] == ["--trainer", str(launch.CONFIGS / "trainer" / f"{preset}.yaml")]
    assert Path(args[1]).is_file()
    if devices:
        assert args[2:] == ["--trainer.devices", devices, "--trainer.num_nodes", str(nodes)]
    assert launch.trainer_args(2, 1, cuda=False)[-2:] == ["--trainer.accelerator", "cpu"]  # CPU processes
    with pytest.raises(launch.LaunchError, match="NODES=2 needs GPUS >= 1"):
        launch.trainer_args(0, 2)


def test_syncbn_is_refused_where_it_cannot_synchronize(launch):
    with pytest.raises(launch.LaunchError, match="one device"):
        launch.norm_args("syncbn", 1, 1, cuda=True)
    with pytest.raises(launch.LaunchError, match="needs GPUs"):
        launch.norm_args("syncbn", 2, 1, cuda=False)
    assert launch.norm_args("syncbn", 8, 2, cuda=True) == ["--trainer.sync_batchnorm", "true"]
    assert launch.norm_args("mabn", 1, 1, cuda=False) == []


def test_a_syncbn_model_stops_before_training_on_one_cpu_device(tmp_path):
    class SyncTiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = convert_norm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Flatten()), "syncbn")

        def configure_callbacks(self):
            return norm_callbacks(self.model, None)

        def training_step(self, batch, batch_idx):
            return self.model(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    assert isinstance(norm_callbacks(SyncTiny().model, None)[0], SyncBatchNormCheck)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, **BARE)
    with pytest.raises(ValueError, match="norm 'syncbn' synchronizes BatchNorm across devices.*1 device"):
        trainer.fit(SyncTiny(), DataLoader(tiny_dataset(4), batch_size=2))


def test_per_device_statistics_turn_off_ddp_buffer_broadcast():
    default = SimpleNamespace(strategy=DDPStrategy())
    configure_ddp(default)
    assert default.strategy._ddp_kwargs["broadcast_buffers"] is False
    explicit = SimpleNamespace(strategy=DDPStrategy(broadcast_buffers=True))
    with pytest.warns(UserWarning, match="overwrites every device's MABN/BRN statistics"):
        configure_ddp(explicit)
    assert explicit.strategy._ddp_kwargs["broadcast_buffers"] is True


@pytest.mark.slow  # bash, sbatch and the job script in a simulated allocation, each starting Python: ~9 s
def test_slurm_dry_run_for_2_nodes_x_8_gpus_agrees_with_the_trainer(tmp_path):
    """submit.sh --dry-run prints the sbatch line, then runs the job script in a simulated allocation of that
    shape: its srun line and the LightningCLI arguments must agree, checked by Lightning's SLURM rules."""
    env = {**os.environ, "GPUS": "8", "NODES": "2", "PYTHON": sys.executable}
    submit = str(ROOT / "scripts" / "slurm" / "submit.sh")
    # 16 devices: a global batch of 32 gives each one whole normalization batch of 2 (the check refuses 8 or 16)
    batch = ["--data.init_args.global_batch_size", "32"]
    command = ["bash", submit, "--dry-run", "cityscapes", "--norm", "mabn", "--", *batch, "--trainer.max_epochs", "9"]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    sbatch = shlex.split(next(line for line in lines if line.startswith("+ sbatch"))[2:])
    srun = shlex.split(next(line for line in lines if line.startswith("+ srun"))[2:])
    trainer = shlex.split(next(line for line in lines if line.startswith("python -m mabn fit")))
    assert {"--nodes=2", "--ntasks-per-node=8", "--gres=gpu:8"} <= set(sbatch)
    assert srun[srun.index("--gpus") + 1] == "8" and srun[srun.index("--nodes") + 1] == "2"
    assert "--resume" in srun and srun[srun.index("--resume") + 1] == "auto"
    assert trainer[trainer.index("--trainer.devices") + 1] == "8"
    assert trainer[trainer.index("--trainer.num_nodes") + 1] == "2"
    assert trainer[trainer.index("--trainer") + 1].endswith("configs/trainer/multinode.yaml")
    assert trainer[trainer.index("--ckpt_path") + 1] == "auto"
    assert trainer[-4:] == [*batch, "--trainer.max_epochs", "9"]  # the user's LightningCLI arguments come last
    assert "SLURMEnvironment: 2 node(s) x 8 process(es) agree with the launcher" in lines
    assert not (tmp_path / "data").exists()  # a dry run generates nothing


def test_launch_refuses_devices_that_disagree_with_the_slurm_allocation(launch, monkeypatch):
    for var, value in dict(
        SLURM_NTASKS="16", SLURM_NTASKS_PER_NODE="8", SLURM_NNODES="2", SLURM_JOB_NAME="mabn"
    ).items():
        monkeypatch.setenv(var, value)
    assert "agree" in launch.check_cluster(8, 2)
    with pytest.raises(launch.LaunchError, match="ntasks-per-node=8.*submit.sh"):
        launch.check_cluster(4, 2)


@pytest.mark.parametrize("callback", ["mabn", "rng"])
def test_checkpoint_of_another_device_count_is_left_alone_with_a_warning(callback):
    """Per-device state saved by 2 devices cannot be matched to the ranks of a 1-device run: nothing is
    restored, and the warning says what the resumed run will be."""
    torch.manual_seed(0)
    model = convert_norm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), "mabn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if callback == "mabn":
        cb, key, what = PerDeviceStreams(), STREAMS_KEY, "statistic streams of 2 devices"
        cb.setup(SimpleNamespace(strategy=None), model, "fit")
        poisoned = {k: torch.full_like(v, 7) for k, v in model.named_buffers()}
    else:
        cb, key, what = RandomStateCallback(), RNG_KEY, "random states of 2 devices"
        torch.manual_seed(123)
        poisoned = collect_rng_states()
        torch.manual_seed(0)
    saved = {"world_size": 2, "ranks": [poisoned, poisoned]}
    draws_before = torch.get_rng_state()
    with pytest.warns(UserWarning, match=f"the checkpoint holds the {what}, this run has 1"):
        cb.on_load_checkpoint(None, model, {key: saved})
    assert torch.equal(torch.get_rng_state(), draws_before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was restored from a checkpoint of another device count"
