"""``python -m mabn pretrain|cityscapes|segment``: pick the real or demo profile and a trainer preset, check the
whole configuration, then run the LightningCLI.

The Makefile's ``make pretrain``, ``make cityscapes`` and ``make segment`` call this (``segment``: stage 2's recipe
on a dataset of the user's own, ``mabn.data.folder``). With ``--data`` it runs the paper's recipe
from ``configs/`` on that dataset, and a ``--data`` that is not the expected layout is an error naming the
missing folder; without ``--data`` it says so, generates a small set in the same on-disk layout (once) and
runs the demo profile, which trains for a few minutes on a CPU. The demo writes only under ``runs/demo/``,
``pretrain/demo/`` and ``data/``, never where a real run's artefacts live.

Each run's experiment folder is ``runs/<stage>/<norm>`` (``runs/demo/<stage>/<norm>`` for the demo;
``--run-dir`` picks another), see ``mabn.runs``. ``--gpus`` (per node) and ``--nodes`` pick a preset from
``configs/trainer/`` (cpu, gpu, ddp, multinode) and set the Trainer's devices and num_nodes; on a machine
without CUDA, ``--gpus N`` runs N CPU processes under DDP instead. ``--resume auto`` continues from the
newest checkpoint of the experiment folder, so a killed or requeued job restarts with the same command;
``--dry-run`` prints the LightningCLI arguments and checks them (and the SLURM or torchrun environment)
without training.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cli
from .data.once import generate_once
from .errors import ConfigError
from .norm import NORM_PRESETS
from .process import launch_rank, say
from .tasks.classification import backbone_path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEMO_DATA = Path("data")
RUNS = Path("runs")
BACKBONES = Path("pretrain")
DEMO = "demo"  # the folder under runs/ and pretrain/ that holds the demo profile's artefacts
NO_BACKBONE = "none"  # --backbone none: stage 2's encoder from random weights, on purpose
DEMO_WAIT_S = 1800  # how long the processes of other nodes wait for process 0 to generate the demo set
STAGE2 = ("cityscapes", "segment")  # the stages that fine-tune a stage-1 backbone


class LaunchError(ConfigError):
    """A launch that cannot work as asked; the message says why and what to change."""


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
    """A stage's data: the folders (and files) that make ``--data`` the real dataset (then the recipe ``config``
    runs, after the ``base`` configs it builds on), and without ``--data`` the message and the demo set that
    replaces it (then each config's ``configs/demo/`` version follows, where there is one)."""

    config: str
    layout: tuple[str, ...]
    demo: str  # the module of mabn.data that generates the demo set, named like its folder under data/
    missing: str
    base: tuple[str, ...] = ()  # configs read before ``config`` (segment: cityscapes.yaml's recipe)
    files: tuple[str, ...] = ()  # files of the layout besides its folders

    def resolve(self, data: Path | None) -> tuple[list[str], Path]:
        """(the configs to run, the data root): the demo's without ``data``; a ``data`` that is not the layout
        is an error naming the first missing folder or file."""
        configs = [*self.base, self.config]
        if data is not None:
            if not data.is_dir():
                raise LaunchError(f"DATA={data}: no such folder (expected {self.expected})")
            for folder in self.layout:
                if not (data / folder).is_dir():
                    raise LaunchError(f"DATA={data}: missing folder {data / folder} (expected {self.expected})")
            for name in self.files:
                if not (data / name).is_file():
                    raise LaunchError(f"DATA={data}: missing file {data / name} (expected {self.expected})")
            return configs, data
        say(self.missing)
        demo = [f"demo/{name}" for name in configs if (CONFIGS / "demo" / name).is_file()]
        return configs + demo, DEMO_DATA / self.demo.replace("_", "-")

    @property
    def expected(self) -> str:
        return ", ".join([*(f"{folder}/..." for folder in self.layout), *self.files])

    def generate_demo(self, root: Path) -> Path:
        generator = importlib.import_module(f"{__package__}.data.{self.demo}")
        return _demo_set(root, generator.generate, generator.MARKER)


PROFILES = {
    "pretrain": Profile(
        "pretrain.yaml",
        ("train", "val"),
        "demo_imagenet",
        "No ImageNet given (DATA=...): expected train/<wnid>/*.JPEG and val/<wnid>/*.JPEG.\n"
        "Running the demo profile on generated data (configs/demo/pretrain.yaml).",
    ),
    "cityscapes": Profile(
        "cityscapes.yaml",
        ("leftImg8bit", "gtFine"),
        "demo_cityscapes",
        "No Cityscapes given (DATA=...): expected leftImg8bit/<split>/<city>/*_leftImg8bit.png and\n"
        "gtFine/<split>/<city>/*_gtFine_labelIds.png. Running the demo profile on generated street scenes\n"
        "(configs/demo/cityscapes.yaml).",
    ),
    "segment": Profile(
        "segment.yaml",
        ("images", "masks"),
        "demo_segment",
        "No dataset given (DATA=...): expected images/<split>/*, masks/<split>/*.png and classes.yaml\n"
        "(docs/your-data.md). Running the demo profile on the generated example (configs/demo/cityscapes.yaml).",
        base=("cityscapes.yaml",),
        files=("classes.yaml",),
    ),
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


STAGE1_PRESETS = {
    # The paper's BN backbone (its Cityscapes BN, BRN and SyncBN rows all start from it) normalizes over each
    # device's batch of 32: pretrain/bn32/resnet101-bn.pt, never to be taken for the bn backbone at
    # normalization batch 2 (pretrain/resnet101-bn.pt).
    "bn32": Stage1Preset(
        "bn", "BN over each device's batch of 32", "bn, brn or syncbn", ("--model.init_args.norm_batch_size", "null")
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
    """syncbn: Lightning's ``sync_batchnorm``, refused where SyncBatchNorm cannot synchronize anything."""
    if norm != "syncbn":
        return []
    if gpus * nodes < 2:
        raise LaunchError(
            f"NORM=syncbn synchronizes BatchNorm across GPUs, but GPUS={gpus} NODES={nodes} is "
            f"{'no GPU' if gpus == 0 else 'one device'}: use NORM=bn, or GPUS=2 or more"
        )
    if not (torch.cuda.is_available() if cuda is None else cuda):
        raise LaunchError(
            "NORM=syncbn needs GPUs (torch's SyncBatchNorm has no CPU kernel) and no CUDA device is visible: "
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
    path = backbone_path(BACKBONES / DEMO if demo else BACKBONES, norm)
    source = f"Backbone: {path}, stage 1's export for NORM={norm}"
    if path.is_file():
        return ["--model.init_args.backbone", str(path)], f"{source} (BACKBONE=... picks another)"
    if pending:
        return [], f"{source}, to be written by the stage-1 job this one waits for"
    if demo:
        return [], f"Backbone: none ({path} not found: make pretrain NORM={norm} writes it); random encoder weights"
    raise LaunchError(
        f"no stage-1 backbone {path}: run stage 1 first (make pretrain NORM={norm} DATA=<imagenet>), give one "
        f"with BACKBONE=<file>, or BACKBONE=none (--backbone none) to train the encoder from random weights"
    )


def run_dir(stage: str, norm: str, demo: bool, given: Path | None) -> Path:
    """The experiment folder: ``given``, else runs/<stage>/<norm> (runs/demo/... for the demo profile)."""
    return given if given is not None else (RUNS / DEMO if demo else RUNS) / stage / norm


def build_args(
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
) -> list[str]:
    """The LightningCLI arguments of a stage run (the demo profile without ``data``); nothing is generated or
    read here. ``dry_run`` assumes a GPU machine; ``backbone_pending`` (with it): stage 1 writes the backbone
    before this run starts."""
    label, preset = norm, STAGE1_PRESETS.get(norm)  # the run's name: the norm, or a stage-1 preset
    if preset is not None and stage != "pretrain":
        raise LaunchError(
            f"NORM={label} is a stage-1 preset ({preset.description}); stage 2 loads its backbone into "
            f"NORM={preset.stage2_norms} with BACKBONE={backbone_path(BACKBONES / label, preset.norm)}"
        )
    norm = preset.norm if preset else norm
    if norm not in NORM_PRESETS:
        names = sorted([*NORM_PRESETS, *STAGE1_PRESETS])
        raise LaunchError(f"NORM={norm}: unknown norm; choose one of {', '.join(names)}")
    cuda = True if dry_run else None
    syncbn = norm_args(norm, gpus, nodes, cuda)  # first: a refused syncbn run says nothing else
    hardware = trainer_args(gpus, nodes, cuda) + syncbn
    configs, data_dir = PROFILES[stage].resolve(data)
    demo = data is None
    args = ["fit"]
    for name in configs + (preset.configs(data is None) if preset else []):
        args += ["--config", str(CONFIGS / name)]
    args += ["--data.init_args.data_dir", str(data_dir), "--model.init_args.norm", norm]
    args += ["--trainer.default_root_dir", str(run_dir(stage, label, demo, folder))]
    if stage == "pretrain":
        export_dir = BACKBONES / DEMO if demo else BACKBONES
        args += ["--model.init_args.export_dir", str(export_dir / label if preset else export_dir)]
        args += list(preset.args) if preset else []
    if stage in STAGE2:
        loading, line = stage2_backbone(norm, backbone, demo, backbone_pending and dry_run)
        say(line)
        args += loading
    if resume:
        args += ["--ckpt_path", resume]
    return args + hardware + extra


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mabn", description=__doc__)
    parser.add_argument("stage", choices=sorted(PROFILES))
    parser.add_argument("--data", type=Path, help="dataset root; the demo profile runs when it is absent")
    parser.add_argument(
        "--norm", default="mabn", help="bn, syncbn, gn, brn, mabn or an ablation preset; stage 1 also bn32 and mabn-det"
    )
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node (0: CPU)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument(
        "--backbone",
        help="stage 2: a backbone file, or 'none' for random encoder weights (default: stage 1's export)",
    )
    parser.add_argument(
        "--backbone-pending",
        action="store_true",
        help="with --dry-run: stage 1's backbone is written by a job that runs first (make slurm AFTER=<job>)",
    )
    parser.add_argument("--resume", help="'auto' (the newest checkpoint of the experiment folder, if any) or a path")
    parser.add_argument("--run-dir", type=Path, help="the experiment folder (default: runs/<stage>/<norm>)")
    parser.add_argument("--dry-run", action="store_true", help="print the LightningCLI arguments, check, exit")
    parser.epilog = "Arguments after -- (and any this parser does not know) go to the LightningCLI unchanged."
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ns, unknown = parser.parse_known_args(argv[:cut])
    extra = unknown + argv[cut + 1 :]
    try:
        where = check_cluster(ns.gpus, ns.nodes)
        args = build_args(
            ns.stage,
            ns.data,
            ns.norm,
            ns.gpus,
            ns.nodes,
            extra,
            ns.backbone,
            ns.resume,
            ns.dry_run,
            ns.run_dir,
            ns.backbone_pending,
        )
        # Every configuration mistake stops here, before any data is generated or read; a run (not a dry run)
        # also takes its folder's lock here, so a second launch on the folder stops as early.
        plan = cli.check(args, lock=not ns.dry_run)
    except Exception as err:  # a configuration or data-layout mistake is one line; anything else a traceback
        cli.exit_on_user_error(err)
    if ns.dry_run:
        print("\n".join([*plan, *([where] if where else []), "python -m mabn " + shlex.join(args)]))
        return
    if ns.data is None:
        try:
            PROFILES[ns.stage].generate_demo(Path(args[args.index("--data.init_args.data_dir") + 1]))
        except Exception as err:
            cli.exit_on_user_error(err)
    cli.main(args)
