"""Each private API in ``mabn.compat`` held to what the product relies on: a Lightning, torch, Triton or
jsonargparse release that renames, moves or changes one fails here, by the touchpoint's name. Each test drives the
framework as the product does and checks the outcome, not only that a name exists."""

from __future__ import annotations

import argparse
import inspect
import os
import re
import signal
from argparse import ArgumentError

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from jsonargparse import ArgumentParser
from torch import nn

from mabn import compat
from mabn.data.loading import make_loader
from mabn.run import RandomStateCallback


# -- Lightning ---------------------------------------------------------------------------------------------------
def test_wandb_init_args_are_what_wandb_init_receives(tmp_path, monkeypatch):
    import wandb
    from pytorch_lightning.loggers import WandbLogger

    received = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: received.append(kwargs) or pl.loggers.logger.DummyExperiment())
    monkeypatch.setattr(wandb, "run", None)
    # An offline WandbLogger sets WANDB_MODE=dryrun in os.environ at its first run: restored after the test, or every
    # later fit in this worker would start its wandb run offline and print wandb's lines.
    monkeypatch.setenv("WANDB_MODE", os.environ.get("WANDB_MODE", "disabled"))
    logger = WandbLogger(save_dir=str(tmp_path), name="n", group="g", offline=True)
    args = compat.wandb_init_args(logger)
    assert (args["name"], args["group"]) == ("n", "g")
    args["mode"] = "offline"
    args.pop("anonymous", None)
    logger.experiment  # noqa: B018 (the first access calls wandb.init)
    assert len(received) == 1 and received[0]["mode"] == "offline" and "anonymous" not in received[0]


