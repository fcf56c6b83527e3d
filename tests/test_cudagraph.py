"""CUDA-graph capture of the training forward and backward (mabn.tasks.cudagraph).

On the CPU: what may be captured, the errors, and the wrapper's own logic around the capture (warm-ups leave
the buffers unchanged, which inputs replay) with a stand-in for ``torch.cuda.make_graphed_callables``; what
``cuda_graph: auto`` decides and the line it prints. With MABN_TEST_DEVICE=cuda: graphed training against eager
training, alone and under a Trainer with MABNCallback, and ``auto`` capturing on a GPU.
"""

from __future__ import annotations

import copy
import csv
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mabn.norm.mabn as mabn_module
import mabn.tasks.cudagraph as cudagraph
from helpers.marks import default_suite_runs
from helpers.precision import ScalingOnly
from helpers.trainer import quiet_trainer
from mabn import BatchRenorm2d, CenConv2d, MABN2d
from mabn.callbacks import MABNCallback, NormPolicy
from mabn.errors import ConfigError, exit_on_user_error, user_error
from mabn.models import resnet
from mabn.tasks import ClassificationTask
from mabn.tasks.base import NormTask

pytestmark = pytest.mark.gpu

# CUDA graphs have no CPU half.
needs_gpu = pytest.mark.gpu(cuda_only=True)


def small_net(norm: str = "mabn") -> nn.Sequential:
    """Every layer kind a graphed PSPNet holds: centred conv + MABN2d or BRN (ghost batches of 2, short
    timelines), BN, GN, dropout."""
    if norm == "mabn":
        first = MABN2d(8, norm_batch_size=2, buffer_size=3, warmup_iters=2, renorm_warmup_iters=4, momentum=0.9)
    else:
        first = BatchRenorm2d(8, norm_batch_size=2, r_ramp=(1, 4), d_ramp=(1, 4), momentum=0.9)
    return nn.Sequential(
        CenConv2d(3, 8, 3, padding=1, bias=False), first, nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 1), nn.GroupNorm(4, 8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
        nn.Linear(8, 3),
    )  # fmt: skip


def test_blockers_name_the_layers_that_read_the_host():
    assert cudagraph.capture_blockers(small_net("mabn")) == cudagraph.capture_blockers(small_net("brn")) == []
    net = small_net("brn")
    net[4].momentum = None
    assert cudagraph.capture_blockers(net) == ["4 (BatchNorm with momentum=None reads its batch count on the host)"]
    with pytest.raises(ValueError, match=r"not possible with these layers: 4 \(BatchNorm with momentum=None"):
        cudagraph.check_capturable(net, torch.device("cuda"))


def test_capture_needs_a_gpu():
    with pytest.raises(ValueError, match="needs the model on a GPU, got device cpu"):
        cudagraph.graph_training_forward(small_net(), torch.randn(4, 3, 6, 6))


@pytest.mark.parametrize("norm", ["mabn", "brn"])
def test_warmups_leave_buffers_and_other_inputs_run_eagerly(norm, graph_stand_in):
    net = small_net(norm)
    before = copy.deepcopy(net.state_dict())
    sample = torch.randn(4, 3, 6, 6)
    rng = torch.get_rng_state()
    cudagraph.graph_training_forward(net, sample, warmup_iters=3)
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by the capture's warm-up iterations"
    assert torch.equal(torch.get_rng_state(), rng), "the warm-ups' dropout moved the random state"

    net(torch.randn(4, 3, 6, 6))  # the captured shape, training, gradients on: replayed
    net(torch.randn(2, 3, 6, 6))  # another batch
    with torch.no_grad():
        net(torch.randn(4, 3, 6, 6))
    net.eval()
    net(torch.randn(4, 3, 6, 6))
    assert graph_stand_in.captured == graph_stand_in.replayed == [(4, 3, 6, 6)]
    # The three training forwards since the capture; not its warm-ups.
    assert int(net[1].iters if norm == "mabn" else net[1].num_batches_tracked) == 3


def test_capture_refuses_eval_mode(graph_stand_in):
    with pytest.raises(ValueError, match="training mode"):
        cudagraph.graph_training_forward(small_net().eval(), torch.randn(4, 3, 6, 6))


