"""The stage launches (``python -m mabn pretrain|cityscapes|segment``, ``mabn.cli.commands.stage``): the profile, the
trainer preset and the run's folder, decided once into a ``LaunchPlan`` before the LightningCLI parses.

With ``--data`` a stage runs the paper's recipe from ``configs/`` on that dataset (``segment``: stage 2's recipe on
a dataset of the user's own, ``mabn.data.folder``), and a ``--data`` that is not the expected layout is an error
naming the missing folder; without ``--data`` it says so, generates a small set in the same on-disk layout (once)
and runs the demo profile, which trains for a few minutes on a CPU. The demo writes only under ``runs/demo/``,
``pretrain/demo/`` and ``data/``, never where a real run's artefacts live.

Each run's experiment folder is ``runs/<stage>/<norm>`` (``runs/segment/<dataset>-<digest>/<norm>`` for a dataset
of one's own, ``dataset_name``; ``runs/demo/<stage>/<norm>`` for the demo; ``--run-dir`` picks another), see
``mabn.run.folder``. ``--gpus``
(per node) and ``--nodes`` pick a preset from ``configs/trainer/`` (cpu, gpu, ddp, multinode) and set the Trainer's
devices and num_nodes; on a machine without CUDA, ``--gpus N`` runs N CPU processes under DDP instead.
"""

from __future__ import annotations

import hashlib
import importlib
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import yaml

from ..data.loading import DataLayout
from ..data.once import generate_once
from ..distributed import launch_rank, say
from ..errors import ConfigError, UserErrors
from ..models.backbone import warm_norm
from ..norm import check_norm, norm_entry
from ..recipes import CONFIGS, class_at
from ..tasks.classification import backbone_path

DEMO_DATA = Path("data")
RUNS = Path("runs")
BACKBONES = Path("pretrain")
DEMO = "demo"  # the folder under runs/ and pretrain/ that holds the demo profile's artefacts
NO_BACKBONE = "none"  # --backbone none: stage 2's encoder from random weights, on purpose
DEMO_WAIT_S = 1800  # how long the processes of other nodes wait for process 0 to generate the demo set
STAGE2 = ("cityscapes", "segment")  # the stages that fine-tune a stage-1 backbone
# Stage 1 started from a BN network (INIT=<file>, beyond the paper): its config after the recipe's, and the suffix of
# its run's name and the folder of its backbone, apart from the runs from scratch (docs/backbones.md).
WARM_CONFIG = "pretrain-warm.yaml"
WARM = "warm"


class LaunchError(ConfigError):
    """A launch that cannot work as asked; the message says why and what to change."""


class LaunchErrors(UserErrors, LaunchError):
    """Every independent problem of a launch at once (data, norm, backbone, devices, the launcher's layout, the
    LightningCLI's own check): ``messages``, one line each; the message of a single problem is that line."""


def _demo_set(root: Path, generate: Callable[[Path], Path], marker: str) -> Path:
    """Generate the demo set once (``generate_once``: a lock serializes the processes of one machine). On
    other nodes, whose disk may be shared without a working lock, processes wait for process 0's marker."""
    if launch_rank() != 0:
        deadline = time.monotonic() + DEMO_WAIT_S
        while not (root / marker).is_file():
            if time.monotonic() > deadline:
                raise LaunchError(f"waited {DEMO_WAIT_S} s for process 0 to generate the demo set in {root}")
            time.sleep(2)
    return generate_once(root, generate, say)


