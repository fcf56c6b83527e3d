"""``python -m mabn fit|validate|test --config ...``: the LightningCLI that drives both stages.

Beyond LightningCLI it adds ``RandomStateCallback`` to every trainer (exact resume needs the generators'
states) and accepts ``fit --ckpt_path auto``: resume from the newest checkpoint of this stage and norm under
the trainer's ``default_root_dir``, or start a new run when there is none, so a killed or requeued job
restarts with the very same command.
"""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

from . import resume
from .callbacks import AgreedRequeue, FailFast, RandomStateCallback
from .callbacks.distributed import end_process_group_at_exit
from .data.errors import DatasetError
from .models import BackboneError


class MabnCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The number of classes is a property of the data, never set twice by hand.
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        # Exact resume; a failing DDP process stops all; SLURM's requeue checkpoint at an agreed step.
        for callback in (RandomStateCallback(), FailFast(), AgreedRequeue()):
            if not any(isinstance(c, type(callback)) for c in trainer.callbacks):
                trainer.callbacks.append(callback)
        return trainer

    def before_fit(self) -> None:
        config = self.config_init["fit"]
        config["ckpt_path"] = resume.resolve(config.get("ckpt_path"), self.trainer.default_root_dir, self.model.hparams)


def run_cli(args: list[str] | None = None, run: bool = True) -> MabnCLI:
    return MabnCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def user_error(err: BaseException) -> str | None:
    """The message of the dataset or backbone error behind ``err``, if there is one.

    jsonargparse wraps errors raised while it instantiates the data module, and a DataLoader worker
    re-raises with its traceback in the message: dig out the original, one-line message.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DatasetError | BackboneError):
            lines = str(err).strip().splitlines()
            if len(lines) > 1 and lines[0].startswith("Caught "):
                return lines[-1].split(": ", 1)[-1]
            return str(err)
        err = err.__cause__ or err.__context__
    return None


def main(args: list[str] | None = None) -> None:
    end_process_group_at_exit()  # every run, whatever its norm: a DDP worker must exit cleanly
    try:
        run_cli(args)
    except Exception as err:
        message = user_error(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
