"""Every private API of Lightning, torch, Triton, jsonargparse and argparse that the product relies on, one function
(or base class) each.

Each exists because no public API does the same (Lightning 2.6, torch 2.14, Triton 3.8, jsonargparse 4.53); its
docstring says what it relies on and what breaks if a release changes it. tests/test_compat.py holds each to what
is relied on here, so a release that changes one fails there, by the touchpoint's name, instead of the product
going wrong quietly. Nothing else in the package reads or writes a foreign underscore name.

Lightning and Triton are imported where a function needs them: ``import mabn`` loads torch alone.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # noqa: PLC0414

# -- Lightning ---------------------------------------------------------------------------------------------------


def wandb_init_args(logger: Any) -> dict[str, Any]:
    """The keyword arguments Lightning's ``WandbLogger`` passes to ``wandb.init`` at its first ``experiment``
    (``_wandb_init``), as the live dict: ``mabn.run.loggers.WandbLogger`` drops Lightning's ``anonymous=None`` from it
    and sets ``mode="offline"`` in it to start a failed online run again offline. Lightning has no setter; if the
    dict is renamed or copied at init, the offline restart tries online again and the run stops."""
    return logger._wandb_init


def csv_writer(logger: Any) -> Any:
    """The experiment writer a Lightning ``CSVLogger`` holds (``_experiment``; None before its first ``experiment``),
    the one its ``finalize`` saves: ``mabn.run.loggers.CSVLogger`` makes its own writer there. If renamed, the last
    rows of a fit are never written to ``metrics.csv``."""
    return logger._experiment


def set_csv_writer(logger: Any, writer: Any) -> None:
    """Hold ``writer`` as the ``CSVLogger``'s experiment (see ``csv_writer``)."""
    logger._experiment = writer


def record_sigterm(trainer: Any, record: Callable[[int, Any], None]) -> None:
    """Make the SIGTERM handler Lightning installs when a fit starts call ``record`` and nothing else: its
    connector's bound ``_sigterm_notifier_fn`` (broadcasts a flag from rank 0, inside the signal handler) and
    ``_sigterm_handler_fn`` (forwards the signal) are replaced on this trainer only. ``LastCheckpoint`` records the
    signal and acts on it between batches. If renamed, Lightning's own handler runs again inside the signal handler,
    where a collective can pair up wrongly or hang.

    The flag that handler set (``received_sigterm``) then stays False, so the training loop's broadcast of it at
    the start of every batch under DDP (``_broadcast_sigterm_tensor``: a device tensor, read back by the host,
    which waits for the device's queued kernels) is skipped on this trainer too. If renamed, that broadcast runs
    again, costing a wait per batch and nothing else."""
    connector = trainer._signal_connector
    connector._sigterm_notifier_fn = record
    connector._sigterm_handler_fn = record
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _never_terminated


def _never_terminated() -> None:
    """The training loop's SIGTERM broadcast where no handler sets the flag it broadcasts (``record_sigterm``)."""


def hold_resumed_epochs(trainer: Any) -> None:
    """Make a resume of ``trainer``'s fit continue the epoch and the logged step that an uninterrupted fit would
    be at, with ``max_steps`` set as without it.

    Lightning 2.6's fit loop forces ``restarting`` on a resume whenever ``max_steps`` is set
    (``_FitLoop.restarting``, ``_iteration_based_training``), and counts wrongly from two checkpoints whose epoch
    it holds as processed (``epoch_progress.current``: ``ready == started == processed``):

    - an epoch that ended at its last batch (a checkpoint of ``on_train_epoch_end`` or ``on_train_end``): it runs
      that epoch's end once more, counting it processed a second time (one epoch lost to ``max_epochs``) and
      adding 1 to ``_batches_that_stepped`` (every later row logged one step late). Here the loop does not
      restart, as it does without ``max_steps``: the next epoch starts afresh;
    - an epoch that ``max_steps`` ended inside (its last batch not reached, ``batch_progress.is_last_batch``
      False): the resume goes on inside it, yet under the next epoch's number (the sampler's epoch and
      ``max_epochs`` one ahead). Here the epoch is counted as started and not processed, as a checkpoint from
      inside an epoch is.

    Done as the fit loop's state is loaded (``fit_loop.load_state_dict``, wrapped on this trainer's loop).
    tests/test_compat.py resumes from both against an uninterrupted fit's own counters; if Lightning renames
    these counters, that test fails by this function's name."""
    from pytorch_lightning.loops import _Loop

    loop = trainer.fit_loop
    load = loop.load_state_dict

    def load_and_hold(state_dict: dict, prefix: str = "") -> None:
        load(state_dict, prefix)
        epochs = loop.epoch_progress
        if not epochs.current.ready == epochs.current.started == epochs.current.processed > 0:
            return  # inside an epoch, or before the first: Lightning continues it rightly
        if loop.epoch_loop.batch_progress.is_last_batch:
            _Loop.restarting.fset(loop, False)  # the base setter: the fit loop's own forces it with max_steps
            return
        for progress in (epochs.current, epochs.total):
            progress.processed -= 1
            progress.completed = progress.processed
        _Loop.restarting.fset(loop, True)

    loop.load_state_dict = load_and_hold


