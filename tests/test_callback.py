"""MABNCallback driven by a real Trainer: phases per group in optimizer steps, resets, exact resume, logging."""

import csv
import math
import os
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import mabn.norm.managed
from helpers.callback_task import POLICY, Tiny, loader
from helpers.trainer import quiet_trainer
from helpers.wandb_reader import history, offline_run, wandb_session
from mabn import BatchRenorm2d, MABN2d, convert_norm
from mabn.callbacks import MABNCallback, PhaseRule, norm_callbacks
from mabn.errors import ConfigError
from mabn.run.loggers import WandbLogger

# What MABNCallback logs per MABN layer (norm/<layer>/<key>).
MABN_LOGGED = ("chi2_batch", "chi2_sma", "chi2_ema", "psi_batch", "psi_bar", "r_mean", "r_clipped", "phase")


def test_phases_follow_optimizer_steps_per_group_under_accumulation(tmp_path):
    torch.manual_seed(0)
    model = Tiny(norm_policy=POLICY, record=True)
    quiet_trainer(tmp_path, max_steps=8, accumulate_grad_batches=2).fit(model, loader(32))
    assert len(model.seen) == 16  # two micro-batches per optimizer step
    for i, (step, enc_moving, enc_renorm, head_moving, head_renorm) in enumerate(model.seen):
        assert step == i // 2
        # The 2nd optimizer step (index 1) is the encoder's first with moving averages, as a layer's 2nd forward
        # with warmup_iters=2; r from index 4, after 4 steps.
        assert (enc_moving, enc_renorm) == (step >= 1, step >= 4), i
        assert (head_moving, head_renorm) == (step >= 4, step >= 6), i


def test_groups_must_match_layers(tmp_path):
    policy = {"groups": {"neck": {"prefixes": ["model.neck"]}}}
    with pytest.raises(ValueError, match="neck"):
        quiet_trainer(tmp_path, max_steps=1).fit(Tiny(norm_policy=policy), loader())


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            {**POLICY, "log_every_n_step": 3},
            "norm_policy has no setting 'log_every_n_step' (did you mean 'log_every_n_steps'?",
        ),
        (
            {"groups": {"encoder": {"prefixes": ["model.encoder"], "renorm_frist_step": 4}}},
            "norm_policy.groups.encoder has no setting 'renorm_frist_step' (did you mean 'renorm_first_step'?",
        ),
        ({"groups": {"encoder": {"moving_stats_first_step": 2}}}, "norm_policy.groups.encoder needs 'prefixes'"),
    ],
    ids=["policy-key", "group-key", "group-without-prefixes"],
)
def test_a_misspelt_policy_key_is_refused_naming_it(policy, message):
    """A typo in norm_policy or in one of its module groups is a ConfigError, one line naming the key and the
    setting meant: ignored, it would leave that setting at its default without a word."""
    with pytest.raises(ConfigError) as info:
        norm_callbacks(Tiny().model, policy)
    assert str(info.value).startswith(message), str(info.value)
    assert len(str(info.value).splitlines()) == 1


def _prefill(model, running_var=7.0):
    for layer in model.norms():
        layer.iters.fill_(5000)
        layer.count_x2.fill_(9999)
        layer.buffer_x2.fill_(3.0)
        layer.running_var.fill_(running_var)


@pytest.mark.parametrize("reset_ema", [False, True])
def test_fit_from_a_backbone_restarts_the_streams(tmp_path, reset_ema):
    model = Tiny(norm_policy={"reset_ema": reset_ema}, backbone="pretrain/resnet101-mabn.pt")
    _prefill(model)
    quiet_trainer(tmp_path, max_steps=3).fit(model, loader())
    for layer in model.norms():
        assert layer.iters.item() == 3 and layer.count_x2.item() == 6  # counted again from zero
        kept = layer.running_var.min().item() > 5.0  # 0.9**3 * 7 is still above 5
        assert kept != reset_ema
    callback = next(c for c in model.trainer.callbacks if isinstance(c, MABNCallback))
    assert callback.resets == [0]


def test_fit_from_scratch_keeps_the_streams(tmp_path):
    model = Tiny()
    _prefill(model)
    quiet_trainer(tmp_path, max_steps=3).fit(model, loader())
    assert all(layer.iters.item() == 5003 for layer in model.norms())


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    policy = {**POLICY, "reset_at_step": 5}
    torch.manual_seed(0)
    straight = Tiny(norm_policy=policy, backbone="x")
    # 4 batches an epoch: the checkpoint after step 4 sits at an epoch boundary.
    saver = pl.callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    quiet_trainer(tmp_path / "a", max_steps=8, enable_checkpointing=True, callbacks=[saver]).fit(straight, loader())
    mid = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert mid.is_file()

    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    resumed = Tiny(norm_policy=policy, backbone="x")
    quiet_trainer(tmp_path / "b", max_steps=8).fit(resumed, loader(), ckpt_path=mid)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    callbacks = [next(c for c in m.trainer.callbacks if isinstance(c, MABNCallback)) for m in (straight, resumed)]
    assert callbacks[0].resets == callbacks[1].resets == [0, 5]  # no second reset from the backbone on resume


