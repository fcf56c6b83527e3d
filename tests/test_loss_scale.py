"""MABN2d under a loss scaler (``precision="16-mixed"``): the gradients that backward receives are S times the
loss's, and the scaler changes S during training (x2 after a run of finite steps, /2 after an overflow).

psi must stay in the loss's units (its moving average would otherwise mix scales), and an overflowing backward
must be left to the scaler, which skips that optimizer step, instead of stopping training.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision

from helpers.callback_task import POLICY, Tiny, loader
from helpers.kernels import paths, take
from helpers.layer_runs import MABN_CFG, C, H, W, close, random_affine, random_input, set_affine, train_step
from helpers.marks import default_suite_runs
from helpers.precision import ScalingOnly
from helpers.reference import RefMABN
from helpers.trainer import quiet_trainer
from mabn.norm import MABN2d

pytestmark = pytest.mark.gpu

# A scaler's scales (growth, backoff) and arbitrary ones, which round differently from powers of two.
SCALES = (65536.0, 65536.0, 32768.0, 3.0, 1000.0, 0.125)
PATHS = [name for name, _ in paths()]


# The fused path's case takes 6 s in Triton's interpreter: the default suite runs it on a GPU, the slow suite
# everywhere (the fused path under a loss scale stays in the default suite through the overflow test below).
@pytest.mark.parametrize("path", default_suite_runs(PATHS, keep=["torch ops"], keep_compiled=["fused"]))
@pytest.mark.parametrize(
    "n, norm_batch_size", [(6, 2), pytest.param(2, None, marks=pytest.mark.slow)], ids=["N6-ghost2", "N2-whole"]
)
@pytest.mark.parametrize("stats", default_suite_runs(["sma", "ema"], keep=["sma"]))
def test_scaled_gradients_match_the_unscaled_reference(stats, n, norm_batch_size, path, device, monkeypatch):
    """Gradient S_t * dL/dout in, loss_scale = S_t: the gradients are S_t times the float64 reference's and
    every statistic (EMA, psi's window and EMA) is the reference's, through warm-up, moving statistics and
    renormalization."""
    take(monkeypatch, dict(paths())[path])
    gen = torch.Generator().manual_seed(99)
    weight, bias = random_affine(gen)
    layer = MABN2d(C, norm_batch_size=norm_batch_size, stats=stats, **MABN_CFG).double().to(device)
    set_affine(layer, weight, bias)
    layer.loss_scale = torch.zeros((), dtype=torch.float32, device=device)
    ref = RefMABN(weight, bias, norm_batch_size=norm_batch_size, stats=stats, **MABN_CFG)
    m = MABN_CFG["buffer_size"]
    for step in range(1, 31):
        scale = SCALES[step % len(SCALES)]
        layer.loss_scale.fill_(scale)  # in place, as MABNCallback does
        x = random_input(gen, n, step)
        grad_out = torch.randn(n, C, H, W, generator=gen, dtype=torch.float64)
        out, gx, gw, gb = train_step(layer, x, scale * grad_out)
        close(out, ref.forward(x), "output", step)
        for what, got, expected in zip(("input", "weight", "bias"), (gx, gw, gb), ref.backward(grad_out)):
            close(got / scale, expected, f"grad wrt {what} / S", step)
        close(layer.running_var.cpu(), ref.ema, "running_var", step)
        if len(ref.psi_stream) >= m:
            close(layer.buffer_gz.cpu(), torch.stack(ref.psi_stream[-m:]), "psi window", step)
        if stats == "ema":
            close(layer.running_psi.cpu(), ref.psi_ema, "psi EMA", step)
    assert any(ref.log[-1]["active"]) and ref.log[-1]["renorm_on"], "the run must reach moving statistics and r"


@pytest.mark.parametrize("path", PATHS)
def test_overflowing_backward_is_left_to_the_scaler(path, device, monkeypatch):
    """A non-finite gradient under a loss scale: no error (the scaler skips the step), psi's streams unchanged,
    nothing flagged for later; the following steps go on as the reference's with that backward left out."""
    take(monkeypatch, dict(paths())[path])
    gen = torch.Generator().manual_seed(5)
    weight, bias = random_affine(gen)
    cfg = dict(MABN_CFG, warmup_iters=2)
    layer = MABN2d(C, norm_batch_size=2, **cfg).double().to(device)
    set_affine(layer, weight, bias)
    layer.loss_scale = torch.full((), 1024.0, device=device)
    ref = RefMABN(weight, bias, norm_batch_size=2, **cfg)
    for step in range(1, 13):
        x = random_input(gen, 6, step)
        grad_out = torch.randn(6, C, H, W, generator=gen, dtype=torch.float64)
        if step == 8:  # the overflow: the reference runs this forward only
            ref.forward(x)
            psi_before = {k: v.clone() for k, v in layer.state_dict().items() if k in ("buffer_gz", "count_gz")}
            grad_out[1, 2, 0, 0] = float("inf")
            out, gx, _, _ = train_step(layer, x, grad_out * 1024.0)
            layer.raise_if_nonfinite()  # nothing left for MABNCallback to raise
            assert not torch.isfinite(gx).all(), "the scaler must see the overflow in the gradients"
            for key, value in psi_before.items():
                assert torch.equal(layer.state_dict()[key], value), f"{key} changed by the overflowing backward"
            continue
        out, gx, gw, gb = train_step(layer, x, grad_out * 1024.0)
        close(out, ref.forward(x), "output", step)
        close(gx / 1024.0, ref.backward(grad_out)[0], "grad wrt input / S", step)
    assert int(layer.count_gz) == int(layer.count_x2) - 3  # one backward's three groups left out

    layer.loss_scale = None  # without a scaler the same gradient is an error, as before
    out = layer(random_input(gen, 6).to(device))
    with pytest.raises(FloatingPointError, match="psi"):
        out.backward(torch.full_like(out, float("nan")))
        layer.raise_if_nonfinite()


def _fit(tmp_path, scaler=None, model=None, **kwargs):
    pl.seed_everything(0)
    model = model or Tiny(norm_policy=POLICY)
    plugins = [ScalingOnly("16-mixed", "cpu", scaler=scaler)] if scaler is not None else []
    quiet_trainer(tmp_path, max_epochs=3, plugins=plugins, **kwargs).fit(model, loader())
    return model


def test_fit_under_a_changing_loss_scale_equals_the_unscaled_fit(tmp_path):
    """A scale that doubles at every step (16 to 65536 over 12 steps): the same weights and statistics, bit
    for bit, as the fit without a scaler."""
    unscaled = _fit(tmp_path / "fp32")
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
    scaled = _fit(tmp_path / "scaled", scaler)
    assert scaler.get_scale() == 16.0 * 2**12
    expected = unscaled.state_dict()
    for key, value in scaled.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert all(layer.loss_scale is None for layer in scaled.norms()), "the fit's scale must not outlive it"


class Overflow(Tiny):
    """Tiny whose loss is infinite at one step: the scaled backward overflows, as fp16 gradients do."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.global_step == 5 else loss


def test_fit_skips_an_overflowing_step_as_the_scaler_does(tmp_path):
    """The fit goes on: the scaler skips the step and halves its scale, MABN2d leaves that backward's psi out."""
    model = Overflow(norm_policy=POLICY)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    steps = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx):
            steps.append(pl_module.model.encoder[0].weight.detach().clone())

    _fit(tmp_path, scaler, model, callbacks=[Record()])
    assert scaler.get_scale() == 2.0**9
    assert len(steps) == 12 and torch.equal(steps[5], steps[4]), "the overflowing step must not move the weights"
    for layer in model.norms():
        assert int(layer.count_gz) == int(layer.count_x2) - 2  # one backward's two groups left out
        assert torch.isfinite(layer.buffer_gz).all() and torch.isfinite(layer.weight).all()


def test_16_mixed_fit_through_real_float16_overflows(tmp_path, device):
    """Lightning's 16-mixed with autocast to float16 and a scale that overflows float16 gradients at first: the
    scaler backs off over several skipped steps, and psi's window holds values in the loss's units (those of
    the float32 fit), not S times them. On the test device: autocast of another device's type casts nothing."""
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    reference = _fit(tmp_path / "fp32", accelerator=accelerator)
    model = Tiny(norm_policy=POLICY)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**24, growth_interval=1000)
    pl.seed_everything(0)
    plugins = [MixedPrecision("16-mixed", device.type, scaler=scaler)]
    quiet_trainer(tmp_path / "fp16", max_epochs=3, plugins=plugins, accelerator=accelerator).fit(model, loader())
    assert scaler.get_scale() < 2.0**24
    for layer, ref in zip(model.norms(), reference.norms()):
        assert int(layer.count_gz) < int(layer.count_x2), "no backward was skipped: nothing overflowed"
        assert torch.isfinite(layer.buffer_gz).all()
        ratio = layer.buffer_gz.abs().max() / ref.buffer_gz.abs().max()
        assert 0.1 < ratio < 10, f"psi's window is {float(ratio):.3g} times the float32 fit's"
