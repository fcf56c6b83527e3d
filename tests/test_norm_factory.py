"""create_norm, the one builder of a named norm's layer (convert_norm's and so the models'), and GhostBatchNorm2d,
the layer bn builds for ghost batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mabn import convert_norm
from mabn.norm import NORM_PRESETS, BatchRenorm2d, FrozenBatchNorm2d, GhostBatchNorm2d, MABN2d, create_norm

LAYERS = {
    "bn": nn.BatchNorm2d,
    "syncbn": nn.SyncBatchNorm,
    "gn": nn.GroupNorm,
    "brn": BatchRenorm2d,
    "mabn": MABN2d,
    "frozenbn": FrozenBatchNorm2d,
}


@pytest.mark.parametrize("name", sorted(NORM_PRESETS))
def test_every_preset_builds_its_kind_with_the_preset_arguments(name):
    preset = NORM_PRESETS[name]
    layer = create_norm(name, 64)
    assert type(layer) is LAYERS[preset.kind], name
    for key, value in preset.layer_kwargs.items():
        assert getattr(layer, key) == value, (name, key)


def test_options_reach_the_layer_with_momentum_in_the_papers_convention():
    mabn = create_norm("mabn", 8, momentum=0.9, buffer_size=4, eps=1e-3, norm_batch_size=2)
    assert (mabn.momentum, mabn.buffer_size, mabn.eps, mabn.norm_batch_size) == (0.9, 4, 1e-3, 2)
    bn = create_norm("bn", 8, momentum=0.9)
    assert bn.momentum == pytest.approx(0.1)  # torch's convention: the weight of the new value
    assert create_norm("gn", 48).num_groups == 16  # gcd(32, channels)


@pytest.mark.parametrize(
    ("name", "options", "error", "message"),
    [
        ("bn", {"buffer_size": 4}, TypeError, "buffer_size"),
        ("bn", {"r_max": 2.0, "norm_batch_size": 2}, TypeError, "r_max"),
        ("syncbn", {"norm_batch_size": 2}, ValueError, "syncbn normalizes over all devices"),
        ("batchnorm", {}, ValueError, "unknown norm 'batchnorm'"),
    ],
    ids=["bn-mabn-option", "ghost-bn-renorm-option", "syncbn-ghost", "unknown"],
)
def test_an_option_the_layer_does_not_take_is_refused(name, options, error, message):
    with pytest.raises(error, match=message):
        create_norm(name, 8, **options)


def test_convert_norm_builds_its_layers_through_create_norm(monkeypatch):
    import mabn.norm.convert as convert

    calls = []

    def recording(name, channels, **options):
        calls.append((name, channels, options))
        return create_norm(name, channels, **options)

    monkeypatch.setattr(convert, "create_norm", recording)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6))
    convert_norm(model, "mabn", buffer_size=4)
    assert calls == [("mabn", 4, {"buffer_size": 4}), ("mabn", 6, {"buffer_size": 4})]


def test_bn_with_a_ghost_batch_is_ghost_batch_norm():
    layer = create_norm("bn", 4, norm_batch_size=2, momentum=0.9)
    assert type(layer) is GhostBatchNorm2d and isinstance(layer, BatchRenorm2d)
    assert (layer.r_max, layer.d_max, layer.momentum, layer.norm_batch_size) == (1.0, 0.0, 0.9, 2)
    assert "GhostBatchNorm2d(4, eps=1e-05, momentum=0.9, norm_batch_size=2)" == repr(layer)
    assert type(create_norm("bn", 4)) is nn.BatchNorm2d  # the whole batch: torch's own


def test_ghost_batch_norm_normalizes_each_group_as_batch_norm_does():
    torch.manual_seed(0)
    layer = GhostBatchNorm2d(3, norm_batch_size=2, momentum=0.5).train()
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64) * 3 + 1
    layer = layer.double()
    for _ in range(3):  # past the ramps' start: r and d would move in a renormalizing layer
        out = layer(x)
    expected = torch.cat([nn.functional.batch_norm(g, None, None, training=True, eps=layer.eps) for g in x.split(2)])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_a_state_dict_of_the_ghost_layer_bn_built_as_batch_renorm_loads():
    """Checkpoints hold bn's ghost-batch layers as BatchRenorm2d(r_max=1, d_max=0): the same keys load into a
    GhostBatchNorm2d, and the two layers give the same outputs from there."""
    torch.manual_seed(0)
    old = BatchRenorm2d(3, r_max=1.0, d_max=0.0, norm_batch_size=2, momentum=0.9).train()
    for _ in range(4):
        old(torch.randn(4, 3, 5, 5) * 2 + 0.5)
    new = GhostBatchNorm2d(3, norm_batch_size=2, momentum=0.9)
    state = old.state_dict()
    assert set(new.state_dict()) == set(state)
    new.load_state_dict(state)  # strict
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(new.eval()(x), old.eval()(x), rtol=0, atol=0)
    torch.testing.assert_close(new.train()(x), old.train()(x), rtol=0, atol=0)
    for key, value in old.state_dict().items():
        torch.testing.assert_close(new.state_dict()[key], value, rtol=0, atol=0, msg=key)