def record_trained_batches(trainer: Any) -> None:
    """Before each checkpoint of ``trainer``'s fit takes its training loader's state (``fit_loop.on_save_checkpoint``,
    wrapped on this trainer's loop), tell a loader that records it (``trained_batches``, ``ResumableLoader``) how
    many batches of the current epoch the fit has trained: the epoch loop's ``batch_progress.current.ready``, the
    count a resume goes on from. The loader cannot count them itself: Lightning's fetcher holds one batch ahead and
    the workers more. tests/test_compat.py checks the count at a save inside an epoch; if Lightning renames these,
    that test fails by this function's name."""
    loop = trainer.fit_loop
    save = loop.on_save_checkpoint

    def save_with_position() -> dict:
        loaders = loop._combined_loader.flattened if loop._combined_loader is not None else []
        for loader in loaders:
            if hasattr(loader, "trained_batches"):
                loader.trained_batches = loop.epoch_loop.batch_progress.current.ready
        return save()

    loop.on_save_checkpoint = save_with_position


def resumed_logging_step(checkpoint: dict[str, Any]) -> int | None:
    """The step under which a fit resumed from ``checkpoint`` (a loaded Lightning checkpoint) logs its first row:
    the counter the loggers' rows carry (the training epoch loop's ``_batches_that_stepped``, batches that ended
    in an optimizer step), not ``global_step`` (optimizer steps: more with manual optimization). A checkpoint
    written at a training batch's end (``batch_progress.total``: ``completed`` one behind ``processed``) holds
    it before that batch's increment, which Lightning adds on the resume. None where the checkpoint has no loop
    state. If Lightning renames these, ``metrics.csv`` is cut at the wrong row on a resume."""
    loops = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    stepped = (loops.get("epoch_loop.state_dict") or {}).get("_batches_that_stepped")
    if stepped is None:
        return None
    batches = (loops.get("epoch_loop.batch_progress") or {}).get("total") or {}
    at_batch_end = batches.get("completed") == batches.get("processed", 0) - 1
    return int(stepped) + int(at_batch_end)


def epochs_trained(checkpoint: dict[str, Any]) -> int | None:
    """The epochs whose last batch the fit of ``checkpoint`` (a loaded Lightning checkpoint) trained, as
    ``max_epochs`` counts them on a resume (``epoch_progress.current.processed``, less the epoch ``max_steps``
    ended inside, as ``hold_resumed_epochs`` reopens it); None where the checkpoint has no loop state. If Lightning
    renames these, a finished run is not said to be finished."""
    loops = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs = (loops.get("epoch_progress") or {}).get("current")
    if epochs is None:
        return None
    processed = int(epochs["processed"])
    inside = not (loops.get("epoch_loop.batch_progress") or {}).get("is_last_batch")
    if epochs["ready"] == epochs["started"] == processed > 0 and inside:
        processed -= 1
    return processed