@dataclass(frozen=True)
class Profile:
    """A stage: its recipe ``config`` (after the ``base`` configs it builds on) and the data module that config names,
    whose ``layout`` (``mabn.data.loading.DataLayout``) says which folders (and files) make ``--data`` its dataset,
    and without ``--data`` the message and the demo set that replaces it (then each config's ``configs/demo/``
    version follows, where there is one)."""

    config: str
    base: tuple[str, ...] = ()  # configs read before ``config`` (segment: cityscapes.yaml's recipe)

    @cached_property
    def layout(self) -> DataLayout:
        """The layout of the data module the stage's configs name (the last that names one, by class path)."""
        class_path = None
        for name in (*self.base, self.config):
            data = (yaml.safe_load((CONFIGS / name).read_text()) or {}).get("data") or {}
            class_path = data.get("class_path", class_path)
        return class_at(class_path).layout

    @property
    def demo(self) -> str:
        """The folder of its demo set under data/ (``demo-<generator>``)."""
        return f"demo-{self.layout.demo}"

    def resolve(self, data: Path | None) -> tuple[list[str], Path]:
        """(the configs to run, the data root): the demo's without ``data``; a ``data`` that is not the layout
        is an error naming the first missing folder or file."""
        configs = [*self.base, self.config]
        if data is not None:
            if not data.is_dir():
                raise LaunchError(f"DATA={data}: no such folder (expected {self.expected})")
            for folder in self.layout.folders:
                if not (data / folder).is_dir():
                    raise LaunchError(f"DATA={data}: missing folder {data / folder} (expected {self.expected})")
            for name in self.layout.files:
                if not (data / name).is_file():
                    raise LaunchError(f"DATA={data}: missing file {data / name} (expected {self.expected})")
            return configs, data
        say(self.layout.missing)
        demo = [f"demo/{name}" for name in configs if (CONFIGS / "demo" / name).is_file()]
        return configs + demo, DEMO_DATA / self.demo

    @property
    def expected(self) -> str:
        return ", ".join([*(f"{folder}/..." for folder in self.layout.folders), *self.layout.files])

    def generate_demo(self, root: Path) -> Path:
        generator = importlib.import_module(f"mabn.data.synthetic.{self.layout.demo}")
        return _demo_set(root, generator.generate, generator.MARKER)


# The stages of ``python -m mabn``; their data modules (named in the configs) declare their datasets' layouts.
PROFILES = {
    "pretrain": Profile("pretrain.yaml"),
    "cityscapes": Profile("cityscapes.yaml"),
    "segment": Profile("segment.yaml", base=("cityscapes.yaml",)),
}


@dataclass(frozen=True)
class Stage1Preset:
    """A stage-1 run of a norm under a name of its own: its own experiment folder and backbone folder. ``config``
    (a file of configs/, and its configs/demo/ version for the demo profile) and ``args`` follow the profile's."""

    norm: str
    description: str
    stage2_norms: str  # the stage-2 norms that start from its backbone
    args: tuple[str, ...] = ()
    config: str | None = None

    def configs(self, demo: bool) -> list[str]:
        if self.config is None:
            return []
        return [self.config] + ([f"demo/{self.config}"] if demo and (CONFIGS / "demo" / self.config).is_file() else [])


BN_EXPORT = "bn32"  # the stage-1 preset whose BN backbone starts a norm without an export of its own (frozenbn)
STAGE1_PRESETS = {
    # The paper's BN backbone (its Cityscapes BN, BRN and SyncBN rows all start from it) normalizes over each
    # device's batch of 32: pretrain/bn32/resnet101-bn.pt, never to be taken for the bn backbone at
    # normalization batch 2 (pretrain/resnet101-bn.pt).
    "bn32": Stage1Preset(
        "bn",
        "BN over each device's batch of 32",
        "bn, brn, syncbn or frozenbn",
        ("--model.init_args.norm_batch_size", "null"),
    ),
    # MABN on the official detection code's timeline instead of the ImageNet code's (docs/design.md).
    "mabn-det": Stage1Preset(
        "mabn", "MABN on the detection code's timeline", "mabn", config="pretrain-detection-timeline.yaml"
    ),
}


def trainer_args(gpus: int, nodes: int, cuda: bool | None = None) -> list[str]:
    """Trainer preset and flags for ``gpus`` per node on ``nodes`` nodes (``cuda``: default, whether CUDA is
    available here; without it the devices become CPU processes)."""
    if gpus < 0 or nodes < 1:
        raise LaunchError(f"GPUS must be >= 0 and NODES >= 1, got GPUS={gpus}, NODES={nodes}")
    if gpus == 0 and nodes > 1:
        raise LaunchError(f"NODES={nodes} needs GPUS >= 1 (the GPUs per node); GPUS=0 is one CPU process")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if gpus == 0:
        return ["--trainer", str(CONFIGS / "trainer" / "cpu.yaml")]
    preset = "gpu" if gpus * nodes == 1 else "ddp" if nodes == 1 else "multinode"
    args = ["--trainer", str(CONFIGS / "trainer" / f"{preset}.yaml")]
    args += ["--trainer.devices", str(gpus), "--trainer.num_nodes", str(nodes)]
    if not cuda:
        per_node = " per node" if nodes > 1 else ""
        how = "DDP over gloo" if gpus * nodes > 1 else "one process"
        say(f"No CUDA device here: GPUS={gpus} runs as {gpus} CPU process(es){per_node} ({how}).")
        args += ["--trainer.accelerator", "cpu"]
    return args