def test_statistics_are_logged_every_k_steps(tmp_path):
    logger = pl.loggers.CSVLogger(tmp_path, name="csv")
    model = Tiny(norm_policy={**POLICY, "log_every_n_steps": 3})
    quiet_trainer(tmp_path, max_steps=8, logger=logger, log_every_n_steps=50).fit(model, loader())
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    keys = MABN_LOGGED
    for layer in ("model.encoder.1", "model.head.1"):
        logged = [r for r in rows if r.get(f"norm/{layer}/chi2_batch")]
        # the batches of steps 0, 3 and 6, logged as Lightning counts this plain module's own training rows (the
        # steps before the batch; a NormTask's rows carry the steps done: tests/test_run_steps.py)
        assert [int(r["step"]) for r in logged] == [0, 3, 6]
        for row in logged:
            assert all(float(row[f"norm/{layer}/{k}"]) == float(row[f"norm/{layer}/{k}"]) for k in keys)
    phases = [float(r["norm/model.encoder.1/phase"]) for r in rows if r.get("norm/model.encoder.1/phase")]
    assert phases == [0.0, 1.0, 2.0]  # batch statistics, moving averages, renormalized


def test_tracking_off_costs_no_state(tmp_path):
    model = Tiny(norm_policy={**POLICY, "log_every_n_steps": 0})
    quiet_trainer(tmp_path, max_steps=2).fit(model, loader())
    assert all(layer.last_stats is None and not layer.track_stats for layer in model.norms())


def test_default_run_without_network_or_login_finishes_offline(tmp_path, monkeypatch, request):
    wandb_session(request, monkeypatch, "offline")  # a fresh wandb session whatever ran before; mode unset below
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no saved `wandb login`
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.chdir(tmp_path)
    logger = WandbLogger(save_dir=str(tmp_path / "runs"))
    model = Tiny(norm_policy=POLICY)
    quiet_trainer(tmp_path, max_steps=2, logger=logger).fit(model, loader())
    assert model.trainer.state.finished
    assert logger._offline
    runs = list((tmp_path / "runs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    logger.experiment.finish()
    assert os.environ.get("WANDB_MODE") in (None, "dryrun", "offline")


def test_offline_wandb_run_holds_the_statistics_read_back_by_wandb(tmp_path, monkeypatch, request):
    wandb_session(request, monkeypatch, "offline")
    monkeypatch.chdir(tmp_path)
    wandb_logger = WandbLogger(save_dir=str(tmp_path / "runs"))
    csv_logger = pl.loggers.CSVLogger(tmp_path, name="csv")
    model = Tiny(norm_policy={**POLICY, "log_every_n_steps": 3})
    quiet_trainer(tmp_path, max_steps=8, logger=[csv_logger, wandb_logger], log_every_n_steps=50).fit(model, loader())
    wandb_logger.experiment.finish()  # flush and close the transaction log before reading it

    rows = [r for r in history(offline_run(tmp_path / "runs")) if any(k.startswith("norm/") for k in r)]
    assert [r["trainer/global_step"] for r in rows] == [0, 3, 6]  # as test_statistics_are_logged_every_k_steps
    csv_rows = [
        r for r in csv.DictReader(open(Path(csv_logger.log_dir) / "metrics.csv")) if r.get("norm/model.head.1/phase")
    ]
    keys = MABN_LOGGED
    for layer in ("model.encoder.1", "model.head.1"):
        for row, csv_row in zip(rows, csv_rows, strict=True):
            for key in keys:
                name = f"norm/{layer}/{key}"
                assert math.isfinite(row[name]), name
                assert row[name] == pytest.approx(float(csv_row[name]), rel=1e-6), name  # the same values
    assert [r["norm/model.encoder.1/phase"] for r in rows] == [0, 1, 2]


def test_layers_are_managed_only_when_present():
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    assert norm_callbacks(plain, None) == []
    assert isinstance(norm_callbacks(convert_norm(plain, "mabn"), None)[0], MABNCallback)
    assert isinstance(MABN2d(3).policy, type(None))


def test_brn_summary_holds_the_running_statistics_its_step_used():
    """BRN's logged running mean and std are the ones its step renormalized against, from before the step's
    update (in float32 the layer's statistics would otherwise alias the buffers updated in place)."""
    torch.manual_seed(0)
    brn = BatchRenorm2d(3)
    for _ in range(3):
        brn(torch.randn(4, 3, 5, 5) + 2.0)
    before = {k: brn.get_buffer(k).detach().double().clone() for k in ("running_mean", "running_std")}
    brn.track_stats = True
    brn(torch.randn(4, 3, 5, 5) + 2.0)
    summary = brn.summary()
    for key, buffer in (("mu_ema", "running_mean"), ("sigma_ema", "running_std")):
        assert summary[key] == pytest.approx(float(torch.linalg.vector_norm(before[buffer])), rel=1e-6), key
        assert not torch.equal(brn.get_buffer(buffer).double(), before[buffer]), "the step updated it afterwards"


@pytest.mark.parametrize(("warmup", "renorm"), [(3, 6), (1, 2), (4, 4)])
def test_callback_rule_switches_at_the_layers_own_forward_numbers(warmup, renorm):
    """A layer on its own timeline (warmup_iters, renorm_warmup_iters) and one driven by the callback's rule
    with the same numbers, one forward per optimizer step, give the same outputs, gradients and buffers at every
    step: both switch to moving averages at the same forward and start renormalizing at the same forward."""
    torch.manual_seed(0)
    kw = dict(buffer_size=2, momentum=0.5, renorm_clip=1.2)
    own = MABN2d(3, warmup_iters=warmup, renorm_warmup_iters=renorm, **kw).double()
    driven = MABN2d(3, warmup_iters=10**6, renorm_warmup_iters=10**6, **kw).double()  # only the policy decides
    rule = PhaseRule(prefixes=["x"], moving_stats_first_step=warmup, renorm_first_step=renorm + 1)
    switched = []
    for step in range(renorm + 4):
        driven.policy = rule.phase(step)
        x = torch.randn(2, 3, 2, 2, dtype=torch.float64) * (1 + step)  # a changing scale makes r differ from 1
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_own, out_driven = own(xa), driven(xb)
        assert torch.equal(out_own, out_driven), step
        grad = torch.randn_like(out_own)
        out_own.backward(grad)
        out_driven.backward(grad)
        assert torch.equal(xa.grad, xb.grad), step
        switched.append(rule.phase(step))
    for key, value in own.state_dict().items():
        if key != "iters":
            assert torch.equal(driven.state_dict()[key], value), key
    moving, renormalizing = [s[0] for s in switched], [s[1] for s in switched]
    assert moving.index(True) == warmup - 1 and renormalizing.index(True) == max(renorm, warmup)


# -- non-finite statistics in a fit ------------------------------------------------------------------------
class NaNInput(Tiny):
    """Tiny whose input is NaN at optimizer step ``nan_step``: the encoder's MABN2d meets a non-finite chi^2 (and
    the head's, downstream). Counts its validation batches."""

    nan_step = 3
    validated = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x * float("nan") if self.global_step == self.nan_step else x, y), batch_idx)

    def validation_step(self, batch, batch_idx):
        self.validated += 1