def cluster_environment(trainer: Any) -> Any:
    """The cluster environment Lightning's signal handling consults (``trainer._accelerator_connector``'s), also for
    a single device, where the strategy has none: ``LastCheckpoint`` installs the requeue-signal handler where it is
    a ``SLURMEnvironment`` with ``auto_requeue``. If renamed, a SLURM job's requeue signal saves no last.ckpt."""
    return trainer._accelerator_connector.cluster_environment


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` passes to ``DistributedDataParallel`` when it wraps the model
    (``_ddp_kwargs``), as the live dict: ``configure_ddp`` sets ``broadcast_buffers=False`` in it before the model is
    wrapped. If renamed or copied, DDP overwrites every device's norm statistics with device 0's at each forward."""
    return strategy._ddp_kwargs


def syncs_batchnorm(strategy: Any) -> bool:
    """Whether the strategy converts BatchNorm layers to SyncBatchNorm (``Trainer(sync_batchnorm=True)`` sets its
    ``_layer_sync``; a single-device strategy has none). If renamed, the warning that MABN2d and BatchRenorm2d are
    not converted is never given."""
    return getattr(strategy, "_layer_sync", None) is not None


# -- jsonargparse and argparse -----------------------------------------------------------------------------------


class HelpTextFormatter(argparse.HelpFormatter):
    """argparse's help formatter with one public hook, ``help_text(text)``, applied to descriptions and epilogs
    before they are wrapped (``_format_text``) and to each argument's help once its ``%(default)s`` is expanded
    (``_expand_help``); argparse documents the class's name only, and jsonargparse's formatter extends the same
    two methods. ``python -m mabn``'s help turns docstrings' reStructuredText into plain text there. If either is
    renamed, the help shows the markup (````x````, ``:class:`x```)."""

    def help_text(self, text: str) -> str:
        """``text`` as the help shows it."""
        return text

    def _format_text(self, text: str) -> str:
        return super()._format_text(self.help_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return self.help_text(super()._expand_help(action))


def option_strings(parser: Any) -> list[str]:
    """The ``--`` options an (argparse or jsonargparse) parser accepts (argparse's ``_option_string_actions``): the
    candidates of a misspelt option. If renamed, a misspelt option gets no "did you mean"."""
    return [option for option in parser._option_string_actions if option.startswith("--")]


class ArgumentErrorText(NamedTuple):
    """What jsonargparse's error message says, read from its English text (it carries nothing structured):
    ``unknown``, the words after "unrecognized arguments:"; ``keys``, the ``Parser key`` of each nested block,
    outermost first; ``class_paths`` met; ``refused``, an init argument a class does not accept; of the innermost
    block, ``given`` (the value), ``expected`` (the types, as ``<class 'int'>, ...``) and ``reasons`` (its per-type
    errors that say more than the type they expected). None or empty where the message does not say it."""

    unknown: str | None
    keys: list[str]
    class_paths: list[str]
    refused: str | None
    given: str | None
    expected: str | None
    reasons: list[str]


def argument_error_text(message: str) -> ArgumentErrorText:
    """jsonargparse's (and argparse's) error ``message`` read (see ``ArgumentErrorText``). If a release rewords a
    message, a user's mistake is shown as the message's first line instead of one line naming the argument."""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    refused = re.search(r"Option '([^']+)' is not accepted", message)
    inner = _innermost(message)
    given = re.search(r"(?:Given|Got) value: (.*)", inner)
    expected = re.search(r"Subtypes: \[(.*)\]", inner) or re.search(r"Expected a (<class '[^']+'>)", inner)
    return ArgumentErrorText(
        unknown=unknown.group(1) if unknown else None,
        keys=re.findall(r'Parser key "([^"]+)"', message),
        class_paths=re.findall(r"class_path '([^']+)'", message),
        refused=refused.group(1) if refused else None,
        given=given.group(1).strip() if given else None,
        expected=expected.group(1) if expected else None,
        reasons=_reasons(inner),
    )


def _innermost(message: str) -> str:
    """The block of ``message`` about the innermost key: a class's init argument is reported inside the block of
    its class."""
    lines = message.splitlines()
    start = max((i for i, line in enumerate(lines) if "Parser key" in line), default=0)
    indent = len(lines[start]) - len(lines[start].lstrip()) if lines else 0
    block = lines[start : start + 1]
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:  # a blank line ends no block
            break
        block.append(line)
    return "\n".join(block)


def _reasons(block: str) -> list[str]:
    """The per-type errors (``- ...`` items) of ``block`` that say more than the type they expected (a class name
    that matches two classes, a class that does not import), each with its cause where that is the next line."""
    lines = block.splitlines()
    found = []
    for i, line in enumerate(lines):
        item = line.strip().removeprefix("- ")
        if line.strip().startswith("- ") and not re.match(r"(Expected a|Does not validate|Not a valid)", item):
            if item.endswith(":") and i + 1 < len(lines):  # its cause is the next, deeper line
                item = f"{item} {lines[i + 1].strip()}"
            found.append(item)
    return found


# -- torch -------------------------------------------------------------------------------------------------------

# TorchDispatchMode (re-exported above): the base of a mode that sees every ATen operator call, documented in
# "Extending PyTorch" at this private module's path; the bench's operator counts subclass it. If it moves, the
# bench's operator table cannot be made.


def graphed_callables_take_capture_mode() -> bool:
    """Whether this torch's ``make_graphed_callables`` takes ``capture_error_mode`` (2.12 on)."""
    return "capture_error_mode" in inspect.signature(torch.cuda.make_graphed_callables).parameters


def make_graphed_callables_thread_local(callables: Any, sample_args: Any, **options: Any) -> Any:
    """``torch.cuda.make_graphed_callables(callables, sample_args, **options)`` with every capture it makes in
    thread-local mode: a CUDA call of another thread during the capture (the loader's pin-memory thread pinning a
    batch, DDP's communication threads) then runs instead of failing the capture and the run, as it may in torch's
    default global mode. A torch whose ``make_graphed_callables`` takes ``capture_error_mode`` (2.12 on) is given
    it; an older one (2.1 to 2.11) captures through ``torch.cuda.graph``, whose own ``capture_error_mode`` exists
    since 2.1: ``torch.cuda.graph`` is that class with the mode bound for the duration of the call (captures run
    on one thread at a time). Relies on the older ``make_graphed_callables`` making its graphs through the name
    ``torch.cuda.graph``; if it stops doing so there, its captures run in global mode again."""
    if graphed_callables_take_capture_mode():
        return torch.cuda.make_graphed_callables(callables, sample_args, capture_error_mode="thread_local", **options)
    graph = torch.cuda.graph
    torch.cuda.graph = functools.partial(graph, capture_error_mode="thread_local")
    try:
        return torch.cuda.make_graphed_callables(callables, sample_args, **options)
    finally:
        torch.cuda.graph = graph


def scale_on_device(scaler: torch.amp.GradScaler) -> Tensor:
    """A ``GradScaler``'s current scale as its device tensor (``_get_scale_async``), without the host sync of the
    public ``get_scale()``: ``MABNCallback`` copies it at every backward. If removed, every step waits for the GPU."""
    return scaler._get_scale_async()


def default_store() -> dist.Store:
    """The default process group's key-value store (``distributed_c10d._get_default_store``), which outlives a
    stuck collective: ``FailFast`` posts and watches a failure there. If removed, a failing DDP process leaves the
    others waiting in their next collective until the timeout."""
    return dist.distributed_c10d._get_default_store()


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a nested tuple, list or dict of tensors (``torch.utils._pytree.tree_leaves``; torch has no
    public pytree module): a CUDA-graphed forward's outputs, searched for the node its backward starts from. If
    removed, the graphed training step cannot start."""
    return torch.utils._pytree.tree_leaves(tree)


def mark_static_address(t: Tensor) -> None:
    """Mark ``t`` as a tensor whose address stays (``torch._dynamo.mark_static_address``): ``torch.compile``'s
    reduce-overhead mode replays its CUDA graphs only when every input updated in place is one. If removed, a
    compiled MABN step re-records its graphs (or runs without them) at every step."""
    torch._dynamo.mark_static_address(t)


def foreach_sub_(tensors: list[Tensor], others: list[Tensor]) -> None:
    """``tensors[i] -= others[i]`` for every ``i`` in few kernel launches (``torch._foreach_sub_``, what torch's
    optimizers use). If removed, re-centring a network's conv weights fails."""
    torch._foreach_sub_(tensors, others)


def conv_forward(conv: nn.Conv2d, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``conv``'s forward with ``weight`` in place of its own, its padding mode included (``nn.Conv2d``'s
    ``_conv_forward``): a centred convolution convolves with its centred weight. If renamed, CenConv2d fails."""
    return conv._conv_forward(x, weight, bias)


class DeviceMoves(nn.Module):
    """A module told of every ``to``, ``cuda``, ``to_empty``...: torch routes them all through ``_apply``, which
    calls ``moved(fn)`` here after moving the parameters and buffers (``fn`` maps a tensor to its new one). A
    managed norm makes its flags anew on a new device there. If ``_apply`` is renamed, the flags stay on the old
    device and the first step fails."""

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> DeviceMoves:
        super()._apply(fn, recurse)
        self.moved(fn)
        return self

    def moved(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Called after every move, with the function that moved each tensor."""


# -- Triton ------------------------------------------------------------------------------------------------------


def launch(compiled: Any, grid: tuple[int, int, int], stream: int, args: list[Any], runtime: Any) -> None:
    """Launch ``compiled`` (what ``kernel[grid](...)`` returns, a ``CompiledKernel``) on ``stream`` with ``args``
    as its launcher takes them (pointers as integers, constexprs last), the way Triton's own
    ``CompiledKernel.__getitem__`` runner does, without its per-call driver queries: ``run(*grid, stream,
    function, packed_metadata, launch_metadata(...), enter hook, exit hook, *args)``. ``runtime`` is
    ``triton.knobs.runtime``. If this changes, a launch fails or reads its arguments wrongly: ``mabn.norm.fused``
    probes a launch against torch before any kernel serves, and falls back to the torch ops with a warning."""
    compiled.run(
        *grid, stream, compiled.function, compiled.packed_metadata, compiled.launch_metadata(grid, stream, *args),
        runtime.launch_enter_hook, runtime.launch_exit_hook, *args,
    )  # fmt: skip