def norm_args(norm: str, gpus: int, nodes: int, cuda: bool | None = None) -> list[str]:
    """A norm that synchronizes across devices (its entry's ``sync``: syncbn): Lightning's ``sync_batchnorm``,
    refused where SyncBatchNorm cannot synchronize anything."""
    if not norm_entry(norm).sync:
        return []
    if gpus * nodes < 2:
        raise LaunchError(
            f"NORM={norm} synchronizes BatchNorm across GPUs, but GPUS={gpus} NODES={nodes} is "
            f"{'no GPU' if gpus == 0 else 'one device'}: use NORM=bn, or GPUS=2 or more"
        )
    if not (torch.cuda.is_available() if cuda is None else cuda):
        raise LaunchError(
            f"NORM={norm} needs GPUs (torch's SyncBatchNorm has no CPU kernel) and no CUDA device is visible: "
            "use NORM=bn, brn or mabn (norm_options sync_stats: true shares MABN/BRN statistics across devices)"
        )
    return ["--trainer.sync_batchnorm", "true"]


def check_cluster(gpus: int, nodes: int) -> str | None:
    """Check the devices against the launcher's process layout (SLURM or torchrun) with Lightning's own
    rules, so a mismatch stops here with a hint instead of hanging at the first collective. Returns a line
    describing the environment, or None outside those launchers."""
    from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    devices = max(gpus, 1)
    for env, hint in (
        (SLURMEnvironment, "submit with --ntasks-per-node=GPUS and --nodes=NODES (scripts/slurm/submit.sh does)"),
        (TorchElasticEnvironment, "start torchrun with --nproc_per_node=GPUS and --nnodes=NODES"),
    ):
        if env.detect():
            try:
                env().validate_settings(num_devices=devices, num_nodes=nodes)
            except (ValueError, RuntimeError) as err:
                raise LaunchError(f"{err} ({hint})") from err
            return f"{env.__name__}: {nodes} node(s) x {devices} process(es) agree with the launcher"
    return None


def stage2_backbone(norm: str, backbone: str | Path | None, demo: bool, pending: bool = False) -> tuple[list[str], str]:
    """Where stage 2's encoder starts: (the LightningCLI arguments, the line that says so). ``backbone`` is a
    file, ``none`` (random weights on purpose) or None: stage 1's export for the same norm and profile, which a
    real run requires (``pending``: a job queued after stage 1's writes it first) and the demo uses if present."""
    if backbone is not None and str(backbone) == NO_BACKBONE:
        return [], "Backbone: none (BACKBONE=none): the encoder starts from random weights"
    if backbone is not None:
        if not Path(backbone).is_file():
            raise LaunchError(f"BACKBONE={backbone}: no such file")
        return ["--model.init_args.backbone", str(backbone)], f"Backbone: {backbone} (BACKBONE=...)"
    root = BACKBONES / DEMO if demo else BACKBONES
    # A norm whose layers learn nothing (frozenbn) has no stage-1 export of its own: it starts from the paper's BN one.
    export = BN_EXPORT if norm_entry(norm).frozen else norm
    path = backbone_path(root / export, "bn") if export == BN_EXPORT else backbone_path(root, norm)
    source = f"Backbone: {path}, stage 1's export for NORM={export}"
    if path.is_file():
        return ["--model.init_args.backbone", str(path)], f"{source} (BACKBONE=... picks another)"
    if pending:
        return [], f"{source}, to be written by the stage-1 job this one waits for"
    if demo:
        return [], f"Backbone: none ({path} not found: make pretrain NORM={export} writes it); random encoder weights"
    raise LaunchError(
        f"no stage-1 backbone {path}: run stage 1 first (make pretrain NORM={export} DATA=<imagenet>), give one "
        f"with BACKBONE=<file>{_bn_routes(norm)}, or BACKBONE=none (--backbone none) to train the encoder from "
        "random weights"
    )


def _bn_routes(norm: str) -> str:
    """The missing-backbone error's starts from BN weights a user may have (torchvision's or timm's ResNet)."""
    weights = "BACKBONE=<a torchvision or timm ResNet state dict, or a stage-1 bn file>"
    if warm_norm(norm):
        return f", start from BN weights ({weights}: converted to {norm}; or NORM=bn with them as they are)"
    if norm_entry(norm).takes_bn_statistics:
        return f", start from BN weights ({weights}: loaded as they are)"
    return f", start from BN weights with NORM=bn ({weights})"


