"""Several devices when something goes wrong (2 CPU processes over gloo):

- one process raises: every process ends within a minute, each naming that error, also when the failing
  process itself does not exit;
- SLURM's requeue signal reaching the processes at different steps: one checkpoint, saved by all of them at
  one agreed step, no collective inside the signal handler, one requeue by rank 0;
- validation over an odd split on 2 processes counts every sample once: the metrics equal 1 process's.

The multi-process runs start their processes as srun or torchrun would (``python this_file SCENARIO ROOT``
per rank, the rank in the environment), so no Lightning launcher watches them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments.lightning import find_free_network_port
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

import mabn.run.requeue as requeue_module
from helpers.ddp_task import Tiny, tiny_dataset
from helpers.trainer import BARE, QUIET
from mabn.callbacks.streams import STREAMS_KEY
from mabn.cli.lightning import run_cli
from mabn.data.loading import make_loader
from mabn.run import FailFast, LastCheckpoint, RandomStateCallback
from mabn.run.failfast import one_line
from mabn.run.requeue import TERMINATED_EXIT, requeue, slurm_job_id
from mabn.run.rng import RNG_KEY
from mabn.tasks import ClassificationTask
from mabn.tasks.metrics import SegmentationMetric

WORLD = 2
FAIL_AT_STEP = 3
ERROR = "corrupt image val/17.png"
JOB_ID = "4242"


# ------------------------------------------------------------------- the processes the tests start
def _trainer(root: Path, callbacks: list[pl.Callback], max_steps: int) -> pl.Trainer:
    bare = BARE
    if any(isinstance(c, LastCheckpoint) for c in callbacks):  # a Checkpoint callback: checkpointing on, no top-k
        bare = {**BARE, "enable_checkpointing": True}
        callbacks = [ModelCheckpoint(dirpath=root / "checkpoints", save_top_k=0), *callbacks]
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=max_steps, **bare,
                      default_root_dir=root, callbacks=callbacks)  # fmt: skip


def _train_loader() -> DataLoader:
    return DataLoader(tiny_dataset(32), batch_size=4)  # 4 batches per process and epoch


class RaiseOnRank1(pl.Callback):
    """Rank 1 raises at step FAIL_AT_STEP as a corrupt image would; with ``hang``, its process never exits
    by itself afterwards (as a stuck DataLoader worker or an NCCL teardown can make it)."""

    def __init__(self, hang: bool) -> None:
        self.hang = hang

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == FAIL_AT_STEP:
            if self.hang:
                import atexit

                atexit.register(time.sleep, 600)
            raise ValueError(f"{ERROR}\n(second line of the message)")


class KillRank0(pl.Callback):
    """At step FAIL_AT_STEP rank 0 is killed (as the kernel's out-of-memory killer would) while rank 1 is
    busy for 40 s outside any collective, so only the store can tell it."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == FAIL_AT_STEP:
            if trainer.global_rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(40)


class SignalProbe(pl.Callback):
    """Sends this process ``signum`` (SIGUSR1) at the start of batch ``at[rank]``, records every collective called
    while its handler runs and the global step of every checkpoint this process takes part in."""

    COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")

    def __init__(self, root: Path, at: tuple[int, int], signum: int = signal.SIGUSR1) -> None:
        self.root, self.at, self.signum = root, at, signum
        self.in_handler = False
        self.in_handler_calls: list[str] = []
        self.saved_at: list[int] = []

    def on_train_start(self, trainer, pl_module):
        for name in self.COLLECTIVES:
            setattr(dist, name, self._watched(name, getattr(dist, name)))
        installed = signal.getsignal(self.signum)

        def handler(signum, frame):
            self.in_handler = True
            try:
                installed(signum, frame)
            finally:
                self.in_handler = False

        signal.signal(self.signum, handler)

    def _watched(self, name, collective):
        def call(*args, **kwargs):
            if self.in_handler:
                self.in_handler_calls.append(name)
            return collective(*args, **kwargs)

        return call

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at[trainer.global_rank]:
            os.kill(os.getpid(), self.signum)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved_at.append(trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        record = {"in_handler": self.in_handler_calls, "saved_at": self.saved_at}
        (self.root / f"probe-rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_exception(self, trainer, pl_module, exception):  # SIGTERM's exit
        self.on_train_end(trainer, pl_module)


class HoldAt(pl.Callback):
    """At the end of step ``step`` each rank touches ``holding-rank<r>`` and waits for the file ``release``."""

    def __init__(self, root: Path, step: int) -> None:
        self.root, self.step = root, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        (self.root / f"holding-rank{trainer.global_rank}").touch()
        deadline = time.monotonic() + 60
        while not (self.root / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def _worker(scenario: str, root: Path) -> None:
    if scenario == "sigusr1":
        log = root / "requeue.log"
        command = [sys.executable, "-c", f"import sys; open({str(log)!r}, 'a').write(sys.argv[1] + '\\n')"]
        probe = SignalProbe(root, at=(3, 1))  # rank 1 first, at batch 1; rank 0 at batch 3
        callbacks = [LastCheckpoint(requeue_command=command), RandomStateCallback(), probe]
        _trainer(root, callbacks, max_steps=4).fit(Tiny(), _train_loader())
    elif scenario == "sigterm":
        probe = SignalProbe(root, at=(3, 1), signum=signal.SIGTERM)  # rank 1 at batch 1; rank 0 would at batch 3
        callbacks = [LastCheckpoint(requeue_command=["false"]), RandomStateCallback(), probe]
        _trainer(root, callbacks, max_steps=4).fit(Tiny(), _train_loader())
    elif scenario == "sigterm-group":  # loader workers; held after step 2 until the test has signalled the group
        callbacks = [LastCheckpoint(), RandomStateCallback(), HoldAt(root, 2), SignalProbe(root, at=(-1, -1))]
        loader = make_loader(tiny_dataset(32), 4, train=True, num_workers=2)
        _trainer(root, callbacks, max_steps=6).fit(Tiny(), loader)
    elif scenario == "rank0-killed":
        _trainer(root, [FailFast(grace_s=5), KillRank0()], max_steps=8).fit(Tiny(), _train_loader())
    elif scenario == "validate":
        trainer = _trainer(root, [], max_steps=1)
        results = {"seg": trainer.validate(TinySegmenter(str(root)), verbose=False)[0],
                   "cls": trainer.validate(TinyClassifier(), verbose=False)[0]}  # fmt: skip
        (root / f"validated-rank{trainer.global_rank}.json").write_text(json.dumps(results))
    else:
        callbacks = [FailFast(), RandomStateCallback(), RaiseOnRank1(hang=scenario == "raise-and-hang")]
        _trainer(root, callbacks, max_steps=8).fit(Tiny(), _train_loader())


def _run_ranks(scenario: str, root: Path, env: dict[str, str]) -> list[tuple[int, float, str]]:
    """Starts one process per rank; (exit code, seconds to exit, output) of each, within 90 s."""
    port = str(find_free_network_port())
    tests = str(Path(__file__).parent)
    base = {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    start = time.monotonic()
    procs = []
    for r in range(WORLD):
        rank_env = {**base, **{k: v.format(rank=r) for k, v in env.items()}}
        out = open(root / f"out-rank{r}.txt", "w")
        command = [sys.executable, __file__, scenario, str(root)]
        procs.append((subprocess.Popen(command, env=rank_env, stdout=out, stderr=subprocess.STDOUT), out))
    results = []
    for r, (proc, out) in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, 90 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            pytest.fail(f"rank {r} still runs after 90 s")
        finally:
            out.close()
        results.append((proc.returncode, time.monotonic() - start, (root / f"out-rank{r}.txt").read_text()))
    return results


TORCHRUN_LIKE = {"LOCAL_RANK": "{rank}", "NODE_RANK": "0", "WORLD_SIZE": str(WORLD)}
SLURM_LIKE = {"SLURM_NTASKS": str(WORLD), "SLURM_NTASKS_PER_NODE": str(WORLD), "SLURM_NNODES": "1",
              "SLURM_JOB_NAME": "mabn-test", "SLURM_JOB_ID": JOB_ID, "SLURM_PROCID": "{rank}",
              "SLURM_LOCALID": "{rank}", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1"}  # fmt: skip


# ------------------------------------------------------------------------------ one process raises
@pytest.mark.slow  # two processes started as torchrun would, each importing the CLI: 15 s and more
@pytest.mark.parametrize("scenario", ["raise", "raise-and-hang"])
def test_when_rank_1_raises_every_rank_ends_within_a_minute_naming_the_error(tmp_path, scenario):
    """Rank 1 raises at step 3. Rank 0, blocked in that step's gradient all-reduce, ends with the error
    named ("rank 1 failed: ValueError: ..."), not gloo's "Connection closed by peer", and within a minute
    even when rank 1 never exits by itself (then gloo alone would keep rank 0 waiting for 30 minutes)."""
    results = _run_ranks(scenario, tmp_path, TORCHRUN_LIKE)
    named = f"rank 1 failed: ValueError: {ERROR}"
    for r, (code, seconds, output) in enumerate(results):
        assert code != 0, (r, output[-2000:])
        assert seconds < 60, f"rank {r} took {seconds:.0f} s to end"
    assert f"ValueError: {ERROR}" in results[1][2]
    assert f"[rank 0] {named}: stopping" in results[0][2]  # said as soon as rank 0 learns it
    if scenario == "raise":  # gloo fails rank 0's all-reduce: its own error, its traceback's last line, says why
        assert f"RuntimeError: {named} (rank 0 then stopped with" in results[0][2], results[0][2][-2000:]
    else:  # nothing fails rank 0's all-reduce, nor ends rank 1: both are ended after the grace period
        for r in range(WORLD):
            assert f"[rank {r}] {named}: ending this process" in results[r][2], (r, results[r][2][-2000:])


@pytest.mark.slow
def test_when_rank_0_is_killed_the_others_end_after_the_grace(tmp_path):
    """Rank 0 dies without a word and takes the store with it; rank 1, busy outside any collective for 40 s,
    is ended within the 5 s grace after noticing, saying why."""
    (code0, seconds0, _), (code1, seconds1, output1) = _run_ranks("rank0-killed", tmp_path, TORCHRUN_LIKE)
    assert code0 == -signal.SIGKILL and code1 == 1, output1[-2000:]
    assert seconds1 - seconds0 < 15, f"rank 1 ended {seconds1 - seconds0:.0f} s after rank 0"
    assert "[rank 1] rank 0 is gone (the process group's store does not answer): ending this process" in output1


def test_one_line_keeps_the_type_and_the_first_line():
    assert one_line(ValueError("\n  bad pixel  \nTraceback ...")) == "ValueError: bad pixel"
    assert one_line(KeyError()) == "KeyError"
    from_worker = "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback:\n  ...\nValueError: bad pixel"
    assert one_line(ValueError(from_worker)) == "ValueError: bad pixel"


CLI_CONFIG = """
trainer:
  max_epochs: 4
  logger: false
  enable_progress_bar: false
  callbacks:
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {save_last: true, every_n_epochs: 1, save_on_train_epoch_end: true}
model:
  class_path: helpers.cli_tiny.TinyTask
data:
  class_path: helpers.cli_tiny.TinyData
"""


def test_the_cli_guards_every_trainer_once(tmp_path):
    """Every trainer the CLI builds gets the guards; one the user configured is not added twice."""
    (tmp_path / "cfg.yaml").write_text(CLI_CONFIG)
    mine = ["{class_path: mabn.run.FailFast, init_args: {grace_s: 5}}",
            "{class_path: mabn.run.LastCheckpoint, init_args: {every_minutes: 10}}"]  # fmt: skip
    args = ["--config", str(tmp_path / "cfg.yaml")] + [a for m in mine for a in ("--trainer.callbacks+", m)]
    trainer = run_cli(args, run=False).trainer
    kinds = [type(c) for c in trainer.callbacks]
    assert kinds.count(FailFast) == kinds.count(LastCheckpoint) == kinds.count(RandomStateCallback) == 1
    assert next(c for c in trainer.callbacks if isinstance(c, FailFast)).grace_s == 5
    assert next(c for c in trainer.callbacks if isinstance(c, LastCheckpoint)).every_minutes == 10
    # last.ckpt is LastCheckpoint's alone: ModelCheckpoint's save_last would write last-v1.ckpt beside it
    assert not next(c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)).save_last


def _agreed_checkpoints(tmp_path: Path, steps: list[int], last_step: int) -> None:
    """Both ranks saved at each of ``steps`` during the fit (the probe writes its record as the fit ends, before
    LastCheckpoint's final save), never inside a signal handler, into ``checkpoints/last.ckpt``, which holds
    every device's random states and norm streams at ``last_step``."""
    probes = [json.loads((tmp_path / f"probe-rank{r}.json").read_text()) for r in range(WORLD)]
    for r, probe in enumerate(probes):
        assert probe == {"in_handler": [], "saved_at": steps}, r
    assert sorted(p.name for p in tmp_path.rglob("*.ckpt")) == ["last.ckpt"]
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == last_step
    for key in (RNG_KEY, STREAMS_KEY):
        assert ckpt[key]["world_size"] == WORLD and len(ckpt[key]["ranks"]) == WORLD, key


# --------------------------------------------------------------------------- SLURM's requeue signal
@pytest.mark.slow  # two processes started as srun would, each importing the CLI: ~15 s
def test_requeue_signal_saves_one_checkpoint_at_an_agreed_step_without_collectives_in_the_handler(tmp_path):
    """SIGUSR1 reaches rank 1 at batch 1 and rank 0 at batch 3. The processes agree at the end of every batch:
    both take part in the checkpoint at the end of batch 1 (global step 2), which holds both devices' random
    states and norm streams; the handlers call no collective; rank 0 requeues the job once; the fit goes on to
    its end at step 4, saved too."""
    results = _run_ranks("sigusr1", tmp_path, SLURM_LIKE)
    for r, (code, _, output) in enumerate(results):
        assert code == 0, (r, output[-3000:])
    _agreed_checkpoints(tmp_path, [2], last_step=4)
    assert (tmp_path / "requeue.log").read_text() == f"{JOB_ID}\n"


@pytest.mark.slow  # two processes started as srun would, each importing the CLI: ~15 s
def test_sigterm_saves_one_checkpoint_at_the_next_batch_without_collectives_in_the_handler(tmp_path):
    """SIGTERM reaches rank 1 at the start of batch 1 only (as a plain ``kill`` of one process). Both processes
    agree at the end of that batch: both take part in one checkpoint at global step 2 holding both devices' random
    states and norm streams, Lightning's broadcast never runs in the handler, nothing is requeued, and both exit
    with status 143."""
    results = _run_ranks("sigterm", tmp_path, SLURM_LIKE)
    for r, (code, _, output) in enumerate(results):
        assert code == TERMINATED_EXIT, (r, output[-3000:])
    assert "SIGTERM: checkpoint saved at step 2 in " in results[0][2]
    _agreed_checkpoints(tmp_path, [2], last_step=2)


@pytest.mark.slow  # two processes with two loader workers each, as srun starts them: ~20 s
def test_sigterm_to_the_whole_job_with_loader_workers_saves_at_an_agreed_step_and_exits_143(tmp_path):
    """As SLURM ends a job: SIGTERM to every process of one process group, both ranks and their four loader
    workers, while the ranks hold at the end of step 2 (before LastCheckpoint's hook, which runs last). Both
    agree at the end of that step, save ``last.ckpt`` there with both devices' states, and exit 143 without a
    traceback; rank 0 says so in one line."""
    port = str(find_free_network_port())
    base = {**os.environ, **SLURM_LIKE, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    procs, group = [], 0
    for r in range(WORLD):
        env = {**base, **{k: v.format(rank=r) for k, v in SLURM_LIKE.items()}}
        out = open(tmp_path / f"out-rank{r}.txt", "w")
        group_args = {"process_group": group}  # rank 0 opens a group (0: its own pid), rank 1 joins it
        proc = subprocess.Popen([sys.executable, __file__, "sigterm-group", str(tmp_path)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, **group_args)  # fmt: skip
        group = group or proc.pid
        procs.append((proc, out))
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"holding-rank{r}").exists() for r in range(WORLD)):
            assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), "the ranks did not hold"
            time.sleep(0.1)
        os.killpg(group, signal.SIGTERM)  # the ranks and their loader workers
        time.sleep(0.5)
        (tmp_path / "release").touch()
        codes = [proc.wait(timeout=90) for proc, _ in procs]
    finally:
        (tmp_path / "release").touch()
        for proc, out in procs:
            proc.kill()
            out.close()
    outputs = [(tmp_path / f"out-rank{r}.txt").read_text() for r in range(WORLD)]
    for r in range(WORLD):
        assert codes[r] == TERMINATED_EXIT, (r, outputs[r][-3000:])
        assert "Traceback" not in outputs[r], (r, outputs[r][-3000:])
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert [line for line in outputs[0].splitlines() if line.startswith("SIGTERM")] == [
        f"SIGTERM: checkpoint saved at step 2 in {last}; the run stops here, and --resume auto goes on from it"
    ]
    _agreed_checkpoints(tmp_path, [2], last_step=2)


@pytest.mark.parametrize("job", ["42; echo pwned", "42\n", "42 43", "$(id)", "", "_42"])
def test_a_job_id_that_is_not_only_digits_underscores_and_dashes_is_refused(monkeypatch, job):
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    with pytest.raises(ValueError, match="is not a job id"):
        slurm_job_id()


def test_job_ids_of_jobs_and_array_tasks_pass(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert slurm_job_id() == "4242"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    assert slurm_job_id() == "4240_7"


def test_a_requeue_command_not_on_path_is_one_log_line_and_no_shell(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(requeue_module.subprocess, "call", lambda *a, **k: calls.append((a, k)) or 0)
    with caplog.at_level("ERROR", logger=requeue_module.log.name):
        requeue(["no-such-scontrol-here", "requeue"], "4242")
    assert calls == []
    assert caplog.messages == [
        "Cannot requeue SLURM job 4242: 'no-such-scontrol-here' is not on PATH; the checkpoint is saved, "
        "requeue the job by hand (scontrol requeue) or resubmit it"
    ]


# ------------------------------------------------------------------------------ validation, unpadded
N_VAL, CLASSES = 7, 3  # 7 samples: 4 on rank 0, 3 on rank 1


def _sample(i: int, target_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, 4, generator=gen), torch.randint(0, CLASSES, target_shape, generator=gen)


class LabelMaps(Dataset):
    """Sample i: an image, its label map, and i (to see which process read it)."""

    def __len__(self) -> int:
        return N_VAL

    def __getitem__(self, i: int):
        return (*_sample(i, (4, 4)), i)


class Labels(Dataset):
    """Sample i: an image and its class."""

    def __len__(self) -> int:
        return N_VAL

    def __getitem__(self, i: int):
        return _sample(i, ())


class TinySegmenter(pl.LightningModule):
    """A 1x1 conv scored as SegmentationTask scores: a dataset-level confusion matrix synced at epoch end."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, CLASSES, 1)
        self.metric = SegmentationMetric(CLASSES)
        self.seen: list[int] = []

    def val_dataloader(self) -> DataLoader:
        return make_loader(LabelMaps(), batch_size=2, train=False, num_workers=0)

    def validation_step(self, batch, batch_idx):
        images, labels, index = batch
        self.seen += index.tolist()
        self.metric.update(self.conv(images).argmax(1), labels)

    def on_validation_epoch_end(self):
        self.log("val/miou", self.metric.compute()["miou"].float())
        Path(self.out, f"seen-rank{self.global_rank}.json").write_text(json.dumps(self.seen))


class TinyClassifier(ClassificationTask):
    """ClassificationTask's validation (loss, top-1, top-5) around a linear layer."""

    def __init__(self) -> None:
        super().__init__(num_classes=CLASSES, export_dir=None)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(48, CLASSES))

    def val_dataloader(self) -> DataLoader:
        return make_loader(Labels(), batch_size=2, train=False, num_workers=0)


def _validate(model: pl.LightningModule) -> dict[str, float]:
    """The metrics of one process's validation."""
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET).validate(model, verbose=False)[0]


@pytest.fixture(scope="session")
def two_processes(tmp_path_factory) -> tuple[Path, dict[str, dict[str, float]]]:
    """(folder, metrics) of TinySegmenter's and TinyClassifier's validations by 2 processes (started as torchrun
    would, one trainer validating both): each process's metrics by ``seg`` and ``cls``, rank 0's."""
    root = tmp_path_factory.mktemp("validate")
    for r, (code, _, output) in enumerate(_run_ranks("validate", root, TORCHRUN_LIKE)):
        assert code == 0, (r, output[-3000:])
    ranks = [json.loads((root / f"validated-rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0] == ranks[1]  # the synced metrics, the same on both processes
    return root, ranks[0]


@pytest.mark.slow  # two_processes: two processes started as torchrun would, each importing the CLI: ~11 s
def test_validation_counts_each_sample_of_an_odd_split_once_on_two_processes(two_processes, tmp_path):
    """The 2 processes read samples 0, 2, 4, 6 and 1, 3, 5 (none repeated to fill rank 1's last batch), and
    their mIoU equals 1 process's over the 7 samples, where Lightning's padding would score sample 0 twice."""
    root, two = two_processes
    one = _validate(TinySegmenter(str(tmp_path)))
    seen = [json.loads((root / f"seen-rank{r}.json").read_text()) for r in range(WORLD)]
    assert seen == [[0, 2, 4, 6], [1, 3, 5]]
    assert two["seg"]["val/miou"] == pytest.approx(one["val/miou"], abs=1e-6)
    padded = SegmentationMetric(CLASSES)
    model = TinySegmenter(str(tmp_path))
    for i in [*range(N_VAL), 0]:
        image, label, _ = LabelMaps()[i]
        padded.update(model.conv(image[None]).argmax(1), label[None])
    assert padded.compute()["miou"].item() != pytest.approx(one["val/miou"], abs=1e-6)


@pytest.mark.slow  # two_processes, as above
def test_classification_validation_of_an_odd_split_on_two_processes_equals_one_process(two_processes):
    """Loss, top-1 and top-5 of ClassificationTask over 7 samples: 4 on one device, 3 on the other. The loss
    is a mean over samples, exact only when the devices' sample counts are summed, not averaged."""
    # The validation's metrics (the task also logs its step and epoch, which every logger takes as the row's)
    one = {key: value for key, value in _validate(TinyClassifier()).items() if key.startswith("val/")}
    two = {key: value for key, value in two_processes[1]["cls"].items() if key.startswith("val/")}
    assert set(one) == set(two) == {"val/loss", "val/top1", "val/top5"}
    for key, value in one.items():
        assert two[key] == pytest.approx(value, abs=1e-6), key


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
