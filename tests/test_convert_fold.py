"""convert_norm on real architectures, and fold_norms against the unfolded eval model."""

import pytest
import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from helpers.folding import randomize_affine
from helpers.marks import default_suite_runs
from mabn import BatchRenorm2d, CenConv2d, MABN2d, convert_norm, fold_norms
from mabn.norm import NORM_PRESETS

NORM_TYPES = {
    "bn": nn.BatchNorm2d,
    "syncbn": nn.SyncBatchNorm,
    "gn": nn.GroupNorm,
    "brn": BatchRenorm2d,
    "mabn": MABN2d,
}
ALL_NORMS = tuple(NORM_TYPES.values())


def _conv_weights(model):
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}


def _pspnet():
    return smp.PSPNet("resnet101", encoder_weights=None, encoder_depth=5, classes=19)


@pytest.mark.parametrize(
    "builder", [lambda: torchvision.models.resnet101(weights=None), _pspnet], ids=["resnet101", "smp-pspnet"]
)
@pytest.mark.parametrize("norm", default_suite_runs(sorted(NORM_TYPES), keep=["mabn"]))
def test_convert_replaces_every_batchnorm_and_keeps_conv_weights(builder, norm):
    model = builder()
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    weights = _conv_weights(model)
    convert_norm(model, norm)
    norms = [m for m in model.modules() if isinstance(m, ALL_NORMS)]
    assert len(norms) == n_bn
    assert all(type(m) is NORM_TYPES[norm] for m in norms)
    assert _conv_weights(model).keys() == weights.keys()
    for name, w in _conv_weights(model).items():
        assert torch.equal(w, weights[name]), name
    cen = [n for n, m in model.named_modules() if isinstance(m, CenConv2d)]
    if norm == "mabn":
        # every conv that feeds a norm is centred: as many as there are norms
        assert len(cen) == n_bn
    else:
        assert cen == []
    if norm == "gn":
        assert all(m.num_groups == 32 for m in norms)


def _conv_bn_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("norm", ["bn", "gn", "mabn"])
def test_converted_layers_live_where_the_model_does_and_centred_convs_keep_its_weights(norm, device):
    """New norms are built on the default device (the CPU) and moved to their BatchNorm's where it differs (a
    model on the meta device); a centred conv takes its conv's own weight tensor."""
    with torch.device(device):
        model = _conv_bn_net()
    weights = [model[0].weight, model[3].weight]
    convert_norm(model, norm)
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {device}
    assert model[0].weight is weights[0] and model[3].weight is weights[1]
    assert type(model[1]) is NORM_TYPES[norm] and (norm == "mabn") == isinstance(model[0], CenConv2d)


@pytest.mark.slow  # a training step of smp's PSPNet-101
def test_mabn_converted_pspnet_trains_a_step():
    model = convert_norm(_pspnet(), "mabn", norm_batch_size=2, warmup_iters=1, renorm_warmup_iters=1)
    x = torch.randn(4, 3, 64, 64)
    out = model(x)
    out.square().mean().backward()
    assert out.shape[:2] == (4, 19)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_convert_momentum_is_in_the_paper_convention():
    bn = convert_norm(nn.Sequential(nn.Conv2d(1, 4, 1), nn.BatchNorm2d(4)), "bn", momentum=0.9)[1]
    x = torch.randn(8, 4, 3, 3) + 2.0
    bn(x)
    torch.testing.assert_close(bn.running_mean, 0.1 * x.mean(dim=(0, 2, 3)))
    mabn = convert_norm(nn.Sequential(nn.Conv2d(1, 4, 1), nn.BatchNorm2d(4)), "mabn", momentum=0.9)[1]
    mabn(x)
    torch.testing.assert_close(mabn.running_var, 0.9 + 0.1 * x.square().mean(dim=(0, 2, 3)))


def test_ghost_bn_normalizes_each_group_by_its_own_batch_statistics():
    bn = convert_norm(nn.Sequential(nn.BatchNorm2d(3)), "bn", norm_batch_size=2)[0]
    x = torch.randn(6, 3, 4, 4) * torch.tensor([1.0, 3.0, 0.5]).view(1, 3, 1, 1)
    out = bn(x)
    for k in range(3):
        group = x[2 * k : 2 * k + 2].double()
        mu = group.mean(dim=(0, 2, 3), keepdim=True)
        var = group.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
        torch.testing.assert_close(
            out[2 * k : 2 * k + 2].double(), (group - mu) / (var + 1e-5).sqrt(), rtol=1e-5, atol=1e-5
        )


