"""What both stages' LightningModules share."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from ..callbacks import NormPolicy, norm_callbacks
from ..errors import ConfigError, UserError
from ..models import DEFAULT_ARCH, Undrawn
from ..norm import check_norm
from ..norm.cenconv import SGDCentring, keep_centred
from ..run import RunPlan, RunShape, file_identity, iterations_per_epoch, plan_shape

if TYPE_CHECKING:  # the planning contract's types
    from ..data.loading import DataPlan
from .cudagraph import (
    GRAPH_SEGMENTS,
    check_capturable,
    check_segments,
    drop_graph_gradients,
    release_graphs,
    training_call,
    why_not_capturable,
)
from .memory import MemoryPlan, NetworkSizes, network_sizes


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """The defaults of the constructors of ``cls`` and its ``NormTask`` bases, a subclass's over its base's."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if isinstance(klass, type) and issubclass(klass, NormTask):
            for name, parameter in inspect.signature(klass.__init__).parameters.items():
                if parameter.default is not inspect.Parameter.empty:
                    found[name] = parameter.default
    return found


# The networks this process planned, by task class and arguments (``NormTask.planned_sizes``): four integers each.
_PLANNED: dict[tuple[type, str, tuple], NetworkSizes] = {}


def _files_named(hp: Mapping[str, Any]) -> tuple:
    """(argument, ``file_identity``) of each file an argument names (a backbone, a warm start): a plan of the same
    arguments after such a file was rewritten or replaced, or from another folder where a relative path names
    another file, reads it again."""
    return tuple(
        (name, file_identity(value))
        for name, value in sorted(hp.items())
        if isinstance(value, str | os.PathLike) and os.path.isfile(value)
    )


def _bytes(values: Iterable[Any]) -> int:
    """The bytes of the tensors among ``values`` (a state dict's, an optimizer state's: counts are not tensors)."""
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))