def _fit_into_nan(tmp_path, monkeypatch, at_once=False, **kwargs):
    """A fit with a NaN input at step 3: the FloatingPointError's message and the optimizer steps done when it
    came. ``at_once`` False: the CPU layers act as CUDA ones, their verdicts only in the device flags."""
    if not at_once:
        monkeypatch.setattr(mabn.norm.managed, "reads_at_once", lambda device: False)
    trainer = quiet_trainer(tmp_path, **{"max_steps": 8, "limit_val_batches": 0, **kwargs})
    model = NaNInput(norm_policy=POLICY)
    with pytest.raises(FloatingPointError, match="MABN2d: non-finite batch statistic chi") as error:
        trainer.fit(model, loader(64), loader(8))
    return str(error.value), trainer.global_step, model


@pytest.mark.parametrize("at_once", [True, False], ids=["cpu", "as-on-cuda"])
def test_a_non_finite_statistic_stops_the_fit_naming_its_step_and_layer(tmp_path, monkeypatch, at_once):
    """On the CPU the layer raises within step 3. Where the verdict stays on the device, MABNCallback reads it one
    step late, before the update of step 4, and names step 3 and the first layer that met it."""
    message, done, _ = _fit_into_nan(tmp_path, monkeypatch, at_once)
    if at_once:
        assert done == NaNInput.nan_step and "optimizer step" not in message
    else:
        assert done == NaNInput.nan_step + 1
        assert message.endswith(f"(at optimizer step {NaNInput.nan_step}, layer model.encoder.1 and 1 more)"), message


def test_a_non_finite_statistic_of_the_last_step_is_reported_at_the_end(tmp_path, monkeypatch):
    message, done, _ = _fit_into_nan(tmp_path, monkeypatch, max_steps=NaNInput.nan_step + 1)
    assert done == NaNInput.nan_step + 1  # every step ran: the fit's end read the last copy
    assert f"at optimizer step {NaNInput.nan_step}," in message


def test_weights_updated_with_a_non_finite_statistic_are_neither_saved_nor_validated(tmp_path, monkeypatch):
    """Step 3's update takes its NaN gradient before the late read: the checkpoint after it is refused, and so is
    a validation of those weights."""
    every_step = pl.callbacks.ModelCheckpoint(tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    message, _, _ = _fit_into_nan(tmp_path, monkeypatch, callbacks=[every_step], enable_checkpointing=True)
    assert f"at optimizer step {NaNInput.nan_step}," in message
    saved = sorted(int(p.stem.removeprefix("step=")) for p in tmp_path.glob("*.ckpt"))
    assert saved == list(range(1, NaNInput.nan_step + 1))  # after steps 0 to 2: no NaN weights

    validations = {"val_check_interval": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0}
    message, _, model = _fit_into_nan(tmp_path / "val", monkeypatch, **validations)
    assert f"at optimizer step {NaNInput.nan_step}," in message
    assert model.validated == 1  # after step 1; not after step 3