def test_unknown_norm_and_misplaced_arguments_are_named():
    with pytest.raises(ValueError, match="unknown norm 'batchnorm'"):
        convert_norm(nn.Sequential(nn.BatchNorm2d(2)), "batchnorm")
    with pytest.raises(TypeError, match="buffer_size"):
        convert_norm(nn.Sequential(nn.BatchNorm2d(2)), "gn", buffer_size=4)


def test_presets_build_the_ablation_layers():
    for name, preset in NORM_PRESETS.items():
        model = convert_norm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), name)
        assert isinstance(model[0], CenConv2d) == preset.centre_weights, name
        for key, value in preset.layer_kwargs.items():
            assert getattr(model[1], key) == value, (name, key)


def _trained_like(norm):
    """A ResNet-101 whose inference statistics are real: random gamma/beta, then one training-mode
    forward with momentum 0 (paper convention), so every running statistic is that batch's."""
    model = convert_norm(torchvision.models.resnet101(weights=None), norm, momentum=0.0)
    gen = torch.Generator().manual_seed(3)
    randomize_affine(model, ALL_NORMS, gen)
    with torch.no_grad():
        model.train()(torch.randn(4, 3, 64, 64, generator=gen))
    return model.eval()


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.slow  # ResNet-101 in float64; test_decoders.py and test_export.py fold in the default suite
@pytest.mark.parametrize("norm", ["bn", "syncbn", "brn", "mabn"])
def test_fold_matches_unfolded_resnet101(norm):
    model = _trained_like(norm).double()
    folded = fold_norms(model)
    left = [type(m).__name__ for m in folded.modules() if isinstance(m, (*ALL_NORMS, CenConv2d))]
    assert left == []
    assert model.training is False and any(isinstance(m, ALL_NORMS) for m in model.modules())  # untouched
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        assert _rel(folded(x), model(x)) < 1e-10  # folding is exact algebra

        # In float32 the two models round differently; a random-init ResNet-101 amplifies float32
        # rounding to ~1e-4 of its output, so hold the folded model to the unfolded one's own error.
        truth = model(x)
        model32, folded32 = model.float(), fold_norms(model.float())
        x32 = x.float()
        assert _rel(folded32(x32), truth) <= 2 * _rel(model32(x32), truth) + 1e-6


def test_fold_leaves_group_norm_and_folds_centred_weights():
    model = convert_norm(nn.Sequential(nn.Conv2d(3, 32, 3), nn.BatchNorm2d(32), nn.ReLU()), "gn")
    folded = fold_norms(model)
    assert isinstance(folded[1], nn.GroupNorm)
    conv = CenConv2d(3, 4, 3, bias=False)
    folded = fold_norms(nn.Sequential(conv, nn.ReLU()))
    assert type(folded[0]) is nn.Conv2d
    x = torch.randn(1, 3, 6, 6)
    w = conv.weight.detach().double()
    expected = F.conv2d(x.double(), w - w.mean(dim=(1, 2, 3), keepdim=True))
    torch.testing.assert_close(folded[0](x).double(), expected, rtol=1e-5, atol=1e-5)


def test_cenconv_centres_filters_and_projects_the_gradient():
    conv = CenConv2d(4, 5, 3, padding=1, bias=True).double()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    g = torch.randn(2, 5, 6, 6, dtype=torch.float64)
    w = conv.weight.detach()
    w_c = (w - w.mean(dim=(1, 2, 3), keepdim=True)).requires_grad_()
    expected = F.conv2d(x, w_c, conv.bias.detach(), padding=1)
    expected.backward(g)
    out = conv(x)
    out.backward(g)
    torch.testing.assert_close(out, expected)
    # d/dW of f(W - mean W) is the filter gradient minus its mean over each filter
    grad_c = w_c.grad
    torch.testing.assert_close(conv.weight.grad, grad_c - grad_c.mean(dim=(1, 2, 3), keepdim=True))
    assert conv.weight.grad.sum(dim=(1, 2, 3)).abs().max() < 1e-10