def test_callback_keeps_logged_layers_tracking_under_graphs():
    """A graphed model's layers run their Python forward only at capture: the callback must keep them tracking
    and keep the statistics tensors they captured, and still log only every k steps."""
    task = SimpleNamespace(cuda_graph=True)
    net = nn.Sequential(small_net())
    callback = MABNCallback(NormPolicy(log_every_n_steps=2, log_layers=["0.1"]), steps_done=True)  # a NormTask's
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(step))
    trainer = SimpleNamespace(global_step=0, loggers=[logger])
    callback.setup(trainer, net, "fit")
    layer = net[0][1]
    for step in range(4):
        trainer.global_step = step
        callback.on_train_batch_start(trainer, task, None, 0)
        assert layer.track_stats
        if step == 0:
            net(torch.randn(4, 3, 6, 6)).sum().backward()  # the capture: the only Python forward
            captured = layer.last_stats
        assert layer.last_stats is captured
        callback.on_train_batch_end(trainer, task, None, None, 0)
    assert logged == [1, 3]  # the optimizer steps done after the batches of steps 0 and 2


class GraphTask(NormTask):
    """NormTask around ``small_net`` trained by cross-entropy, its MABN2d managed by MABNCallback."""

    def __init__(self, cuda_graph: bool | str = False, norm_policy=None, compile: bool | str = False):
        super().__init__()
        self.save_hyperparameters()
        self.model = small_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.training_forward(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


POLICY = {"groups": {"all": {"prefixes": ["model."], "moving_stats_first_step": 2, "renorm_first_step": 5}},
          "log_every_n_steps": 2, "log_layers": ["model.1"]}  # fmt: skip


def _fit(
    tmp_path: Path,
    cuda_graph: bool | str,
    accelerator: str,
    steps: int = 8,
    precision: str = "32-true",
    task: GraphTask | None = None,
    accumulate: int = 1,
) -> tuple[GraphTask, list[dict]]:
    torch.manual_seed(0)
    task = task or GraphTask(cuda_graph, POLICY)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, 8, 8, generator=gen) + 0.5, torch.randint(0, 3, (64,), generator=gen))
    logger = pl.loggers.CSVLogger(tmp_path, name=f"graph{cuda_graph}")
    # Not deterministic=True: CUDA's adaptive pooling backward has no deterministic implementation.
    trainer = quiet_trainer(
        tmp_path, accelerator=accelerator, devices=1, max_steps=steps, logger=logger, log_every_n_steps=50,
        deterministic=False, precision=precision, accumulate_grad_batches=accumulate,
    )  # fmt: skip
    trainer.fit(task, DataLoader(data, batch_size=4, drop_last=True))
    rows = [r for r in csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")) if r.get("norm/model.1/chi2_batch")]
    return task, rows


def _flags_set(model: nn.Module) -> list[str]:
    return [
        name for name, m in model.named_modules() if isinstance(m, (MABN2d, BatchRenorm2d)) and bool(m._flags.any())
    ]


def test_graphed_fit_on_cpu_captures_once_and_trains_as_eagerly(tmp_path, graph_stand_in):
    """The Trainer plumbing with the stand-in capture: one capture, at the first training batch, whose warm-ups
    backpropagate NaN gradients (torch's uninitialised ones) through MABN2d; they leave no trace, neither in the
    buffers nor in the non-finite flags, so training ends exactly where eager training does."""
    (eager, eager_rows), (graphed, graphed_rows) = (_fit(tmp_path, g, "cpu") for g in (False, True))
    assert graph_stand_in.captured == [(4, 3, 8, 8)] and graph_stand_in.replayed == [(4, 3, 8, 8)] * 8
    assert graphed_rows == eager_rows and len(eager_rows) == 4
    assert _flags_set(graphed.model) == []
    expected = eager.model.state_dict()
    for key, value in graphed.model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_capture_clears_the_flags_its_warmups_set(graph_stand_in):
    """The warm-ups' NaN gradients make MABN2d's backward flag a non-finite psi; the capture clears what they set,
    and the next optimizer step's check finds nothing."""
    net = small_net("mabn")
    net[1].policy = (False, False)
    cudagraph.graph_training_forward(net, torch.randn(4, 3, 6, 6), warmup_iters=2)
    assert _flags_set(net) == []
    net(torch.randn(4, 3, 6, 6)).sum().backward()
    net[1].raise_if_nonfinite()


def test_graphed_fit_with_gradient_accumulation_equals_eager_fit(tmp_path, graph_stand_in):
    """accumulate_grad_batches: 2 under CUDA graphs sums the two micro-batches' gradients exactly: a gradient that
    stayed in the graphs' static buffer would be overwritten by the next replay (the stand-in, as torch, hands the
    buffers out). Float64, so that only a wrong gradient can differ."""
    fits = {g: _fit(tmp_path / str(g), g, "cpu", steps=4, precision="64-true", accumulate=2) for g in (False, True)}
    (eager, eager_rows), (graphed, graphed_rows) = fits[False], fits[True]
    assert graph_stand_in.replayed == [(4, 3, 8, 8)] * 8  # two micro-batches per optimizer step
    assert graphed_rows == eager_rows
    expected = eager.model.state_dict()
    for key, value in graphed.model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("loop", ["accumulate 3", "zero_grad(set_to_none=False)"])
def test_graphed_plain_loop_keeping_gradients_equals_eager(loop, graph_stand_in):
    """A user's loop over a graphed model that keeps gradients between backward passes, by accumulating them or by
    zeroing them in place, trains the eager loop's weights (float64)."""
    torch.manual_seed(0)
    eager = small_net("mabn").double()
    eager[-2].p = 0.0  # no dropout: the two loops draw their randomness at different times
    graphed = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 6, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (4,), generator=gen))
               for _ in range(6)]  # fmt: skip
    cudagraph.graph_training_forward(graphed, batches[0][0])
    micro = 3 if loop == "accumulate 3" else 1
    for net in (eager, graphed):
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for t, (x, y) in enumerate(batches):
            F.cross_entropy(net(x), y).backward()
            if (t + 1) % micro == 0:
                opt.step()
                opt.zero_grad(set_to_none=micro > 1)
    expected = eager.state_dict()
    for key, value in graphed.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-12, atol=1e-12, msg=key)