def test_csv_writer_is_the_writer_finalize_saves(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    class Writer:
        saved = 0

        def save(self) -> None:
            self.saved += 1

    logger = CSVLogger(str(tmp_path))
    assert compat.csv_writer(logger) is None  # none before the first experiment
    writer = Writer()
    compat.set_csv_writer(logger, writer)
    assert logger.experiment is writer and compat.csv_writer(logger) is writer
    logger.finalize("success")
    assert writer.saved == 1


def test_record_sigterm_makes_lightnings_sigterm_handler_only_record():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    received = []
    compat.record_sigterm(trainer, lambda signum, frame: received.append(signum))
    connector = trainer._signal_connector  # what Lightning's Trainer._run does with it as a fit starts
    # Lightning's handler also calls the one it finds: the default here, not what an earlier fit in this process left
    # (LastCheckpoint's, which after a failed fit acts as the default and ends the process).
    earlier = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    before = signal.getsignal(signal.SIGTERM)
    connector.register_signal_handlers()
    try:
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        connector.teardown()
        after = signal.signal(signal.SIGTERM, earlier)
    assert received == [signal.SIGTERM]
    assert connector.received_sigterm is False  # Lightning's own notifier did not run
    assert after == before
    assert "register_signal_handlers" in inspect.getsource(pl.Trainer._run)


class _Counted(pl.LightningModule):
    """A linear model on 16 fixed samples, 4 shuffled batches an epoch (the product's training loader), a
    validation at each epoch's end; records Lightning's own counters and the batch's samples at each training
    batch's start, and each validation's end."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.seen: list[tuple] = []

    def training_step(self, batch, batch_idx):
        loop = self.trainer.fit_loop
        counters = (self.current_epoch, self.global_step, loop.epoch_loop._batches_that_stepped, batch_idx)
        samples = tuple(batch[0][:, 0].int().tolist())  # which samples: the shuffled order, continued on a resume
        self.seen.append(("train", *counters, loop.epoch_progress.current.processed, samples))
        return self.layer(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0 and not self.trainer.sanity_checking:
            self.seen.append(("val", self.current_epoch, self.global_step))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return make_loader(self.samples(), 4, train=True, num_workers=0)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.samples(), batch_size=4)

    @staticmethod
    def samples() -> torch.utils.data.TensorDataset:
        return torch.utils.data.TensorDataset(torch.arange(32.0).view(16, 2))


class _SaveAt(pl.Callback):
    """Saves the fit's checkpoint at ``hook``; at a training batch's end, the one at step 6, and stops there."""

    def __init__(self, path, hook: str) -> None:
        self.path, self.hook = path, hook

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.hook == "on_train_batch_end" and trainer.global_step == 6:
            trainer.save_checkpoint(self.path)
            raise RuntimeError("stopped after the save")

    def on_train_epoch_end(self, trainer, pl_module):
        if self.hook == "on_train_epoch_end":
            trainer.save_checkpoint(self.path)

    def on_train_end(self, trainer, pl_module):
        if self.hook == "on_train_end":
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize(
    ("first", "hook"),
    [
        ({"max_epochs": 2, "max_steps": 100}, "on_train_epoch_end"),  # the end of an epoch, max_steps set
        ({"max_epochs": 2, "max_steps": 100}, "on_train_end"),  # the end of a fit at an epoch's end
        ({"max_epochs": 3, "max_steps": 6}, "on_train_end"),  # max_steps inside an epoch
        ({"max_epochs": 3, "max_steps": 100}, "on_train_batch_end"),  # a training batch's end (SIGTERM's save)
    ],
    ids=["epoch-end", "fit-end", "inside-an-epoch", "batch-end"],
)
def test_hold_resumed_epochs_and_resumed_logging_step_follow_lightnings_counters(tmp_path, first, hook):
    """A fit stopped and resumed (max_epochs 3, max_steps 100) counts its epochs, steps, logged steps and batches,
    and validates, where the uninterrupted fit does, read from Lightning's own counters; ``resumed_logging_step``
    is the logged step of its first training batch, ``epochs_trained`` the epochs ended before the checkpoint.
    With ``record_trained_batches`` the batches are the same samples too: inside an epoch the resume trains the
    rest of that epoch's order (the random states in the checkpoint, ``RandomStateCallback``, give the orders at
    an epoch's start)."""

    def fit(ckpt_path=None, callbacks=(), **limits):
        trainer = pl.Trainer(
            accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[RandomStateCallback(), *callbacks],
            **limits,
        )  # fmt: skip
        compat.hold_resumed_epochs(trainer)
        compat.record_trained_batches(trainer)
        torch.manual_seed(0)  # the first epoch's order; a resume's comes from the checkpoint
        module = _Counted()
        trainer.fit(module, ckpt_path=ckpt_path)
        return module.seen, trainer

    limits = {"max_epochs": 3, "max_steps": 100}
    straight, _ = fit(**limits)
    path = tmp_path / "stopped.ckpt"
    if hook == "on_train_batch_end":
        with pytest.raises(RuntimeError, match="stopped after the save"):
            fit(callbacks=[_SaveAt(path, hook)], **first)
        before = [seen for seen in straight if seen[2] < 6]  # the batches trained before the save
    else:
        before, _ = fit(callbacks=[_SaveAt(path, hook)], **first)
    after, trainer = fit(ckpt_path=path, **limits)
    assert before + after == straight
    first_logged = next(seen[3] for seen in after if seen[0] == "train")
    saved = torch.load(path, weights_only=True)
    assert compat.resumed_logging_step(saved) == first_logged
    # The epochs ended by the checkpoint's step: the uninterrupted fit's validations (one at each epoch's end) so far.
    assert compat.epochs_trained(saved) == sum(
        seen[0] == "val" and seen[2] <= saved["global_step"] for seen in straight
    )
    assert trainer.global_step == 12 and trainer.current_epoch == 3


def test_cluster_environment_is_the_trainers_also_on_one_device():
    from lightning_fabric.plugins.environments import LightningEnvironment

    environment = LightningEnvironment()
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[environment], logger=False)
    assert compat.cluster_environment(trainer) is environment
    assert not hasattr(trainer.strategy, "cluster_environment")  # the public one is a parallel strategy's only


def test_ddp_kwargs_reach_distributed_data_parallel(monkeypatch):
    from pytorch_lightning.strategies import DDPStrategy
    from pytorch_lightning.strategies import ddp as ddp_module

    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")], find_unused_parameters=True)
    kwargs = compat.ddp_kwargs(strategy)
    assert kwargs == {"find_unused_parameters": True}
    kwargs["broadcast_buffers"] = False  # as configure_ddp sets it before the model is wrapped
    wrapped = []
    monkeypatch.setattr(ddp_module, "DistributedDataParallel", lambda **kw: wrapped.append(kw))
    strategy._setup_model(nn.Linear(1, 1))  # where Lightning wraps the model
    assert wrapped and wrapped[0]["broadcast_buffers"] is False and wrapped[0]["find_unused_parameters"] is True


def test_syncs_batchnorm_follows_the_trainers_sync_batchnorm():
    def trainer(**kwargs):
        return pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, **kwargs)

    assert compat.syncs_batchnorm(trainer(sync_batchnorm=True).strategy) is True
    assert compat.syncs_batchnorm(trainer().strategy) is False
    assert compat.syncs_batchnorm(pl.Trainer(accelerator="cpu", devices=1, logger=False).strategy) is False


