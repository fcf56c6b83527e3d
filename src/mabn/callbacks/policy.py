"""NormPolicy and PhaseRule: MABNCallback's settings, as a task's ``norm_policy`` argument takes them.

The configs spell them under the task's ``norm_policy:``::

    norm_policy:
      groups:                  # module groups by name, each on its own phase timeline
        encoder: {prefixes: [model.encoder], moving_stats_first_step: 100, renorm_first_step: 1001}
        heads: {prefixes: [model.ppm, model.classifier, model.aux]}
      reset_from_pretrained: true
      log_every_n_steps: null    # 50, at most an epoch's optimizer steps

LightningCLI checks a config against these dataclasses, so a misspelt key stops the command before anything is
built, and ``--print_config`` shows every setting with its value. Python callers may pass the same mapping:
``NormPolicy.parse`` refuses an unknown key with a ``ConfigError`` that names it.

``groups`` are groups of modules, found by name prefix; they are unrelated to the ghost-batch groups
(``norm_batch_size``) that a layer splits each batch into.

A checkpoint's hyperparameters may name a rule's first steps by the keys ``moving_stats_from`` (the first step with
moving statistics) and ``renorm_from`` (the last step before renormalization): ``NormPolicy.from_checkpoint``
translates them, while ``NormPolicy.parse`` (a config, a Python caller) refuses them with one line naming the key
to write.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from ..errors import ConfigError
from ..norm.phase import phase


@dataclass(frozen=True)
class PhaseRule:
    """A module group's phases, counted in optimizer steps on MABN2d's own timeline.

    Args:
        prefixes: the group's layers: those whose qualified name (e.g. ``model.encoder.layer1.0.bn1``) starts
            with one of these.
        moving_stats_first_step: the first optimizer step (1-based) that uses moving averages, as a layer's
            ``warmup_iters``-th forward.
        renorm_first_step: the first optimizer step (1-based) that renormalizes, as a layer's
            ``renorm_warmup_iters + 1``-th forward; never before the step after ``moving_stats_first_step``.
    """

    prefixes: list[str]
    moving_stats_first_step: int = 100
    renorm_first_step: int = 1001

    @classmethod
    def parse(cls, value: PhaseRule | Mapping[str, Any], where: str) -> PhaseRule:
        """``value`` as a PhaseRule; a mapping is checked key by key (``where`` names it in the error)."""
        return value if isinstance(value, cls) else cls(**_checked(cls, value, where))

    def phase(self, step: int) -> tuple[bool, bool]:
        """(moving averages, renormalization) at the 0-based optimizer step ``step``: the layers' phase rule
        (``mabn.norm.phase``) at step number t = step + 1."""
        return phase(step + 1, self.moving_stats_first_step, self.renorm_first_step)


@dataclass(frozen=True)
class NormPolicy:
    """How MABNCallback drives the callback-managed norms (MABN2d, BatchRenorm2d) of a fit.

    Args:
        groups: module groups by name (e.g. ``encoder``, ``heads``), each with its own phase rule; layers in no
            group keep their own timeline (the layer arguments warmup_iters / renorm_warmup_iters, in forwards).
        reset_from_pretrained: when a fit starts from a pre-trained backbone (the task's ``backbone`` argument)
            and is not a resume, restart every stream so warm-up runs again on the new data.
        reset_ema: also return the EMAs to their initial value on a reset. Off by default: the backbone's EMA
            makes evaluations before renormalization starts meaningful, and by the time r is used (at
            renorm_first_step, momentum 0.98) its weight in the EMA is 0.98**renorm_first_step ~ 0.
        reset_at_step: restart the streams once more at this optimizer step (e.g. the end of the lr warm-up), so
            the SMA and EMA hold only statistics of the settled weights; null: never.
        log_every_n_steps: log the statistics of ``log_layers`` every this many optimizer steps (0: never); null:
            every 50, at most the optimizer steps of an epoch (``mabn.run.progress.epoch_cadence``), so that a
            short run plots more than its first step.
        log_layers: qualified names of the logged layers; null: the first norm of layer1 and the first norm of
            each head (``mabn.models.logged_norms``).
    """

    groups: dict[str, PhaseRule] = field(default_factory=dict)
    reset_from_pretrained: bool = True
    reset_ema: bool = False
    reset_at_step: int | None = None
    log_every_n_steps: int | None = None
    log_layers: list[str] | None = None

    @classmethod
    def parse(cls, value: NormPolicy | Mapping[str, Any] | None) -> NormPolicy:
        """``value`` as a NormPolicy: None gives the defaults; a mapping is checked key by key, and a key that is
        no setting raises a ``ConfigError`` naming it and the closest setting."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        settings = _checked(cls, value, "norm_policy")
        rules = settings.get("groups") or {}
        settings["groups"] = {name: PhaseRule.parse(rule, f"norm_policy.groups.{name}") for name, rule in rules.items()}
        return cls(**settings)

    @classmethod
    def from_checkpoint(cls, value: Mapping[str, Any] | None) -> NormPolicy:
        """``parse`` of a checkpoint's ``norm_policy``, whose rules may name their first steps by the keys
        ``moving_stats_from`` and ``renorm_from`` (see the module's description): those are translated."""
        if not isinstance(value, Mapping) or not isinstance(value.get("groups"), Mapping):
            return cls.parse(value)
        groups = {name: _translated(rule) for name, rule in value["groups"].items()}
        return cls.parse({**value, "groups": groups})

    def as_dict(self) -> dict[str, Any]:
        """Plain values, as the configs spell them: what a checkpoint's hyperparameters hold."""
        return asdict(self)


# PhaseRule's keys in a checkpoint's hyperparameters that name its first steps otherwise: key -> (the setting,
# its value from the key's).
_CHECKPOINT_KEYS = {
    "moving_stats_from": ("moving_stats_first_step", lambda step: step),
    "renorm_from": ("renorm_first_step", lambda last_without: last_without + 1),
}


def _translated(rule: Any) -> Any:
    """A checkpoint's rule with its ``_CHECKPOINT_KEYS`` replaced by the settings they mean."""
    if not isinstance(rule, Mapping):
        return rule
    out = {}
    for key, value in rule.items():
        setting, convert = _CHECKPOINT_KEYS.get(key, (key, None))
        out[setting] = value if convert is None else convert(value)
    return out


def _checked(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` as keyword arguments of the dataclass ``cls``, or a ``ConfigError`` naming an unknown or missing
    key at ``where``."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a mapping of settings, got {values!r}")
    known = [f.name for f in fields(cls)]
    for key in values:
        if cls is PhaseRule and key in _CHECKPOINT_KEYS:
            setting, convert = _CHECKPOINT_KEYS[key]
            value = values[key]
            same = f": {convert(value)} (the same phase as {key}: {value})" if isinstance(value, int) else ""
            raise ConfigError(f"{where}: {key} is no setting; write {setting}{same}")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where} has no setting {key!r} ({hint}{cls.__name__} takes {', '.join(known)})")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    for key in required:
        if key not in values:
            raise ConfigError(f"{where} needs {key!r}")
    return dict(values)