def test_task_with_cuda_graph_on_cpu_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="needs the model on a GPU"):
        _fit(tmp_path, cuda_graph=True, accelerator="cpu")


# -- cuda_graph: auto ---------------------------------------------------------------------------------------------
def _auto_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("cuda_graph")]


class _ResNetTask(NormTask):
    """A ResNet-18 with MABN and CenConv2d trained by cross-entropy, ``cuda_graph`` at NormTask's default unless
    given: what both stages train, at a depth that fits a test."""

    def __init__(self, **graph: object) -> None:
        super().__init__(norm="mabn", arch="resnet18", **graph)
        self.model = resnet("mabn", num_classes=3, norm_batch_size=2, arch="resnet18")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.training_forward(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("setting, lines", [
    (None, ["cuda_graph auto: eager training step (the model is on cpu; CUDA graphs need a GPU)"]),
    (False, []),
])  # fmt: skip
def test_auto_by_default_trains_eagerly_on_the_cpu_and_says_why(tmp_path, caplog, setting, lines):
    """``cuda_graph`` left at its default (None here) or false: two eager steps, one line from auto, none from
    false; MABNCallback keeps the logged layers tracking only while it logs, as for an eager model."""
    task = _ResNetTask(**({} if setting is None else {"cuda_graph": setting}))
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 3, (8,), generator=gen))
    with caplog.at_level(logging.INFO):
        trainer = quiet_trainer(tmp_path, accelerator="cpu", devices=1, max_steps=2)
        trainer.fit(task, DataLoader(data, batch_size=4, drop_last=True))
    assert trainer.global_step == 2
    assert _auto_lines(caplog) == lines
    assert not task.cuda_graph and not cudagraph.is_graphed(task.model)
    # A callback that took the model for graphed would leave its logged layers tracking after the last step.
    assert not any(m.track_stats for m in task.model.modules() if isinstance(m, MABN2d))


def test_auto_with_compile_leaves_the_step_to_torch_compile(caplog):
    task = GraphTask("auto", compile="reduce-overhead")
    with caplog.at_level(logging.INFO):
        task.on_fit_start()
    assert _auto_lines(caplog) == [
        "cuda_graph auto: no CUDA-graph capture (compile is set; torch.compile runs the step)"
    ]
    assert not task.cuda_graph