# -- jsonargparse ------------------------------------------------------------------------------------------------
class _Task:
    def __init__(self, lr: float = 0.1) -> None:
        self.lr = lr


def _error(*args: str) -> str:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--size", type=int | None, default=None)
    parser.add_argument("--task", type=_Task)
    parser.add_argument("--model", type=_Task | None, default=None)
    with pytest.raises(ArgumentError) as error:
        parser.parse_args(list(args))
    return str(error.value)


def test_help_text_formatter_filters_descriptions_and_argument_help():
    class Upper(compat.HelpTextFormatter):
        def help_text(self, text: str) -> str:
            return text.replace("x", "X")

    parser = argparse.ArgumentParser(prog="p", description="the x tool", epilog="see x", formatter_class=Upper)
    parser.add_argument("--n", default="x1", help="an x (default %(default)s)")
    shown = parser.format_help()
    assert "the X tool" in shown and "see X" in shown and "an X (default X1)" in shown  # after the expansion


def test_option_strings_are_the_parsers_long_options():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("-n", "--num", type=int, default=1)
    assert set(compat.option_strings(parser)) >= {"--lr", "--num", "--help"}
    assert "-n" not in compat.option_strings(parser)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--nope", "1"], {"unknown": "--nope 1"}),
        (["--lr", "abc"], {"keys": ["lr"], "given": "abc", "expected": "<class 'float'>"}),
        (["--size", "abc"], {"keys": ["size"], "given": "abc", "expected": "<class 'int'>, <class 'NoneType'>"}),
        (
            ["--task", '{"class_path": "test_compat._Task", "init_args": {"lrr": 1}}'],
            {"keys": ["task"], "class_paths": ["test_compat._Task"], "refused": "lrr"},
        ),
        (
            ["--task", '{"class_path": "test_compat._Task", "init_args": {"lr": "x"}}'],
            {
                "keys": ["task", "lr"],
                "class_paths": ["test_compat._Task"],
                "given": "x",
                "expected": "<class 'float'>",
            },
        ),
        (
            ["--model", "nosuch.Module"],
            {
                "keys": ["model"],
                "class_paths": ["nosuch.Module"],
                "given": "nosuch.Module",
                "expected": "<class 'test_compat._Task'>, <class 'NoneType'>",
                "reasons": ["Problem with given class_path 'nosuch.Module': No module named 'nosuch'"],
            },
        ),
    ],
    ids=["unknown", "type", "union", "refused", "nested", "reason"],
)
def test_argument_error_text_reads_jsonargparses_messages(args, expected):
    empty = {"unknown": None, "keys": [], "class_paths": [], "refused": None, "given": None, "expected": None}
    said = compat.argument_error_text(_error(*args))._asdict()
    assert said == {**empty, "reasons": [], **expected}


# -- torch -------------------------------------------------------------------------------------------------------
def test_torch_dispatch_mode_sees_aten_operators():
    seen = []

    class Seen(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2) + 1
    assert "aten.add.Tensor" in seen


def test_scale_on_device_is_the_scalers_current_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # the scale tensor is made at the first scale()
    scale = compat.scale_on_device(scaler)
    assert isinstance(scale, torch.Tensor) and scale.device.type == "cpu" and scale.item() == 8.0
    scaler.update(new_scale=2.0)
    assert compat.scale_on_device(scaler).item() == 2.0 == scaler.get_scale()


def test_default_store_is_the_process_groups_store(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        store = compat.default_store()
        store.set("failure", "rank 0")
        assert isinstance(store, dist.Store) and store.get("failure") == b"rank 0"
    finally:
        dist.destroy_process_group()


def test_tree_leaves_flattens_nested_outputs():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert [t.item() for t in compat.tree_leaves((a, [b, {"x": c}]))] == [0.0, 1.0, 2.0]
    assert compat.tree_leaves(a)[0] is a


def test_mark_static_address_marks_the_tensor_for_dynamo():
    t = torch.zeros(2)
    compat.mark_static_address(t)
    assert t._dynamo_static_input_type == "unguarded"  # what dynamo reads: no re-recording for this input


def test_foreach_sub_subtracts_in_place():
    xs = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0]])]
    compat.foreach_sub_(xs, [torch.tensor([1.0, 1.0]), torch.tensor([[0.5]])])
    assert xs[0].tolist() == [2.0, 3.0] and xs[1].tolist() == [[0.5]]


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_conv_forward_convolves_with_the_weight_given(padding_mode):
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode=padding_mode).double()
    x, weight = torch.randn(1, 2, 5, 5, dtype=torch.float64), torch.randn(3, 2, 3, 3, dtype=torch.float64)
    padded = F.pad(x, (1, 1, 1, 1), mode="constant" if padding_mode == "zeros" else padding_mode)
    expected = F.conv2d(padded, weight, conv.bias)
    torch.testing.assert_close(compat.conv_forward(conv, x, weight, conv.bias), expected)


