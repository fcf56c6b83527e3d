"""A steady-state training step never waits for the device: not in the project's code, nor in Lightning's loop, the
metrics or the loss it runs.

On a GPU every host read of a device tensor (``item``, ``bool``, ``float``, ``tolist``, ``cpu``...) and every
operator whose output's size comes from the device (``bincount``, ``nonzero``, boolean-mask indexing) waits until
the device has run everything queued before it: the host stops issuing kernels, the GPU then runs dry, and an eager
step at MABN's small per-device batches is bound by the host issuing kernels. So nothing a training step runs may
read the device; the one verdict the project needs on the host, whether a MABN2d or BatchRenorm2d layer met a
non-finite statistic, MABNCallback reads one optimizer step late from a copy in pinned host memory, which the GPU
finished long before. Lightning reads logged values every ``log_every_n_steps`` steps, and those on the progress bar
after every step: the training scalars are not on it.

The count runs on the CPU, where every tensor is a host tensor, so a read cannot be told from a device read by its
tensor: each read of any code is recorded as (file, function, operation) (``helpers.host_reads``) and the test
holds the exact set, with the late flag read as its one member. ``reads_at_once`` is patched so the CPU layers keep
their verdicts in device flags as CUDA layers do, instead of reading them at once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import mabn.norm.managed
from helpers.host_reads import HostReads
from helpers.trainer import flags
from mabn.callbacks import MABNCallback
from mabn.cli import launch
from mabn.cli import lightning as cli
from mabn.data.synthetic import cityscapes as demo_cityscapes
from mabn.data.synthetic import imagenet as demo_imagenet
from mabn.norm import MABN2d
from mabn.norm.managed import managed_norms

# The counted training batches of each stage: past the first ones, and before the fit's last step and the epoch's
# end (one epoch holds them all).
STEADY = {"pretrain": range(4, 24), "cityscapes": range(3, 8)}
# The one read allowed: MABNCallback's look, one step late, at the copy of every layer's flags in host memory.
LATE_FLAG_READ = ("norm/managed.py", "LateNonfiniteCheck.check", "tolist")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """Each stage's generated layout, one epoch longer than its counted steps: ImageNet's with 60 training images (6
    per class, 30 batches of 2), Cityscapes' with 24 training scenes (12 batches of 2)."""
    root = tmp_path_factory.mktemp("data")
    return {
        "pretrain": demo_imagenet.generate(root / "cls", n_train=6, n_val=1, size=32),
        "cityscapes": demo_cityscapes.generate(root / "cs", n_train=24, n_val=1, size=(32, 64)),
    }


# Each stage's run at the recipe's settings (the recipe's loss: stage 2's cross-entropy), shrunk: ResNet-18, small
# images, batches of one normalization pair, statistics logging off.
SHRUNK = {
    "pretrain": [
        *flags("data.init_args", batch_size=2, num_workers=0, image_size=32, val_resize=36),
        *flags("model.init_args", arch="resnet18"),
    ],
    "cityscapes": [
        *flags("data.init_args", global_batch_size=2, num_workers=0, crop_size=32),
        *flags("model.init_args", arch="resnet18", log_predictions_every_n_epochs=0),
    ],
}


@pytest.mark.slow  # traces every operator of several fit steps
@pytest.mark.parametrize("stage", ["pretrain", "cityscapes"])
def test_steady_state_steps_read_only_the_late_flag_copy(stage, datasets, tmp_path, monkeypatch):
    """A fit as ``python -m mabn <stage>`` builds it (its task, ResNet-18 with MABN2d, the CLI's guards, loggers and
    progress lines, MABNCallback), run by Lightning's loop: in the steady-state steps the host reads once a step, the
    project's late flag copy, and nothing else: not Lightning's loop, not the metrics, not the loss."""
    monkeypatch.chdir(tmp_path)
    # The CPU layers act as CUDA ones: their verdicts go to the device flags, not to an immediate read.
    monkeypatch.setattr(mabn.norm.managed, "reads_at_once", lambda device: False)
    steady = STEADY[stage]
    extra = [
        *flags("trainer", max_steps=steady.stop + 2, limit_val_batches=0, num_sanity_val_steps=0),
        *flags("trainer", enable_model_summary=False),
        *SHRUNK[stage],
        *flags("model.init_args.norm_policy", log_every_n_steps=0),
        # The progress lines read the mean loss at their own cadence, about 20 a run by default, which this short
        # run would put at every step: here every 50 steps, past the counted ones, as a run of the recipe's length.
        *("--trainer.callbacks+", '{"class_path": "mabn.run.LineProgress", "init_args": {"every_n_steps": 50}}'),
    ]
    backbone = {"backbone": "none"} if stage == "cityscapes" else {}  # stage 2 from random weights
    args = launch.build_args(stage, datasets[stage], "mabn", gpus=0, nodes=1, extra=extra, **backbone)
    built = cli.run_cli(args[1:], run=False)  # without "fit": the CLI's task, data and trainer, fitted below
    recorder = HostReads()
    built.trainer.callbacks.insert(0, recorder)
    recorder.install(monkeypatch)
    with recorder.recording():
        built.trainer.fit(built.model, built.datamodule)
    monkeypatch.undo()

    assert built.trainer.global_step == steady.stop + 2
    assert built.trainer.global_step < built.trainer.num_training_batches  # no epoch end
    assert any(isinstance(c, MABNCallback) for c in built.trainer.callbacks)
    assert any(isinstance(m, MABN2d) for m in built.model.modules())
    counted = [r for r in recorder.reads if r[0] in steady]
    found = Counter(r[1:5] for r in counted)
    listing = "\n".join(f"  {n:4d} x {file}:{line} {function} {op}" for (file, function, line, op), n in found.items())
    print(f"host reads in {len(steady)} steady-state steps: {len(counted)}\n{listing}")
    assert Counter((file, function, op) for _, file, function, _, op, _ in counted) == {LATE_FLAG_READ: len(steady)}, (
        f"host reads in {len(steady)} steady-state steps:\n{listing}"
    )
    # What it reads is the copy, never a layer's flags themselves (on CUDA: pinned host memory, not the device).
    cpu = torch.device("cpu")
    layer_flags = {m.nonfinite_flags(cpu).untyped_storage().data_ptr() for m in managed_norms(built.model).values()}
    assert not layer_flags & {storage for *_, storage in counted}
