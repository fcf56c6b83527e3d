"""Stage 1: ImageNet classification that re-pretrains a ResNet-101 (or the ResNet ``arch``) with the chosen norm."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_info
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ..errors import ConfigError
from ..models import ARCHS, DEFAULT_ARCH, resnet, save_backbone
from ..models.warm_start import check_init, load_warm_start
from ..norm import norm_entry
from ..run import RunPlan, RunShape, auto_warmup_epochs, load_weights_file
from . import schedules
from .base import NormTask, require


def backbone_path(export_dir: str | Path, norm: str, arch: str = DEFAULT_ARCH) -> Path:
    """Where stage 1 exports its backbone, and where stage 2 looks for it (``resnet101-<norm>.pt``)."""
    return Path(export_dir) / f"{arch}-{norm}.pt"


def _goyal_warmup_multistep(
    start: float, warmup_steps: int, milestones: Sequence[int], gamma: float, step: int
) -> float:
    """Goyal et al.'s gradual warm-up as a factor of the scaled lr: ``start`` at step 0, rising linearly to 1 at
    ``warmup_steps``, times ``gamma`` at each milestone passed."""
    ramp = start + (1 - start) * step / warmup_steps if step < warmup_steps else 1.0
    return ramp * gamma ** sum(step >= m for m in milestones)


class ClassificationTask(NormTask):
    """ResNet-101 classification with the paper's recipe (appendix B.2).

    SGD with momentum; weight decay on every parameter, norm gamma and beta included; lr =
    ``base_lr`` x global batch / ``base_batch_size`` (the linear scaling rule), multiplied by ``lr_gamma`` at each of
    the ``milestones`` (epochs, converted to iterations at the run's iterations per epoch, so the drops stay at
    the recipe's epochs on any number of devices). A linear lr warm-up over ``warmup_epochs`` precedes the drops:
    None (auto) is Goyal et al.'s 5 epochs when the global batch exceeds ``base_batch_size`` (the lr is scaled up)
    and none otherwise (the paper's recipe at 256); a number is used as given. When the lr is scaled up the warm-up
    rises linearly from ``base_lr`` (the lr of ``base_batch_size``) to the scaled lr, as Goyal et al.'s; otherwise
    from 0.
    At the end of fitting the best checkpoint's backbone is exported to ``export_dir``.
    The norm, its phases and statistics logging (``norm_policy``), SGD's momentum and weight decay, ``cuda_graph``,
    ``compile`` and ``arch`` are the arguments every stage shares (``**shared``, see ``NormTask``); the backbone file
    is ``<arch>-<norm>.pt``.

    Args:
        num_classes: the classes of the classifier; a fit takes it from the data module (the class folders).
        base_lr: the learning rate at a global batch of ``base_batch_size``; scaled linearly with the global batch.
        base_batch_size: the global batch (samples per optimizer step over all devices) that ``base_lr`` is for.
        milestones: the epochs at which the lr is multiplied by ``lr_gamma``, increasing.
        lr_gamma: the factor the lr is multiplied by at each milestone.
        warmup_epochs: epochs of linear lr warm-up; null (auto): 5 when the global batch exceeds
            ``base_batch_size``, none otherwise.
        zero_init_residual: start the last norm's gamma of each residual block at 0 (each block the identity)
            instead of 1.
        label_smoothing: the label smoothing of the cross-entropy loss, in [0, 1); 0: none.
        export_dir: the folder that the best checkpoint's backbone is written to at the end of fitting, as
            ``<arch>-<norm>.pt``; null: no export.
        warm_start: beyond the paper: a BN network's weights file (torchvision's ResNet state dict, or a stage-1
            bn or bn32 file) that a centring MABN norm starts from, convs centred and MABN's statistics seeded from
            BN's (``mabn.models.warm_start``; docs/backbones.md); null: random weights.
    """

    run_settings = NormTask.run_settings | {"export_dir"}  # where the backbone goes at the end

    def __init__(
        self,
        num_classes: int = 1000,
        base_lr: float = 0.1,
        base_batch_size: int = 256,
        milestones: tuple[float, ...] = (30, 60, 90),
        lr_gamma: float = 0.1,
        warmup_epochs: float | None = None,
        zero_init_residual: bool = False,
        label_smoothing: float = 0.0,
        export_dir: str | None = "pretrain",
        warm_start: str | None = None,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        self.model = self.build_model()
        if warm_start:
            hp = self.hparams
            for line in load_warm_start(self.model, warm_start, hp.norm, hp.arch):
                rank_zero_info(line)
        # Top-k accuracy is the share of samples whose label is among the k highest logits: torchmetrics' "micro"
        # average. Its default "macro" averages the per-class shares instead, another number on unbalanced labels,
        # and counts the classes with bincount, which reads the device from the host in every training step.
        self.train_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        # Sums of loss x samples and of samples, synced as sums: exact when devices hold unequal shares of the
        # split. (self.log's sync_dist mean truncates the devices' summed sample count to an integer mean.)
        self.val_loss = MeanMetric()

    @classmethod
    def check_hparams(cls, hp: Mapping[str, Any]) -> None:
        super().check_hparams(hp)
        hp = cls.settings(hp)
        arch = hp["arch"]
        require(arch in ARCHS, "arch", arch, f"choose one of {', '.join(ARCHS)}")
        require(
            not norm_entry(hp["norm"]).frozen,
            "norm",
            hp["norm"],
            "its layers learn no statistics, so it cannot pre-train a network: pre-train with bn (make pretrain "
            "NORM=bn32) and fine-tune with it in stage 2",
        )
        require(hp["base_batch_size"] > 0, "base_batch_size", hp["base_batch_size"], "must be > 0")
        require(hp["lr_gamma"] > 0, "lr_gamma", hp["lr_gamma"], "must be > 0")
        warmup = hp["warmup_epochs"]
        require(warmup is None or warmup >= 0, "warmup_epochs", warmup, "must be >= 0 (or null: auto)")
        require(0 <= hp["label_smoothing"] < 1, "label_smoothing", hp["label_smoothing"], "must be in [0, 1)")
        if hp["warm_start"]:  # a file that cannot start this network stops before any data is read
            check_init(hp["warm_start"], hp["norm"], arch)
        epochs = list(hp["milestones"])
        require(
            epochs == sorted(epochs) and min(epochs, default=0) >= 0, "milestones", epochs, "must be increasing epochs"
        )

    @staticmethod
    def warmup_epochs(hp: Mapping[str, Any], shape: RunShape) -> float:
        """The run's warm-up in epochs: ``warmup_epochs``, or when it is None Goyal et al.'s 5 epochs if the global
        batch exceeds ``base_batch_size`` and none otherwise (``mabn.run.scaling.auto_warmup_epochs``)."""
        given = hp["warmup_epochs"]
        return auto_warmup_epochs(shape.global_batch, hp["base_batch_size"]) if given is None else given

    @classmethod
    def lr_factor(cls, hp: Mapping[str, Any], shape: RunShape) -> Callable[[int], float]:
        """The lr schedule as a factor of the scaled lr by optimizer step (``LambdaLR``): the warm-up, then
        ``lr_gamma`` at each milestone. Above ``base_batch_size`` the warm-up starts at ``base_lr``."""
        warmup_steps = shape.iterations(cls.warmup_epochs(hp, shape))
        milestones = [shape.iterations(m) for m in hp["milestones"]]
        if shape.global_batch <= hp["base_batch_size"]:
            return partial(
                schedules.warmup_multistep, warmup_steps=warmup_steps, milestones=milestones, gamma=hp["lr_gamma"]
            )
        start = hp["base_batch_size"] / shape.global_batch
        return partial(_goyal_warmup_multistep, start, warmup_steps, milestones, hp["lr_gamma"])

    @classmethod
    def run_plan(cls, hp: Mapping[str, Any], shape: RunShape) -> RunPlan:
        """The run's lr (``base_lr`` scaled to the global batch), its schedule (``lr_factor``) and the lines that
        say them with the batch: what ``--dry-run`` prints and the fit runs."""
        hp = cls.settings(hp)
        drops = ", ".join(f"{m:g}" for m in hp["milestones"])
        steps = [shape.iterations(m) for m in hp["milestones"]]
        at = "" if None in steps else f" (iterations {', '.join(map(str, steps))})"
        epochs = cls.warmup_epochs(hp, shape)
        scaled_up = shape.global_batch > hp["base_batch_size"]
        if epochs:
            start = f" from {hp['base_lr']:g}" if scaled_up else ""
            warmup = f"linear warm-up{start} over {shape.epochs_text(epochs)}, then "
        else:
            warmup = ""
        base, batch = hp["base_batch_size"], shape.global_batch
        if hp["warmup_epochs"] is not None:
            why = f"set (warmup_epochs: {hp['warmup_epochs']:g})"
        elif scaled_up:
            why = f"the global batch {batch} exceeds base_batch_size {base} (Goyal et al.; warmup_epochs: null is auto)"
        else:
            why = f"the global batch {batch} does not exceed base_batch_size {base} (warmup_epochs: null is auto)"
        lr = shape.lr(hp["base_lr"], base)
        ramp = f"from {hp['base_lr']:g} to {lr:g}" if scaled_up else f"up to {lr:g}"
        said = f"{shape.epochs_text(epochs)}, {ramp}, as {why}" if epochs else f"none, as {why}"
        lines = (
            *shape.lines(),
            shape.lr_line(hp["base_lr"], hp["base_batch_size"]),
            f"warm-up: {said}",
            f"schedule: {warmup}lr x {hp['lr_gamma']:g} at epochs {drops}{at}",
        )
        return RunPlan(shape, lr, shape.iterations(epochs), lines, cls.lr_factor(hp, shape))

    def build_model(self) -> torch.nn.Module:
        hp = self.hparams
        return resnet(hp.norm, hp.num_classes, hp.norm_batch_size, hp.norm_options, hp.zero_init_residual, hp.arch)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self.training_forward(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.train_top1(logits, labels)
        # Not on the progress bar: Lightning reads a bar's values from the device after every step (``.item()``);
        # the loggers read them every ``log_every_n_steps``.
        self.log("train/loss", loss)
        self.log("train/top1", self.train_top1)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_top1(logits, labels)
        self.val_top5(logits, labels)
        self.val_loss.update(F.cross_entropy(logits, labels), weight=len(labels))
        self.log("val/loss", self.val_loss)
        self.log("val/top1", self.val_top1, prog_bar=True)
        self.log("val/top5", self.val_top5)

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.SGD(self.parameters(), lr=lr, momentum=hp.momentum, weight_decay=hp.weight_decay)

    def configure_optimizers(self) -> dict[str, Any]:
        plan = self.fit_plan()
        optimizer = self.make_optimizer(plan.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_end(self) -> None:
        if self.hparams.export_dir and self.trainer.is_global_zero:
            self.export_backbone(Path(self.hparams.export_dir))

    def export_backbone(self, export_dir: Path) -> Path:
        """Write the best checkpoint's backbone (or the current one without a checkpoint) to ``export_dir``."""
        ckpt = self.trainer.checkpoint_callback
        model, top1 = self.model, self.trainer.callback_metrics.get("val/top1")
        if ckpt is not None and ckpt.best_model_path:
            state = load_weights_file(Path(ckpt.best_model_path), "checkpoint", ConfigError)["state_dict"]
            model = self.build_model()
            model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
            top1 = ckpt.best_model_score
        config = {
            "run_dir": str(self.trainer.default_root_dir),  # whose backbone this is (see mabn.cli.fit.check_export)
            "model": dict(self.hparams),
            "data": dict(self.trainer.datamodule.hparams),
            "global_batch_size": self.planned.shape.global_batch,
            "steps": self.trainer.global_step,
        }
        top1 = None if top1 is None else float(top1)
        hp = self.hparams
        path = save_backbone(backbone_path(export_dir, hp.norm, hp.arch), model, hp.norm, config, top1, hp.arch)
        shown = "n/a" if top1 is None else f"{top1:.3f}"
        rank_zero_info(f"Exported backbone to {path} (norm {self.hparams.norm}, val top-1 {shown})")
        return path