def check_warm_start(stage: str, name: str, preset: Stage1Preset | None, init: str | Path) -> bool:
    """Whether ``init`` (INIT=<file>) can start this launch as a warm start; a ``LaunchError`` saying why not. The
    file's content and its fit to the norm are the task's check (``mabn.models.warm_start.check_init``)."""
    if stage != "pretrain":
        raise LaunchError(
            f"INIT={init}: a warm start is stage 1's (make pretrain NORM=mabn INIT=<file>); stage 2 starts its encoder "
            "from BACKBONE=<file>"
        )
    if preset is not None:
        raise LaunchError(
            f"INIT={init} with NORM={name}: a warm start runs its own timeline and epochs (configs/{WARM_CONFIG}); "
            "use NORM=mabn"
        )
    if not Path(init).is_file():
        raise LaunchError(f"INIT={init}: no such file")
    return True


def dataset_name(data: Path) -> str:
    """A dataset of one's own's name in its runs' folder: its folder's name and 8 hex digits of its resolved path,
    ``seg-1f0c9a2b``, so that two data folders of one name (``v1/seg``, ``v2/seg``) never share a run folder."""
    resolved = data.resolve()
    return f"{resolved.name or 'root'}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}"


def run_dir(stage: str, norm: str, demo: bool, given: Path | None, data: Path | None = None) -> Path:
    """The experiment folder: ``given``, else runs/<stage>/<norm> (runs/demo/... for the demo profile); a dataset
    of one's own (``segment``) adds its name (``dataset_name``), runs/segment/<dataset>-<digest>/<norm>, so that
    two datasets' runs never share a folder."""
    if given is not None:
        return given
    if demo:
        return RUNS / DEMO / stage / norm
    if stage == "segment" and data is not None:
        return RUNS / stage / dataset_name(data) / norm
    return RUNS / stage / norm


@dataclass(frozen=True)
class LaunchPlan:
    """What a stage launch runs, decided before the LightningCLI parses its configuration (``plan``)."""

    stage: str
    name: str  # the run's name: its norm, or a stage-1 preset (bn32, mabn-det)
    profile: Profile
    demo: bool  # no --data: the demo profile on a generated set
    data_dir: Path
    run_dir: Path
    trainer_args: tuple[str, ...]  # the trainer preset and its flags (devices, nodes, accelerator, sync_batchnorm)
    backbone_args: tuple[str, ...]  # stage 2: where its encoder starts; stage 1: the warm start's file
    resume: str | None
    args: tuple[str, ...]  # the LightningCLI arguments: "fit", the configs, the settings above, the user's extra
    launcher: str | None  # the SLURM or torchrun layout the devices agree with (``check_cluster``)

    @property
    def command(self) -> str:
        return "python -m mabn " + shlex.join(self.args)

    def prepare_data(self) -> None:
        """The demo set, generated once (process 0 writes it; the other processes of the launch wait for it)."""
        if self.demo:
            self.profile.generate_demo(self.data_dir)


def plan(*args: Any, **kwargs: Any) -> LaunchPlan:
    """The plan of a stage run, from ``checked_plan``'s arguments; ``LaunchErrors`` (a ``LaunchError``) for a
    launch that cannot work, naming every problem."""
    found, problems = checked_plan(*args, **kwargs)
    if problems:
        raise LaunchErrors(problems)
    return found