def test_auto_names_the_layer_that_keeps_a_gpu_fit_eager(monkeypatch):
    """On a GPU what blocks a capture under a process group of several devices: SyncBatchNorm, MABN2d/BRN with
    sync_stats; the first layer is named, the others counted. Without such layers a GPU model is capturable."""
    gpu = torch.device("cuda")  # the reason is decided from the device's type: no GPU is touched
    monkeypatch.setattr(cudagraph, "sync_group", lambda: True)  # as with two or more processes
    assert cudagraph.why_not_capturable(small_net("mabn"), gpu) is None
    assert cudagraph.why_not_capturable(small_net(), torch.device("cpu")) == (
        "the model is on cpu; CUDA graphs need a GPU"
    )
    for norm, kind in (("mabn", "MABN2d"), ("brn", "BatchRenorm2d")):
        net = small_net(norm)
        net[1].sync_stats = True
        expected = f"layer 1: {kind}(sync_stats=True) communicates across devices inside the forward"
        assert cudagraph.why_not_capturable(net, gpu) == expected
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(small_net("mabn"))
    assert cudagraph.why_not_capturable(synced, gpu) == (
        "layer 4: SyncBatchNorm communicates across devices inside the forward"
    )
    synced[1].sync_stats = True
    assert cudagraph.why_not_capturable(synced, gpu).endswith("inside the forward; and 1 more layer")
    monkeypatch.setattr(cudagraph, "sync_group", lambda: False)  # one process: nothing to communicate
    assert cudagraph.why_not_capturable(synced, gpu) is None


@pytest.mark.parametrize("value", ["always", "True", 1, None])
def test_cuda_graph_refuses_anything_but_true_false_or_auto(value):
    for ok in (True, False, "auto"):
        NormTask.check_hparams({"norm": "mabn", "cuda_graph": ok})
    with pytest.raises(ConfigError) as err:
        NormTask.check_hparams({"norm": "mabn", "cuda_graph": value})
    assert str(err.value) == f"cuda_graph={value!r}: choose true, false or auto"
    with pytest.raises(ConfigError, match="^cuda_graph="):
        ClassificationTask(norm="mabn", arch="resnet18", cuda_graph=value)


@needs_gpu
@pytest.mark.parametrize("sync_stats", [False, True])
def test_auto_on_a_gpu_captures_unless_a_layer_communicates(tmp_path, caplog, monkeypatch, sync_stats):
    """``auto`` on a GPU captures at the first training step; a MABN2d with sync_stats under a process group of
    several devices (stood in for: the layer itself still normalizes alone) keeps the step eager, with its line."""
    monkeypatch.setattr(cudagraph, "sync_group", lambda: sync_stats)
    task = GraphTask("auto", POLICY)
    task.model[1].sync_stats = sync_stats
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, "auto", "gpu", steps=1, task=task)
    if sync_stats:
        why = "layer 1: MABN2d(sync_stats=True) communicates across devices inside the forward"
        assert _auto_lines(caplog) == [f"cuda_graph auto: eager training step ({why})"]
    else:
        assert _auto_lines(caplog) == [
            "cuda_graph auto: the training forward and backward run as CUDA graphs (captured at the first training "
            "batch)"
        ]
    assert task.cuda_graph == cudagraph.is_graphed(task.model) == (not sync_stats)


# What each norm's last_stats holds that the graphed step must reproduce.
STATS = {"mabn": ("chi2_batch", "chi2_used", "r", "psi_used"), "brn": ("mu_batch", "sigma_batch", "r", "d")}


