"""``python -m mabn pretrain|cityscapes|segment``: a stage of the recipe, real with ``--data``, the demo profile
without it (``mabn.cli.launch``).

The launch decides its plan once (``mabn.cli.launch.plan``: profile, trainer preset, run folder, backbone), then runs
one LightningCLI (``mabn.cli.lightning``) that checks the whole configuration, takes the run folder's lock, and,
before it builds the data module, generates the demo set. ``--resume auto`` continues from the latest checkpoint of
the experiment folder, so a killed or requeued job restarts with the same command; ``--dry-run`` checks everything
(and the SLURM or torchrun environment, and the model, built without weights), prints the run's plan and its
LightningCLI command, and generates and writes nothing. A launch that cannot work stops with exit status 2 and an
``error:`` line: a dry run (the check ``make slurm`` runs before it submits) one for each independent problem
(launcher layout, norm, devices, data, backbone, then the LightningCLI's check of the rest), a run its first.
Lightning's DDP launcher runs this command again in each further process: those take no lock, and wait for
process 0's demo set.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path

from ...distributed import end_process_group_at_exit
from ...errors import user_error
from ...norm import NORM_PRESETS, NORMS
from .. import launch
from .. import lightning as cli
from ..help import command_parser


def norm_help() -> str:
    """The norms ``--norm`` takes, from the registry (``NORMS``, ``NORM_PRESETS``) and the stage-1 presets: a norm
    registered in the process is listed with them."""
    norms = ", ".join(name + (" (stage 2)" if entry.frozen else "") for name, entry in NORMS.items())
    ablations = ", ".join(name for name in NORM_PRESETS if name not in NORMS)
    return f"{norms}, or an ablation preset ({ablations}); stage 1 also {' and '.join(launch.STAGE1_PRESETS)}"


def parser(stage: str) -> argparse.ArgumentParser:
    parser = command_parser(stage, __doc__)
    parser.add_argument("--data", type=Path, help="dataset root; the demo profile runs when it is absent")
    parser.add_argument("--norm", default="mabn", help=norm_help())
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
    parser.add_argument(
        "--init",
        help="stage 1, beyond the paper: warm-start a centring MABN norm from this BN network's weights file "
        "(torchvision's ResNet state dict, or a stage-1 bn / bn32 file), with configs/pretrain-warm.yaml's "
        "epochs and timeline; runs in runs/pretrain/<norm>-warm, writes pretrain/warm/ (docs/backbones.md)",
    )
    parser.add_argument(
        "--resume", help="'auto' (the experiment folder's checkpoint with the highest step, if any) or a path"
    )
    parser.add_argument("--run-dir", type=Path, help="the experiment folder (default: runs/<stage>/<norm>)")
    parser.add_argument(
        "--dry-run", action="store_true", help="check, print the plan and the LightningCLI command, and exit"
    )
    parser.epilog = "Arguments after -- (and any this parser does not know) go to the LightningCLI unchanged."
    return parser


def main(argv: list[str]) -> int:
    """``argv`` starts with the stage: pretrain, cityscapes or segment."""
    stage, argv = argv[0], argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ns, unknown = parser(stage).parse_known_args(argv[:cut])
    extra = unknown + argv[cut + 1 :]
    end_process_group_at_exit()  # every run, whatever its norm: a DDP worker must exit cleanly
    # The launch says where the encoder starts in every case (its "Backbone:" line), the task's warning repeats it.
    warnings.filterwarnings("ignore", message="No backbone given")
    # --print_config: stdout is the YAML alone, which a user saves and passes back with --config; the launch's own
    # lines go to stderr.
    printing = any(arg.split("=")[0] == "--print_config" for arg in extra)
    with contextlib.redirect_stdout(sys.stderr) if printing else contextlib.nullcontext():
        plan, problems = launch.checked_plan(
            stage,
            ns.data,
            ns.norm,
            ns.gpus,
            ns.nodes,
            extra,
            backbone=ns.backbone,
            resume=ns.resume,
            dry_run=ns.dry_run,
            folder=ns.run_dir,
            backbone_pending=ns.backbone_pending,
            init=ns.init,
        )
    if problems and not ns.dry_run:  # a run stops at its first problem
        raise launch.LaunchError(problems[0])
    gpus_planned = ns.dry_run and ns.gpus > 0  # checked for where the job will run, perhaps on a login node
    if problems:  # a dry run names them all; its LightningCLI checks the rest on the plan's stand-ins
        raise launch.LaunchErrors([*problems, *(m for m in cli_problems(plan, gpus_planned) if m not in problems)])
    checked = cli.run_cli(list(plan.args), dry_run=ns.dry_run, prepare=plan.prepare_data, gpus_planned=gpus_planned)
    if ns.dry_run:
        print("\n".join([*checked.plan_lines, *([plan.launcher] if plan.launcher else []), plan.command]))
    return 0


def cli_problems(plan: launch.LaunchPlan, gpus_planned: bool) -> list[str]:
    """The LightningCLI's check of ``plan``'s arguments as a dry run (it builds, reads and locks nothing): its
    problems, or none; an error that is no user's mistake stays behind the launch's own problems."""
    try:
        cli.run_cli(list(plan.args), dry_run=True, gpus_planned=gpus_planned)
    except Exception as err:
        message = user_error(err)
        return message.splitlines() if message else []
    return []
