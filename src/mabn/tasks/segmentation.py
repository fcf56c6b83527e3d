"""Stage 2: PSPNet-101 fine-tuning on Cityscapes with warm-up + poly lr, evaluated by sliding window (``arch``: a
PSPNet on another ResNet depth; ``decoder``: another decoder on the same encoder, docs/models.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from ..data.classes import IGNORE_INDEX, ClassTable
from ..data.loading import DataPlan
from ..distributed import say
from ..errors import ConfigError
from ..models import (
    DECODERS,
    DEFAULT_DECODER,
    build_segmentation_model,
    check_backbone,
    check_encoder,
    load_backbone_into,
)
from ..models.backbone import conversion_line, converts
from ..norm import norm_entry
from ..run import RunPlan, RunShape, device_batch, device_batch_reason
from . import class_weights as weighting
from . import losses, memory, schedules, wandb_media
from .base import NormTask, require
from .batch_layout import BatchLayout
from .metrics import SegmentationMetric, format_iou_table
from .sliding import sliding_window_logits
from .wandb_media import MAX_MASK_CLASSES


class SegmentationTask(NormTask):
    """PSPNet with the recipe of Zhao et al. and the MABN paper's Cityscapes appendix.

    SGD with momentum and weight decay; the encoder at ``base_lr`` x global batch / ``base_batch_size`` (the
    linear scaling rule), the new heads at ``head_lr_mult`` x that; lr rises linearly over ``warmup_epochs`` and
    then follows poly(``poly_power``) to the end of the run, stepped per iteration (epochs convert to iterations
    at the run's iterations per epoch, so the schedule keeps the recipe's epochs on any number of devices).
    Loss: ``loss`` (the recipe's cross-entropy over the labelled pixels by default; any loss of the registry
    ``mabn.tasks.losses.LOSSES`` with its options, or a weighted sum, with class weights) of the main head plus
    ``aux_weight`` x that of the auxiliary head.
    Validation runs the full images through sliding windows of ``eval_crop`` (default: the training
    crop) with stride 2/3 of it, optional flip and scales, and reports the Cityscapes mIoU, the mean per-class
    accuracy ``val/macc`` and the pixel accuracy (a test: ``test/...``), and prints the per-class table; where a
    WandbLogger is among the trainer's loggers, rank 0 also logs that table as the wandb.Table ``val/per_class``
    (``test/per_class``) of class, IoU and accuracy (null where undefined).
    Every ``log_predictions_every_n_epochs``-th validation (the first one included; 0: never) logs the
    first ``num_logged_predictions`` images of its first batch to Weights & Biases as ``val/predictions``,
    with the predicted and the ground-truth classes as masks (see ``prediction_masks``); only rank 0 logs,
    and only when a WandbLogger is among the trainer's loggers.
    The norm, its phases, resets and statistics logging (``norm_policy``), SGD's momentum and weight decay,
    ``cuda_graph``, ``compile`` and ``arch`` are the arguments every stage shares (``**shared``, see ``NormTask``);
    a backbone must be of the same arch.
    ``decoder`` (default ``pspnet``, the paper's) puts another decoder of ``mabn.models.DECODERS`` on the same
    encoder, at ``output_stride`` (default: the decoder's own); ``heads()`` and the norm policy's heads group cover
    its decoder and head (``model.classifier``) and its auxiliary head (``model.aux``) where it has one; a decoder
    without one trains on the main loss alone (``aux_weight`` unused). See docs/models.md.

    Args:
        num_classes: the classes the heads predict; a fit takes it from the data module (Cityscapes: 19; a dataset
            of your own: its ``classes.yaml``).
        backbone: the encoder's starting weights: a stage-1 backbone file or torchvision ResNet weights
            (docs/backbones.md), of the same ``arch`` and a norm that can start ``norm``; null: random weights.
        base_lr: the encoder's learning rate at a global batch of ``base_batch_size``; scaled linearly with the
            global batch.
        base_batch_size: the global batch (samples per optimizer step over all devices) that ``base_lr`` is for.
        head_lr_mult: the new heads' (decoder, classifier, auxiliary head) lr as a multiple of the encoder's.
        warmup_epochs: epochs of linear lr warm-up before the poly decay; 0: none.
        poly_power: the exponent of the poly decay, lr x (1 - iteration / total iterations) ** poly_power.
        aux_weight: the weight of the auxiliary head's loss in the training loss (the main head's is 1).
        dropout: the dropout probability in the heads, before their last 1x1 conv (and in the decoder where smp
            gives it one), in [0, 1).
        eval_crop: the side in pixels of the sliding window of validation, test and prediction (stride 2/3 of it);
            null: the data module's training crop.
        eval_flip: also evaluate the horizontally flipped image and average the class probabilities.
        eval_scales: the image scales evaluated and averaged (multi-scale testing); ``[1.0]``: the image as it is.
        log_predictions_every_n_epochs: log sample predictions and labels as masks to Weights & Biases at every
            n-th validation, the first included; 0: never.
        num_logged_predictions: how many images of the first validation batch such a log shows.
        decoder: the segmentation decoder on the encoder, one of ``mabn.models.DECODERS`` (``pspnet``, the paper's;
            ``deeplabv3``, ``deeplabv3plus``, ``upernet``, ``fpn``, ``unet``, ...).
        output_stride: the encoder's output stride, input size / feature size (8, 16 or 32, as the decoder takes);
            null: the decoder's default.
        loss: the training loss of each head: a loss name (LOSS_NAMES; ``ce``, cross-entropy, is the recipe's;
            ``module.name`` imports ``module``, which registers ``name``), or a weighted sum of losses, each a
            weight or a mapping of its options: ``{ce: 1.0, dice: 0.5}``, ``{ohem: {thresh: 0.7, min_kept:
            2000}}``, ``{ce: 1.0, dice: {weight: 0.5, smooth: 1.0}}`` (``mabn.tasks.losses``, docs/training.md).
        class_weights: per-class weights of the loss: null (the weights of the dataset's ``classes.yaml`` where it
            gives some, else none), ``counts`` (from the training split's pixels per class, ``1 / ln(1.02 +
            share)``) or a list of numbers > 0, one per class. Lovász takes none.
        head_norm: the norm of the decoder and heads, one of ``mabn.norm.NORM_PRESETS``; null: ``norm``, or for a
            norm whose layers learn nothing (``frozenbn``) the one its entry names (``bn``).
        centre_encoder: whether the encoder's convs are centred where ``norm`` centres them; null: as the norm's
            preset says, except for BN weights (``backbone``) converted to a MABN norm, which keep BN's function
            with uncentred convs (docs/backbones.md); a fit records what it built.
    """

    run_settings = NormTask.run_settings | {"log_predictions_every_n_epochs", "num_logged_predictions"}

    def __init__(
        self,
        num_classes: int = 19,
        backbone: str | None = None,
        base_lr: float = 0.01,
        base_batch_size: int = 16,
        head_lr_mult: float = 10.0,
        warmup_epochs: float = 3.0,
        poly_power: float = 0.9,
        aux_weight: float = 0.4,
        dropout: float = 0.1,
        eval_crop: int | None = None,
        eval_flip: bool = False,
        eval_scales: tuple[float, ...] = (1.0,),
        log_predictions_every_n_epochs: int = 1,
        num_logged_predictions: int = 2,
        decoder: str = DEFAULT_DECODER,
        output_stride: int | None = None,
        loss: dict[str, float | dict[str, Any]] | str = "ce",
        class_weights: list[float] | str | None = None,
        head_norm: str | None = None,
        centre_encoder: bool | None = None,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        hp = self.hparams
        if backbone and centre_encoder is None and converts(check_backbone(backbone, hp.norm, hp.arch), hp.norm):
            # Recorded, so that a checkpoint rebuilds the encoder it trained without reading the backbone file.
            hp.centre_encoder = False
        self.model = build_segmentation_model(
            decoder, num_classes, hp.norm, hp.norm_batch_size, hp.norm_options, hp.arch, dropout, output_stride,
            hp.head_norm, hp.centre_encoder,
        )  # fmt: skip
        if backbone:
            info = load_backbone_into(self.model.encoder, backbone, hp.norm, hp.arch)
            if not info["converted"]:  # a conversion is the plan's backbone line, in the fit and its dry run alike
                rank_zero_info(f"Encoder loaded from {backbone} ({info['description']}) into norm {hp.norm}")
        elif norm_entry(hp.norm).frozen:
            rank_zero_warn(
                f"No backbone given (BACKBONE=...): norm {hp.norm} keeps its layers' statistics as they start (mean 0, "
                "variance 1), so the encoder trains without normalization; give BN weights (docs/backbones.md)."
            )
        else:
            rank_zero_warn("No backbone given (BACKBONE=...): the encoder starts from random weights.")
        # Weights from the data (classes.yaml's, counts) are known at fit's setup, which makes the loss again.
        weights = None if class_weights is None or class_weights == weighting.COUNTS else class_weights
        self.criterion = self.make_loss(self.hparams, self.class_names(), weights, None)[0]
        self.val_metric = SegmentationMetric(num_classes, IGNORE_INDEX)
        self.test_metric = SegmentationMetric(num_classes, IGNORE_INDEX)
        self.test_result: dict[str, torch.Tensor] = {}  # the last test's metrics (SegmentationMetric.compute)
        self.validations_done = 0  # completed validation runs of this process (sanity checks excluded)

    @classmethod
    def check_hparams(cls, hp: Mapping[str, Any]) -> None:
        super().check_hparams(hp)
        hp = cls.settings(hp)
        try:
            check_encoder(hp["arch"])
        except ValueError as err:  # one line naming the value, as every argument's mistake
            raise ConfigError(str(err)) from err
        head_norm = hp["head_norm"]
        if head_norm is not None:
            try:
                head = norm_entry(head_norm)
            except ValueError as err:
                raise ConfigError(f"head_norm={head_norm!r}: {err}") from None
            require(not head.frozen, "head_norm", head_norm, "the heads start untrained: pick a norm that trains")
        if hp["backbone"]:  # a backbone that cannot start this norm stops before any data is read
            backbone = check_backbone(hp["backbone"], hp["norm"], hp["arch"])
            require(
                hp["centre_encoder"] is not True or not converts(backbone, hp["norm"]),
                "centre_encoder",
                True,
                f"BN weights ({backbone.path}) keep BN's function only in uncentred convs: leave it null, or start "
                f"from a stage-1 {hp['norm']} backbone (make pretrain NORM={hp['norm']})",
            )
        require(hp["base_batch_size"] > 0, "base_batch_size", hp["base_batch_size"], "must be > 0")
        require(hp["head_lr_mult"] > 0, "head_lr_mult", hp["head_lr_mult"], "must be > 0 (heads' lr = base_lr x it)")
        require(hp["warmup_epochs"] >= 0, "warmup_epochs", hp["warmup_epochs"], "must be >= 0")
        require(hp["poly_power"] > 0, "poly_power", hp["poly_power"], "must be > 0")
        require(hp["aux_weight"] >= 0, "aux_weight", hp["aux_weight"], "must be >= 0")
        require(0 <= hp["dropout"] < 1, "dropout", hp["dropout"], "must be in [0, 1)")
        losses.check_loss(hp["loss"], hp["class_weights"])
        decoder = hp["decoder"]
        require(decoder in DECODERS, "decoder", decoder, f"choose one of {', '.join(DECODERS)}")
        stride = hp["output_stride"]
        strides = " or ".join(map(str, sorted(DECODERS[decoder].output_strides)))
        require(stride is None or stride in DECODERS[decoder].output_strides, "output_stride", stride,
                f"decoder {decoder} takes {strides} (or null: its default)")  # fmt: skip
        require(len(hp["eval_scales"]) > 0 and min(hp["eval_scales"]) > 0, "eval_scales", hp["eval_scales"], "> 0")
        for name in ("log_predictions_every_n_epochs", "num_logged_predictions"):
            require(hp[name] >= 0, name, hp[name], "must be >= 0")
        require(
            not hp["log_predictions_every_n_epochs"] or hp["num_classes"] <= MAX_MASK_CLASSES,
            "num_classes",
            hp["num_classes"],
            f"prediction masks hold at most {MAX_MASK_CLASSES} classes (wandb stores them as 8-bit images); "
            "set log_predictions_every_n_epochs=0",
        )

    @classmethod
    def run_plan(cls, hp: Mapping[str, Any], shape: RunShape) -> RunPlan:
        """The run's encoder lr (``base_lr`` scaled to the global batch; the heads' is ``head_lr_mult`` times it),
        its warm-up and poly schedule, and the lines that say them with the batch: what ``--dry-run`` prints and the
        fit runs."""
        hp = cls.settings(hp)
        heads = f" for the encoder, x {hp['head_lr_mult']:g} for the heads"
        end = "" if shape.total_iterations is None else f" to iteration {shape.total_iterations}"
        warmup = shape.epochs_text(hp["warmup_epochs"])
        warmup_steps = shape.iterations(hp["warmup_epochs"])
        factor = partial(
            schedules.warmup_poly, max_steps=shape.total_iterations, warmup_steps=warmup_steps, power=hp["poly_power"]
        )
        decoder = hp["decoder"]
        model = []  # the paper's PSPNet says nothing; another decoder says what is built
        if decoder != DEFAULT_DECODER:
            spec = DECODERS[decoder]
            stride = hp["output_stride"] or spec.output_strides[0]
            aux = "auxiliary head on layer3" if spec.aux else "no auxiliary head (aux_weight unused)"
            model = [f"model: {spec.title} decoder (smp) on {hp['arch']}, output stride {stride}, {aux}"]
        heads_norm = hp["head_norm"] or norm_entry(hp["norm"]).head_norm
        batched = (norm_entry(hp["norm"]).batch, norm_entry(heads_norm or hp["norm"]).batch)
        normalized = {(False, False): None, (False, True): "in the decoder and heads", (True, False): "in the encoder"}
        shape_lines = shape.lines(normalized.get(batched, ""))
        if heads_norm and heads_norm != hp["norm"]:
            why = "head_norm" if hp["head_norm"] else f"{hp['norm']} trains nothing; head_norm picks another"
            model += [f"norms: {hp['norm']} in the encoder, {heads_norm} in the decoder and heads ({why})"]
        if hp["backbone"]:  # BN weights for a MABN encoder: say that they are converted, and how
            backbone = check_backbone(hp["backbone"], hp["norm"], hp["arch"])
            model += [conversion_line(backbone)] if converts(backbone, hp["norm"]) else []
        lines = (
            *model,
            *shape_lines[:1],
            *cls.batch_reason(hp, shape),
            *shape_lines[1:],
            shape.lr_line(hp["base_lr"], hp["base_batch_size"], heads),
            f"schedule: linear warm-up over {warmup}, then poly {hp['poly_power']:g}{end}",
            *cls.warmup_warning(hp, shape),
            cls.loss_line(hp),
        )
        return RunPlan(shape, shape.lr(hp["base_lr"], hp["base_batch_size"]), warmup_steps, lines, factor)

    @staticmethod
    def loss_line(hp: Mapping[str, Any]) -> str:
        """The ``loss:`` line of the plan: the loss, where its class weights come from, and the heads it weighs."""
        text = losses.describe(losses.loss_terms(hp["loss"]))
        weights = hp["class_weights"]
        if weights == weighting.COUNTS:
            text += ", class weights from the training pixels per class"
        elif weights is not None:
            text += ", class weights as given"
        if DECODERS[hp["decoder"]].aux:
            return f"loss: {text}; main head + {hp['aux_weight']:g} x auxiliary head"
        return f"loss: {text}; main head (no auxiliary head)"

    @staticmethod
    def make_loss(
        hp: Mapping[str, Any],
        names: Sequence[str],
        class_weights: str | Sequence[float] | None,
        crop: int | None,
        classes: ClassTable | None = None,
        pixels: Sequence[int] | None = None,
    ) -> tuple[losses.PixelLoss, list[str]]:
        """(the loss of each head at a training crop of ``crop`` px, None where not known; the lines that say its
        class weights and what its terms take of the data). ``class_weights``: the argument, resolved against
        ``classes`` (the dataset's table, whose weights it may give) and ``pixels`` (the training split's per
        class) for the classes ``names`` (``mabn.tasks.class_weights.resolve_class_weights``)."""
        weights, origin = weighting.resolve_class_weights(
            class_weights,
            names,
            None if classes is None else classes.weights,
            "" if classes is None else classes.source,
            pixels,
        )
        terms = losses.loss_terms(hp["loss"])
        unweighted = [term.entry.name for term in terms if not term.entry.class_weights]
        if weights is not None and len(unweighted) == len(terms):
            raise ConfigError(
                f"class weights ({origin}): loss {hp['loss']} takes none: remove them, or add a term that takes "
                f"them, e.g. {{{unweighted[0]}: 1.0, ce: 1.0}}"
            )
        if weights is not None and unweighted:
            origin += f"; {', '.join(unweighted)} takes none"
        data = losses.LossData(None if weights is None else tuple(weights), crop)
        lines = [] if weights is None else [weighting.weights_line(weights, names, origin)]
        return losses.PixelLoss(terms, data), lines + losses.data_lines(terms, data)

    @classmethod
    def loss_lines(cls, hp: Mapping[str, Any], plan: DataPlan) -> list[str]:
        """The dry run's lines on the loss once the data is known (``make_loss``'s, as the fit says them): the class
        weights, from the data plan's training pixels per class (and the class table they count) where the data
        module counts them, and what the loss's terms take of the data plan's crop; ``ConfigError`` where the
        weights cannot be made."""
        hp = cls.settings(hp)
        pixels = plan.class_pixels
        classes = None if pixels is None else pixels.classes
        names = default_class_names(hp["num_classes"]) if classes is None else classes.names
        counts = None if pixels is None else pixels.pixels
        return cls.make_loss(hp, names, hp["class_weights"], plan.crop, classes, counts)[1]

    @staticmethod
    def warmup_warning(hp: Mapping[str, Any], shape: RunShape) -> list[str]:
        """A line when the warm-up takes the whole run: the lr never reaches base_lr and no poly decay runs."""
        steps, total = shape.iterations(hp["warmup_epochs"]), shape.total_iterations
        if not steps or total is None or steps < total:
            return []
        return [
            f"warning: the warm-up ({steps} iterations) is not shorter than the run ({total} iterations): the lr "
            "never reaches its base value and the poly decay never starts; lower --model.init_args.warmup_epochs"
        ]

    @staticmethod
    def batch_reason(hp: Mapping[str, Any], shape: RunShape) -> list[str]:
        """The ``global batch:`` line: why the devices hold the global batch they hold, by the rule of
        ``mabn.run.scaling.device_batch`` over the recipe's global batch (``base_batch_size``, the batch ``base_lr``
        belongs to); none where the per-device batch does not come from that rule."""
        recipe, norm_batch = hp["base_batch_size"], shape.norm_batch
        try:
            if device_batch(recipe, shape.devices, norm_batch) != shape.per_device:
                return []
        except ConfigError:
            return []
        return [f"global batch: {device_batch_reason(recipe, shape.devices, norm_batch)}"]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        out = self.training_forward(images)
        out, aux = out if isinstance(out, tuple) else (out, None)  # a decoder without an auxiliary head
        main_loss = self.criterion(out, labels)
        # Not on the progress bar: Lightning reads a bar's values from the device after every step (``.item()``);
        # the loggers read them every ``log_every_n_steps``.
        if aux is None:
            self.log_dict({"train/loss": main_loss, "train/main_loss": main_loss})
            return main_loss
        aux_loss = self.criterion(aux, labels)
        loss = main_loss + self.hparams.aux_weight * aux_loss
        self.log_dict({"train/loss": loss, "train/main_loss": main_loss, "train/aux_loss": aux_loss})
        return loss

    def eval_crop(self) -> int:
        return self.hparams.eval_crop or self.trainer.datamodule.crop_size

    def class_names(self) -> tuple[str, ...]:
        """The classes' names in index order, for the validation tables and the logged masks: the ``class_names``
        of the data module, else of the dataset evaluated (``python -m mabn test``'s loader of a checkpoint's
        split), when it has one per class; else ``class 0``, ``class 1``, ..."""
        n = self.hparams.num_classes
        try:
            trainer = self.trainer
        except RuntimeError:  # a task not attached to a trainer
            return default_class_names(n)
        loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        for source in (trainer.datamodule, *(getattr(loader, "dataset", None) for loader in loaders)):
            names = getattr(source, "class_names", None)
            if names is not None and len(names) == n:
                return tuple(names)
        return default_class_names(n)

    def predict_probs(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities (N, K, H, W) of full images by the sliding-window protocol (``eval_crop``,
        ``eval_flip``, ``eval_scales``)."""
        return sliding_window_logits(
            self.model,
            images,
            self.hparams.num_classes,
            self.eval_crop(),
            flip=self.hparams.eval_flip,
            scales=self.hparams.eval_scales,
        )

    def predict_classes(self, images: torch.Tensor) -> torch.Tensor:
        """Class ids (N, H, W) of full images by the sliding-window protocol: what validation, ``python -m mabn
        test`` and ``python -m mabn predict`` score."""
        return self.predict_probs(images).argmax(1)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        probs = self.predict_probs(images)
        preds = probs.argmax(1)
        self.val_metric.update(preds, labels)
        # The cross-entropy of the probabilities validation scores (the main head's, by sliding windows): no
        # forward beyond the evaluation's own.
        self.log("val/loss", probs_loss(probs, labels), sync_dist=True, batch_size=len(images))
        if batch_idx == 0 and self._log_predictions_now():
            count = self.hparams.num_logged_predictions  # the batch's first images
            wandb_media.log_predictions(self, images[:count], preds[:count], labels[:count], self.class_names())

    def on_test_epoch_start(self) -> None:
        self.test_metric.reset()

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.test_metric.update(self.predict_classes(images), labels)

    def on_test_epoch_end(self) -> None:
        # Kept in float64 for the caller (python -m mabn test prints it); the logged copies are float32.
        self.test_result = self.test_metric.compute()
        self._log_result("test", self.test_result)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The class ids of a batch of full images; ``batch`` is (images, anything the writer needs)."""
        return self.predict_classes(batch[0]).to(torch.uint8)

    def _log_predictions_now(self) -> bool:
        every, count = self.hparams.log_predictions_every_n_epochs, self.hparams.num_logged_predictions
        if not every or not count:
            return False
        return self.validations_done % every == 0 and bool(wandb_media.wandb_loggers(self))

    def _log_result(self, stage: str, result: Mapping[str, torch.Tensor]) -> None:
        """The means of a ``SegmentationMetric`` result as ``<stage>/...`` metrics, and its per-class table to
        wandb."""
        self.log(f"{stage}/miou", result["miou"].float(), prog_bar=stage == "val")
        self.log(f"{stage}/macc", result["macc"].float())
        self.log(f"{stage}/pixel_acc", result["pixel_accuracy"].float())
        wandb_media.log_class_table(self, stage, result, self.class_names())

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.validations_done += 1
        result = self.val_metric.compute()
        self.val_metric.reset()
        self._log_result("val", result)
        self.log("val/majority_miou", result["majority_miou"].float())
        per_class, names = result["per_class_iou"], self.class_names()
        for name, iou in zip(names, per_class.tolist()):
            if not math.isnan(iou):
                self.log(f"val/iou/{name}", iou)
        if not self.trainer.sanity_checking:
            table = format_iou_table(per_class, names, result["per_class_accuracy"])
            rank_zero_info(
                f"\nValidation at step {self.global_step}:\n{table}\n"
                f"(predicting the majority class everywhere: mIoU {100 * result['majority_miou'].item():.2f})"
            )

    def setup(self, stage: str) -> None:
        if stage == "fit":  # after the data module's setup and the batch layout's (BatchLayout), before its loaders
            # The class weights the data gives (classes.yaml's, or the training pixels counted by its check) and
            # the crop the loss sees.
            data = self.trainer.datamodule
            pixels = getattr(data, "class_pixels", None)
            self.criterion, lines = self.make_loss(
                self.hparams,
                self.class_names(),
                self.hparams.class_weights,
                getattr(data, "crop_size", None),
                getattr(data, "classes", None),
                None if pixels is None else pixels.pixels,
            )
            for line in lines:
                say(line)

    def configure_callbacks(self) -> list[pl.Callback]:
        return [*super().configure_callbacks(), BatchLayout()]

    @classmethod
    def memory_plan(cls, hp: Mapping[str, Any], *args: Any) -> memory.MemoryPlan:
        """The dry run's estimate of the memory per device and the per-device batch that fits
        (``mabn.tasks.memory.plan``)."""
        return memory.plan(cls.settings(hp), *args)

    def make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """SGD over the encoder at ``lr`` and the new heads at ``head_lr_mult`` x ``lr``."""
        hp = self.hparams
        heads = list(self.model.heads().parameters())
        head_ids = {id(p) for p in heads}
        encoder = [p for p in self.model.parameters() if id(p) not in head_ids]
        groups = [{"params": encoder, "lr": lr}, {"params": heads, "lr": lr * hp.head_lr_mult}]
        return torch.optim.SGD(groups, lr=lr, momentum=hp.momentum, weight_decay=hp.weight_decay)

    def configure_optimizers(self) -> dict[str, Any]:
        plan = self.fit_plan()
        optimizer = self.make_optimizer(plan.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# The help's loss names are the registry's (those registered when this module is imported: the built-in ones).
SegmentationTask.__doc__ = SegmentationTask.__doc__.replace("LOSS_NAMES", ", ".join(losses.LOSSES))


def default_class_names(count: int) -> tuple[str, ...]:
    """The names of ``count`` classes where the data gives none: ``class 0``, ``class 1``, ..."""
    return tuple(f"class {i}" for i in range(count))


def probs_loss(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy over the labelled pixels (``losses.cross_entropy``) of class probabilities instead of
    logits (their log is the log-softmax of the logits): validation's ``val/loss``, whatever the training loss, so
    that runs of different losses compare."""
    total = F.nll_loss(probs.clamp_min(1e-12).log(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