@needs_gpu
@pytest.mark.parametrize("norm, path", [("mabn", "fused"), ("mabn", "torch ops"), ("brn", "torch ops")])
def test_graphed_steps_equal_eager_steps(norm, path, device, monkeypatch):
    """Eight SGD steps through warm-up, moving statistics, renormalization, a policy switch and dropout: every
    loss, gradient-fed parameter and buffer of the graphed model as in eager training, with MABN2d's statistic
    steps as the Triton kernels and as torch ops (its path without Triton), and with BatchRenorm2d."""
    if path == "torch ops":
        monkeypatch.setattr(mabn_module, "_fused_kernels", lambda x: None)
    torch.manual_seed(0)
    eager = small_net(norm).to(device)
    eager[1].policy = (False, False)
    graphed = copy.deepcopy(eager)
    graphed[1].track_stats = eager[1].track_stats = True
    gen = torch.Generator().manual_seed(1)
    batches = [
        ((torch.randn(4, 3, 8, 8, generator=gen) + 0.5).to(device), torch.randint(0, 3, (4,), generator=gen).to(device))
        for _ in range(8)
    ]
    cudagraph.graph_training_forward(graphed, batches[0][0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, graphed)]
    for t, (x, y) in enumerate(batches):
        if t in (3, 5):  # moving statistics from step 3, renormalization from step 5
            for m in (eager, graphed):
                m[1].policy = (True, t >= 5)
        losses, rng = [], torch.cuda.get_rng_state()
        for m, opt in zip((eager, graphed), opts):
            torch.cuda.set_rng_state(rng)  # the same dropout draws: a replay takes the generator's state as it is
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6, msg=f"loss at step {t}")
        for key in STATS[norm]:
            torch.testing.assert_close(graphed[1].last_stats[key], eager[1].last_stats[key], rtol=1e-5, atol=1e-6)
    expected = eager.state_dict()
    for key, value in graphed.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-6, msg=key)
    assert int(graphed[1].iters if norm == "mabn" else graphed[1].num_batches_tracked) == 8


@needs_gpu
@pytest.mark.parametrize("norm, what", [("mabn", "chi"), ("brn", "batch statistics")])
def test_graphed_non_finite_input_is_reported(norm, what):
    net = small_net(norm).cuda()
    x = torch.randn(4, 3, 8, 8, device="cuda")
    cudagraph.graph_training_forward(net, x)
    before = copy.deepcopy(net[1].state_dict())
    x[1, 0, 2, 2] = float("nan")
    net(x).sum().backward()
    with pytest.raises(FloatingPointError, match=what):
        net[1].raise_if_nonfinite()
    for key, value in net[1].state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by a non-finite batch"


@needs_gpu
@pytest.mark.parametrize("precision, rtol", [("32-true", 1e-4), ("16-mixed", 1e-3)])
def test_graphed_fit_equals_eager_fit(tmp_path, precision, rtol):
    """Under a Trainer with MABNCallback (policy switches at steps 2 and 4, statistics logged every 2 steps); under
    16-mixed the graphs read each backward's loss scale from the callback's tensor."""
    runs = {graph: _fit(tmp_path / str(graph), graph, "gpu", precision=precision) for graph in (False, True)}
    (eager, eager_rows), (graphed, graphed_rows) = runs[False], runs[True]
    assert [r["step"] for r in graphed_rows] == [r["step"] for r in eager_rows] == ["1", "3", "5", "7"]
    for a, b in zip(eager_rows, graphed_rows):
        for key in ("chi2_batch", "chi2_sma", "psi_bar", "phase"):
            k = f"norm/model.1/{key}"
            assert float(b[k]) == pytest.approx(float(a[k]), rel=rtol), (a["step"], key)
    expected = eager.model.state_dict()
    for key, value in graphed.model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=rtol, atol=1e-6, msg=key)


@pytest.mark.parametrize("stage", ["pretrain", "cityscapes"])
def test_stage_configs_let_cudnn_pick_its_algorithms_once(stage):
    """Every training crop of a stage has one size, so cuDNN's benchmark picks each convolution's fastest
    algorithm once; the validation's sliding windows have the crop's size too."""
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / f"{stage}.yaml").read_text())
    assert config["trainer"]["benchmark"] is True


# -- across fits, and one set of saved activations ------------------------------------------------------------------
def _fit_twice(tmp_path: Path, cuda_graph: bool, first: str) -> GraphTask:
    """Two fits of one task, each on its own Trainer as a user's second ``fit()`` runs: the first in ``first``
    precision ("scaled": a loss scale of 16 doubling at every step, without autocast; or "32-true"), the second
    scaled; 4 steps each."""
    torch.manual_seed(0)
    task = GraphTask(cuda_graph, POLICY)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 8, 8, generator=gen) + 0.5, torch.randint(0, 3, (16,), generator=gen))
    for i, precision in enumerate((first, "scaled")):
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
        plugins = [ScalingOnly("16-mixed", "cpu", scaler=scaler)] if precision == "scaled" else []
        trainer = quiet_trainer(tmp_path / str(i), accelerator="cpu", max_steps=4, plugins=plugins)
        trainer.fit(task, DataLoader(data, batch_size=4, drop_last=True))
    return task