def checked_plan(
    stage: str,
    data: Path | None,
    norm: str,
    gpus: int,
    nodes: int,
    extra: list[str],
    backbone: str | Path | None = None,
    resume: str | None = None,
    dry_run: bool = False,
    folder: Path | None = None,
    backbone_pending: bool = False,
    init: str | Path | None = None,
) -> tuple[LaunchPlan, list[str]]:
    """The plan of a stage run (the demo profile without ``data``) and its checks; nothing is generated or read here
    but file names. ``dry_run`` assumes a GPU machine; ``backbone_pending`` (with it): stage 1 writes the backbone
    before this run starts; ``init``: stage 1's warm start from that BN network's file. Each check is independent
    of the others' outcome: (the plan, the problems, one line each, in the order launcher, norm, warm start,
    devices, data, backbone). Where a check failed the plan holds a stand-in
    (the given data folder, or a folder inside it that is not there, norm mabn, one CPU process, no backbone), so
    that the LightningCLI can still check the rest without reporting the same problems again."""
    problems: list[str] = []

    def attempt(check: Callable[[], Any], stand_in: Any = None) -> Any:
        try:
            return check()
        except LaunchError as err:
            problems.append(str(err))
            return stand_in

    launcher = attempt(lambda: check_cluster(gpus, nodes))
    label, preset = norm, STAGE1_PRESETS.get(norm)  # the run's name: the norm, or a stage-1 preset
    norm_ok = True
    if preset is not None and stage != "pretrain":
        problems.append(
            f"NORM={label} is a stage-1 preset ({preset.description}); stage 2 loads its backbone into "
            f"NORM={preset.stage2_norms} with BACKBONE={backbone_path(BACKBONES / label, preset.norm)}"
        )
        norm_ok = False
    norm = preset.norm if preset else norm
    warm = init is not None and attempt(lambda: check_warm_start(stage, label, preset, init), False)
    if warm:
        label = f"{label}-{WARM}"
    try:
        check_norm(norm, also=STAGE1_PRESETS)
    except ValueError as err:
        problems.append(f"NORM={norm}: {err}")
        norm, norm_ok = "mabn", False  # the stand-in the LightningCLI checks the rest with
    cuda = True if dry_run else None
    devices_ok = gpus >= 0 and nodes >= 1 and not (gpus == 0 and nodes > 1)
    # A refused syncbn run says nothing else about its devices (no "No CUDA device here" line).
    syncbn = attempt(lambda: norm_args(norm, gpus, nodes, cuda), None) if norm_ok and devices_ok else []
    hardware = attempt(lambda: trainer_args(gpus, nodes, True if syncbn is None else cuda), None)
    hardware = (hardware if hardware is not None else trainer_args(0, 1)) + (syncbn or [])
    profile = PROFILES[stage]
    resolved = attempt(lambda: profile.resolve(data))
    if resolved is None:  # a data folder that is not the layout: a stand-in that no check reads from
        resolved = [*profile.base, profile.config], data if data is None or not data.exists() else data / "(layout)"
    configs, data_dir = resolved
    demo = data is None
    folder = run_dir(stage, label, demo, folder, data)
    args = ["fit"]
    warm_configs = [WARM_CONFIG, *([f"demo/{WARM_CONFIG}"] if demo else [])] if warm else []
    for name in configs + (preset.configs(demo) if preset else []) + warm_configs:
        args += ["--config", str(CONFIGS / name)]
    args += ["--data.init_args.data_dir", str(data_dir), "--model.init_args.norm", norm]
    args += ["--trainer.default_root_dir", str(folder)]
    # wandb's run name, group and tags (mabn.run.loggers.WandbLogger, the recipes' last logger): the stage and dataset
    dataset = profile.layout.name if data is not None else None
    args += ["--trainer.logger.init_args.stage", stage]
    args += ["--trainer.logger.init_args.dataset", dataset or data_dir.resolve().name]
    loading: list[str] = []
    if stage == "pretrain":
        export_dir = BACKBONES / DEMO if demo else BACKBONES
        export_dir = export_dir / label if preset else export_dir / WARM if warm else export_dir
        args += ["--model.init_args.export_dir", str(export_dir)]
        args += list(preset.args) if preset else []
        loading = ["--model.init_args.warm_start", str(init)] if warm else []
    # Stage 1's export for an unknown norm is no file to look for: the norm's problem is the one to report.
    if stage in STAGE2 and (norm_ok or backbone is not None):
        found = attempt(lambda: stage2_backbone(norm, backbone, demo, backbone_pending and dry_run))
        if found is not None:
            loading, line = found
            say(line)
    args += loading + (["--ckpt_path", resume] if resume else [])
    return LaunchPlan(
        stage, label, profile, demo, data_dir, folder, tuple(hardware), tuple(loading), resume,
        (*args, *hardware, *extra), launcher,
    ), problems  # fmt: skip


def build_args(*args: Any, **kwargs: Any) -> list[str]:
    """The LightningCLI arguments of ``plan(*args, **kwargs)``, to run a stage's configuration in Python
    (``mabn.cli.lightning.run_cli``)."""
    return list(plan(*args, **kwargs).args)