def test_device_moves_hears_every_move():
    class Probe(compat.DeviceMoves):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(1))
            self.moves = []

        def moved(self, fn) -> None:
            self.moves.append(fn(torch.zeros(1)).dtype)

    probe = nn.Sequential(Probe())
    assert probe.double() is probe
    probe.to(torch.float16)
    probe.cpu()
    assert probe[0].moves == [torch.float64, torch.float16, torch.float32]
    assert probe[0].b.dtype == torch.float16


# -- Triton ------------------------------------------------------------------------------------------------------
def test_triton_launch_abi_is_tritons_own():
    """On any machine: ``compat.launch`` calls a compiled kernel as Triton's own launch does (its runner in
    ``CompiledKernel.__getitem__``), with the attributes and hooks it reads."""
    from triton.compiler.compiler import CompiledKernel
    from triton.knobs import runtime

    source = re.sub(r"\s+", "", inspect.getsource(CompiledKernel))
    own_call = (
        "self.run(grid[0],grid[1],grid[2],stream,self.function,self.packed_metadata,launch_metadata,"
        "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*args)"
    )
    assert own_call in source
    assert "launch_metadata=self.launch_metadata(grid,stream,*args)" in source
    assert isinstance(inspect.getattr_static(CompiledKernel, "run"), property)
    assert list(inspect.signature(CompiledKernel.launch_metadata).parameters) == ["self", "grid", "stream", "args"]
    assert hasattr(runtime, "launch_enter_hook") and hasattr(runtime, "launch_exit_hook")
    # What the launcher keeps and passes here: the compiled kernel that a JIT function's launch returns.
    from triton.runtime.jit import JITFunction

    assert "returnkernel" in re.sub(r"\s+", "", inspect.getsource(JITFunction.run))
    ours = re.sub(r"\s+", "", inspect.getsource(compat.launch))
    assert (
        "compiled.run(*grid,stream,compiled.function,compiled.packed_metadata,compiled.launch_metadata(grid,stream,"
        "*args),runtime.launch_enter_hook,runtime.launch_exit_hook,*args,)" in ours
    )


@pytest.mark.gpu(cuda_only=True)
def test_triton_launch_runs_a_compiled_kernel_on_cuda():
    """Where the direct launch runs: a kernel compiled by its first launch, launched again through
    ``compat.launch`` on new data, gives what torch gives."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)

    x, out = torch.zeros(100, device="cuda"), torch.empty(100, device="cuda")
    compiled = add_one[(1, 1, 1)](x, out, 100, BLOCK=128)
    torch.testing.assert_close(out, x + 1)
    y, again = torch.arange(100.0, device="cuda"), torch.empty(100, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    compat.launch(compiled, (1, 1, 1), stream, [y.data_ptr(), again.data_ptr(), 100, 128], triton.knobs.runtime)
    torch.cuda.synchronize()
    torch.testing.assert_close(again, y + 1)


def test_record_sigterm_skips_the_loops_per_batch_broadcast_of_the_flag_it_leaves_unset(monkeypatch):
    """Under DDP Lightning's training loop broadcasts ``received_sigterm`` at the start of every batch and reads it
    back on the host; with the notifier that set it replaced, the broadcast carries nothing and is not made."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    compat.record_sigterm(trainer, lambda signum, frame: None)
    broadcasts = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *args, **kwargs: broadcasts.append(args))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert broadcasts == []


def test_torch_cuda_graph_takes_a_capture_mode_and_make_graphed_callables_captures_through_it():
    """What ``make_graphed_callables_thread_local`` relies on where make_graphed_callables has no mode of its own: the
    mode of ``torch.cuda.graph``, and make_graphed_callables capturing through that name."""
    import torch.cuda.graphs

    assert inspect.signature(torch.cuda.graph).parameters["capture_error_mode"].default == "global"
    assert "torch.cuda.graph(" in inspect.getsource(torch.cuda.graphs)