@pytest.mark.parametrize("first", default_suite_runs(["scaled", "32-true"], keep=["scaled"]))
def test_second_fit_captures_its_own_graphs(tmp_path, graph_stand_in, first):
    """A second ``fit()`` of a graphed task under a loss scaler: its MABNCallback hands the layers a loss scale of
    its own (the first fit's is freed with its callback, or there was none), which graphs of the first fit would
    never read. The second fit captures again, and its replays read the live scale (the stand-in refuses a replay
    that reads another tensor than its capture): the weights and statistics are the eager fits', bit for bit."""
    eager, graphed = (_fit_twice(tmp_path / str(g), g, first) for g in (False, True))
    assert graph_stand_in.captured == [(4, 3, 8, 8)] * 2
    expected = eager.model.state_dict()
    for key, value in graphed.model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_second_graphed_forward_before_the_backward_is_refused(graph_stand_in):
    """The graphs hold one set of activations: a replay while an earlier one's backward is still to come is refused
    in one line naming the setting that trains eagerly; a replay whose output was let go, a no-grad forward and a
    replay after the backward are not."""
    net = small_net()
    x = torch.randn(4, 3, 6, 6)
    cudagraph.graph_training_forward(net, x)
    net(x)  # let go without a backward: nothing pending
    out = net(x)
    with pytest.raises(cudagraph.SecondForwardError) as err:
        net(torch.randn(4, 3, 6, 6))
    assert isinstance(err.value, ConfigError) and user_error(err.value) == str(err.value)
    assert "\n" not in str(err.value) and str(err.value).endswith("--model.init_args.cuda_graph false")
    with torch.no_grad():
        net(x)  # eager
    out.sum().backward()
    net(x).sum().backward()
    assert graph_stand_in.replayed == [(4, 3, 6, 6)] * 3


class TwoCrops(GraphTask):
    """A training step over the batch and its mirror image, one loss for both: two forwards before one backward."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.training_forward(x), y) + F.cross_entropy(self.training_forward(x.flip(-1)), y)


def test_graphed_fit_with_two_forwards_per_step_stops_with_one_line(tmp_path, graph_stand_in, capsys):
    with pytest.raises(cudagraph.SecondForwardError) as err:
        _fit(tmp_path, True, "cpu", task=TwoCrops(True, POLICY))
    with pytest.raises(SystemExit):
        exit_on_user_error(err.value)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a second CUDA-graphed training forward before")


def test_capture_under_autocast_turns_its_cache_off(graph_stand_in):
    """torch refuses a capture under autocast with its weight-cast cache: the capture turns the cache off for the
    sample's device (the stand-in checks the CPU's, standing for the GPU's)."""
    net = small_net()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cudagraph.graph_training_forward(net, torch.randn(4, 3, 6, 6), warmup_iters=1)
        net(torch.randn(4, 3, 6, 6)).float().sum().backward()
    assert graph_stand_in.replayed == [(4, 3, 6, 6)]


@needs_gpu
def test_second_16_mixed_fit_on_real_graphs_equals_eager(tmp_path):
    """Two fits of one task under 16-mixed on real CUDA graphs: the second fit's graphs read its own callback's loss
    scale, not the first fit's, which is freed with that callback."""
    fits = {}
    for graph in (False, True):
        task = GraphTask(graph, POLICY)
        for i in range(2):
            _fit(tmp_path / f"{graph}-{i}", graph, "gpu", precision="16-mixed", task=task)
        fits[graph] = task
    expected = fits[False].model.state_dict()
    for key, value in fits[True].model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-3, atol=1e-6, msg=key)


@needs_gpu
def test_second_forward_on_real_graphs_is_refused():
    net = small_net().cuda()
    x = torch.randn(4, 3, 8, 8, device="cuda")
    cudagraph.graph_training_forward(net, x)
    out = net(x)
    with pytest.raises(cudagraph.SecondForwardError):
        net(x)
    out.sum().backward()
    net(x).sum().backward()