def require(ok: bool, name: str, value: Any, wanted: str) -> None:
    """A ``ConfigError`` naming the argument, its value and what would work, unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name}={value!r}: {wanted}")


@contextlib.contextmanager
def _silent() -> Iterator[None]:
    """No warning and no log line below WARNING within (torch's for each weight a meta tensor takes no value from,
    the task's on what it loads)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.INFO)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


class NormTask(pl.LightningModule):
    """A LightningModule around ``self.model`` whose norms may be callback-managed (MABN2d, BatchRenorm2d).

    With the ``cuda_graph`` hyperparameter true, the model's training forward and backward are captured as
    CUDA graphs at the first training batch of each fit and replayed afterwards (``mabn.tasks.cudagraph``); ``auto``
    (the default) does so when the fit runs on a GPU, the model can be captured and ``compile`` is unset, and
    otherwise trains eagerly and says why in one line at fit start. With ``compile``
    (true: torch.compile's default mode; or a mode name such as ``reduce-overhead``, which adds CUDA graphs),
    they run as one ``torch.compile`` graph each, compiled at the first training batch; that batch's time is
    reported. Evaluation stays eager.

    With SGD and no gradient clipping (the paper's recipe) the centred convs' weights are re-centred in place after
    every optimizer step, and their forwards run as plain convolutions: the same weights, fewer operations per
    step (``mabn.norm.cenconv``); any other optimizer keeps the centring in the forward.

    The arguments both stages share (each task adds its own and passes these on):

    - ``norm``: one of ``mabn.norm.NORM_PRESETS``; ``norm_batch_size``: samples per normalization (ghost) batch;
      ``norm_options``: layer arguments by norm kind (e.g. ``{mabn: {buffer_size: 16}}``);
    - ``norm_policy``: how MABNCallback drives MABN2d/BatchRenorm2d (phases per module group, resets, statistics
      logging), a ``mabn.callbacks.NormPolicy``; unset: its defaults;
    - ``momentum``, ``weight_decay``: SGD's;
    - ``cuda_graph`` (true, false or auto), ``graph_segments``, ``compile``: as above;
    - ``arch``: the encoder (default resnet101, the paper's): a ResNet depth of ``mabn.models.ARCHS`` for stage 1,
      any smp encoder name or ``tu-<timm model>`` for stage 2.

    Args:
        norm: the normalization layer by name, one of ``mabn.norm.NORM_PRESETS`` (e.g. ``mabn``, ``bn``, ``brn``,
            ``syncbn``, ``gn``).
        norm_batch_size: samples per normalization (ghost) batch: each device's batch is normalized in groups of
            this many; null: over the device's whole batch (``syncbn``: over every device's, and needs null).
        norm_options: layer arguments by norm kind, e.g. ``{mabn: {momentum: 0.98, buffer_size: 16}}``; a momentum
            is the weight of the old value (the paper's convention).
        norm_policy: how MABNCallback drives MABN2d and BatchRenorm2d: phases per module group, resets and
            statistics logging (docs/mabn-callback.md; ``--model.help <task> --model.norm_policy.help`` lists the
            settings); null: the defaults.
        momentum: SGD's momentum, in [0, 1).
        weight_decay: SGD's weight decay (L2 factor), applied to every parameter; >= 0.
        cuda_graph: run the training forward and backward as CUDA graphs captured at the first training batch:
            true (stop with an error where they cannot be), false (eager), auto (where possible, else eager).
        graph_segments: how ``cuda_graph`` captures the step: ``whole`` (one graph per direction) or ``stages``
            (one per ResNet stage and one for the heads, so that DDP's all-reduce of a segment's gradients
            overlaps the earlier segments' backward; stage 1's ResNet and PSPNet on a ResNet encoder, any other
            model is an error).
        compile: ``torch.compile`` the training forward and backward at the first training batch: true (the default
            mode), a mode name such as ``reduce-overhead``, or false (eager).
        arch: the encoder: stage 1 a ResNet depth of ``mabn.models.ARCHS`` (``resnet18`` to ``resnet152``), stage 2
            any smp encoder name or ``tu-<timm model>`` (docs/models.md).
    """

    model: torch.nn.Module
    _first_step_started: float | None = None  # when the first compiled training step began (host clock)
    # Init arguments that change how a run runs, not what it trains: a resume takes them as given
    # (mabn.cli.plan.run_settings).
    run_settings: frozenset[str] = frozenset({"cuda_graph", "graph_segments", "compile"})
    _first_step_reported = False
    _centring: list[SGDCentring] = []  # per optimizer, while a fit runs
    _graphed_fit: bool | None = None  # ``cuda_graph`` as resolved at fit start; None before the first fit
    planned: RunPlan | None = None  # the plan the fit runs (``fit_plan``); None before a fit configured its optimizer

    def __init__(
        self,
        norm: str = "mabn",
        norm_batch_size: int | None = 2,
        norm_options: dict[str, dict[str, Any]] | None = None,
        norm_policy: NormPolicy | None = None,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        cuda_graph: bool | Literal["auto"] = "auto",
        graph_segments: Literal["whole", "stages"] = "whole",
        compile: bool | str = False,
        arch: str = DEFAULT_ARCH,
    ) -> None:
        super().__init__()
        # Lightning collects the arguments of every __init__ up the chain: the task's own and these.
        self.save_hyperparameters()
        policy = self.hparams["norm_policy"]
        if policy is not None:
            # Checked here for Python callers (LightningCLI has checked it already), and kept as plain values: a
            # checkpoint's hyperparameters are read weights-only, which refuses a dataclass.
            self.hparams["norm_policy"] = NormPolicy.parse(policy).as_dict()
        self.check_hparams(self.hparams)

    @classmethod
    def settings(cls, hp: Mapping[str, Any]) -> Mapping[str, Any]:
        """The init arguments ``hp`` over the task's defaults (its constructor's and those of the ``NormTask``
        constructors up its chain), read-only: what the planning methods (``check_hparams``, ``run_plan``,
        ``memory_plan``, ``loss_lines``) read, so that each default lives in one place, a constructor's signature.
        The parsed configuration and a task's ``hparams`` hold them all; a mapping of Python's may hold a few."""
        return MappingProxyType({**_defaults(cls), **hp})

    @classmethod
    def check_hparams(cls, hp: Mapping[str, Any]) -> None:
        """Refuse arguments that cannot train, before any data or weights are read (the CLI calls this on the
        parsed config; ``__init__`` on its own arguments). Subclasses add their own."""
        hp = cls.settings(hp)
        norm = hp["norm"]
        try:
            check_norm(norm)
        except ValueError as err:
            raise ConfigError(f"norm={norm!r}: {err}") from None
        size = hp["norm_batch_size"]
        require(size is None or (isinstance(size, int) and size >= 1), "norm_batch_size", size, "must be >= 1")
        if "base_lr" in hp:  # each stage's (its lr at the base batch)
            require(hp["base_lr"] > 0, "base_lr", hp["base_lr"], "must be > 0")
        require(0 <= hp["momentum"] < 1, "momentum", hp["momentum"], "must be in [0, 1)")
        require(hp["weight_decay"] >= 0, "weight_decay", hp["weight_decay"], "must be >= 0")
        graph = hp["cuda_graph"]
        # isinstance, not `in (True, False, "auto")`: 1 == True would let 0 and 1 through.
        require(isinstance(graph, bool) or graph == "auto", "cuda_graph", graph, "choose true, false or auto")
        segments = hp["graph_segments"]
        require(segments in GRAPH_SEGMENTS, "graph_segments", segments, f"choose {' or '.join(GRAPH_SEGMENTS)}")

    @property
    def cuda_graph(self) -> bool:
        """Whether the training forward and backward run as CUDA graphs: the ``cuda_graph`` hyperparameter as
        ``on_fit_start`` resolved it for this fit. Everything that asks (``training_forward``, MABNCallback) reads
        this, never the hyperparameter, which may be the string "auto". Before any fit only ``true`` captures."""
        if self._graphed_fit is None:
            return self.hparams["cuda_graph"] is True
        return self._graphed_fit

    @property
    def graph_segments(self) -> str:
        """How ``cuda_graph`` captures the training step: ``whole`` or ``stages`` (``graph_training_forward``)."""
        return self.hparams["graph_segments"]

    @property
    def compile_mode(self) -> str | None:
        """The ``torch.compile`` mode of the training forward and backward, or None (eager)."""
        value = self.hparams["compile"]
        return "default" if value is True else value or None

    def on_fit_start(self) -> None:
        # Graphs of an earlier fit read that fit's tensors (MABNCallback's loss scale, freed with it, or none): this
        # fit captures its own at its first training batch, or trains eagerly.
        release_graphs(self.model)
        # Whether or not this fit captures: a model the setting cannot split is an error wherever it trains.
        check_segments(self.model, self.graph_segments)
        # Here, not in __init__: only now are the device and the process group (which decides whether a
        # synchronized norm communicates) known.
        self._graphed_fit = self._resolve_cuda_graph()

    def _resolve_cuda_graph(self) -> bool:
        setting = self.hparams["cuda_graph"]
        if setting is True:
            # Asked for explicitly: an impossible capture is an error, before any data is loaded.
            if self.compile_mode:
                raise ValueError(
                    "cuda_graph and compile are two ways to the same end: set one (compile: reduce-overhead gives "
                    "CUDA graphs through torch.compile)"
                )
            check_capturable(self.model, self.device)
            return True
        if setting != "auto":
            return False
        # auto is the default, so it must train wherever eager training does: it never fails. It names the path it
        # took because on a GPU the two differ much in speed (eager MABN steps are bound by kernel launches).
        # compile wins: it was asked for by name, auto was not.
        if self.compile_mode:
            rank_zero_info("cuda_graph auto: no CUDA-graph capture (compile is set; torch.compile runs the step)")
            return False
        why = why_not_capturable(self.model, self.device)
        if why is not None:
            rank_zero_info(f"cuda_graph auto: eager training step ({why})")
            return False
        rank_zero_info(
            "cuda_graph auto: the training forward and backward run as CUDA graphs (captured at the first "
            "training batch)"
        )
        return True

    def on_train_start(self) -> None:
        # After the checkpoint's weights and optimizer state are restored: they are centred once, here.
        if not self.trainer.gradient_clip_val:
            handles = (keep_centred(self.model, opt) for opt in self.trainer.optimizers)
            self._centring = [h for h in handles if h is not None]

    def on_train_end(self) -> None:
        for handle in self._centring:
            handle.remove()
        self._centring = []

    @functools.cached_property
    def _compiled_model(self) -> Callable[[torch.Tensor], object]:
        # A cached property lives in the instance's __dict__, not among the submodules: the state dict does not
        # hold the weights twice. fullgraph: a graph break is an error, not a silent loss of the fusion.
        return torch.compile(self.model, fullgraph=True, mode=self.compile_mode)

    def training_forward(self, images: torch.Tensor) -> object:
        """``self.model(images)`` in a training step: captured at the first call with ``cuda_graph``, compiled
        at the first call with ``compile``."""
        if self.compile_mode:
            return self._compiled_model(images)
        return training_call(self.model, images, self.cuda_graph, self.graph_segments)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        # The step has used the gradients: under CUDA graphs let go of those held in the graphs' static buffers, so
        # that the next replay has none to move out (zero_grad would set them to None after the next forward).
        drop_graph_gradients(self.model)

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if self.compile_mode and self._first_step_started is None:
            self._first_step_started = time.perf_counter()

    def _log_step(self, training: bool) -> None:
        """The step and epoch of this row for every logger: the optimizer steps done, as the console, checkpoint
        names and the norm statistics count them. Lightning's own count for a training row or a validation is the
        batches stepped before the current one (a validation after 2 steps at step 1); a logged ``step`` replaces
        it, and then Lightning adds no ``epoch``."""
        self.log_dict(
            {"step": self.global_step, "epoch": self.current_epoch},
            on_step=training, on_epoch=not training, batch_size=1, rank_zero_only=True,
        )  # fmt: skip

    def on_validation_epoch_start(self) -> None:
        self._log_step(training=False)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self._log_step(training=True)
        if self._first_step_started is not None and not self._first_step_reported:
            # The first compiled step: compiling its forward and backward is most of its time.
            self._first_step_reported = True
            seconds = time.perf_counter() - self._first_step_started
            rank_zero_info(f"torch.compile (mode {self.compile_mode}): first training step {seconds:.1f} s")
            self.log("compile_first_step_s", seconds, on_step=True, on_epoch=False, rank_zero_only=True)

    def configure_callbacks(self) -> list[pl.Callback]:
        # Models without managed norms get no MABNCallback.
        return norm_callbacks(self.model, self.hparams["norm_policy"], steps_done=True)  # ``_log_step``

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """The fit's optimizer at the encoder's ``lr``: SGD with the task's momentum and weight decay (each stage
        says over which parameter groups)."""
        raise NotImplementedError(f"{type(self).__name__} makes no optimizer")

    @classmethod
    def build_unweighted(cls, hp: Mapping[str, Any]) -> NormTask:
        """The task of the init arguments ``hp`` as a fit builds it (its constructor: encoder, decoder, norms, the
        backbone's fit), its tensors on torch's meta device, with shapes and no values, then the checks the fit's
        setup runs on it (``check_setup``): what a dry run checks and sizes. A model whose construction reads
        tensor values (the drop-path rates of smp's mix transformers, ``mit_b*``) cannot be built there and is
        built on the CPU, the same construction."""
        # The fit's own build says what it builds and loads, once. No initial values are drawn (Undrawn): meta
        # tensors hold none, yet torch would still run each draw's steps. torch's generator stays the fit's: the fit
        # seeds it before its checks and builds its model after them.
        with _silent(), torch.random.fork_rng(devices=[]), Undrawn():
            try:
                with torch.device("meta"):
                    task = cls(**hp)
            except UserError:
                raise
            except Exception:  # values read on the meta device: whatever fails on the CPU too is the fit's error
                task = cls(**hp)
        task.check_setup()
        return task

    @classmethod
    def planned_sizes(cls, hp: Mapping[str, Any]) -> NetworkSizes:
        """The task of the init arguments ``hp`` built and checked as ``build_unweighted`` does, and its sizes:
        what a dry run (and a fit's check) needs of its network. One build per network and process: a process that
        plans many runs (a sweep, the tests) builds each once, and the files the arguments name are part of the
        network (``_files_named``). A check that fails is raised each time, never kept."""
        key = (cls, json.dumps(dict(hp), sort_keys=True, default=repr), _files_named(hp))
        if key not in _PLANNED:
            task = cls.build_unweighted(hp)
            _PLANNED[key] = NetworkSizes(*network_sizes(task.model), *task.checkpoint_bytes())
        return _PLANNED[key]

    def check_setup(self) -> None:
        """The checks a fit's setup runs on the model before any data: the norm callbacks' hold on its layers
        (MABNCallback's groups and logged layers, ``bind``) and the graph segments; a ``ConfigError`` naming the
        setting."""
        for callback in self.configure_callbacks():
            bind = getattr(callback, "bind", None)
            if bind is not None:
                bind(self)
        check_segments(self.model, self.graph_segments)

    def checkpoint_bytes(self) -> tuple[int, int]:
        """(the bytes of the model's state dict, those of the optimizer's state after a step), as the fit's
        checkpoint holds them: computed from the tensors (meta ones included) and from the fit's own optimizer
        (``make_optimizer``) stepped once over stand-ins of the trainable parameters."""
        weights = _bytes(self.state_dict().values())
        optimizer = self.make_optimizer(0.0)
        # A parameter's state after a step depends on its shape, dtype and group alone: the optimizer steps one
        # stand-in of each kind (on the meta device, with a zero gradient), whose state counts for every parameter
        # of its kind. A ResNet-101 has a few hundred parameters of a few dozen kinds.
        kinds = []
        for group in optimizer.param_groups:
            kind = Counter((tuple(p.shape), p.dtype) for p in group["params"] if p.requires_grad)
            group["params"] = [torch.zeros(s, dtype=d, device="meta", requires_grad=True) for s, d in kind]
            for stand_in in group["params"]:
                stand_in.grad = torch.zeros_like(stand_in)
            kinds.append(kind.values())
        optimizer.step()
        extra = 0
        for group, counts in zip(optimizer.param_groups, kinds):
            for stand_in, count in zip(group["params"], counts):
                extra += count * _bytes(optimizer.state.get(stand_in, {}).values())
        return weights, extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @classmethod
    def run_plan(cls, hp: Mapping[str, Any], shape: RunShape) -> RunPlan:
        """The run's lr and schedule for ``shape`` and the lines that say them: what ``--dry-run`` prints and what
        the fit runs (``fit_plan``). Each stage has its own."""
        raise NotImplementedError(f"{cls.__name__} plans no lr schedule")

    @classmethod
    def memory_plan(
        cls,
        hp: Mapping[str, Any],
        network: NetworkSizes,
        per_device: int,
        global_batch: int,
        cuda: bool,
        per_node: int,
        crop: int | None,
    ) -> MemoryPlan | None:
        """The dry run's estimate of the memory per device for the arguments ``hp`` (their ``network``'s
        ``planned_sizes``) and the per-device batch that fits it (``mabn.tasks.memory.plan``); None where the task
        estimates none."""
        return None

    @classmethod
    def loss_lines(cls, hp: Mapping[str, Any], plan: DataPlan) -> list[str]:
        """The dry run's lines on the loss once the data module's ``plan`` is known; none where the loss takes
        nothing from the data."""
        return []

    def fit_plan(self) -> RunPlan:
        """The fit's ``run_plan``, from the shape ``plan_shape`` computes off the Trainer (the dry run's computation
        from the configuration), said in its lines and kept as ``planned`` (call from ``configure_optimizers``: it
        loads the train loader). A ``ConfigError`` where the shape is not what Lightning runs: a loader of another
        length (its own sampler, a last partial batch kept) would move the schedule off the run's iterations."""
        trainer = self.trainer
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()
        loader = trainer.train_dataloader
        if math.isinf(trainer.num_training_batches) or not hasattr(loader.dataset, "__len__"):
            raise ConfigError("the schedule is in epochs: the training data loader must have a length")
        shape = plan_shape(
            trainer.datamodule.batch_size,
            trainer.world_size,
            trainer.accumulate_grad_batches,
            self.hparams["norm_batch_size"],
            len(loader.dataset),
            trainer.max_epochs,
            trainer.max_steps,
            trainer.limit_train_batches,
        )
        lightning = iterations_per_epoch(trainer.num_training_batches, trainer.accumulate_grad_batches)
        if (shape.iterations_per_epoch, shape.total_iterations) != (lightning, trainer.estimated_stepping_batches):
            raise ConfigError(
                f"the training loader gives {lightning} iterations per epoch and {trainer.estimated_stepping_batches} "
                f"in total, the plan of {shape.samples} samples in batches of {shape.per_device} on "
                f"{shape.devices} device(s) {shape.iterations_per_epoch} and {shape.total_iterations}: the loader "
                "must spread the samples over the devices and drop its last partial batch"
            )
        self.planned = self.run_plan(self.hparams, shape)
        rank_zero_info("\n".join(self.planned.lines))
        return self.planned
