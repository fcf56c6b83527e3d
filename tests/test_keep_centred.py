"""``mabn.keep_centred(model, optimizer)``: SGD keeps the CenConv2d weights centred, and training is the same as with
the centring in every forward; other optimizers keep the forward centring and say so once. Also the bench's plain
loop rows, which time a user's loop with and without it."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision

import mabn
from mabn import CenConv2d, convert_norm, keep_centred
from mabn.tools.bench import step


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two copies of a float64 ResNet-18 with MABN (ghost batches of 2, past its warm-ups within the steps)."""
    torch.manual_seed(0)
    options = {"warmup_iters": 2, "renorm_warmup_iters": 3, "buffer_size": 2, "norm_batch_size": 2}
    model = convert_norm(torchvision.models.resnet18(num_classes=5), "mabn", **options).double().train()
    return model, copy.deepcopy(model)


def _train_side_by_side(reference, model, optimizers, steps: int = 5) -> None:
    """``steps`` SGD steps of both on the same batches; after each, the outputs, the weights the convs compute
    with, and every other parameter agree to float64 rounding."""
    convs = [m for m in model.modules() if isinstance(m, CenConv2d)]
    ref_convs = [m for m in reference.modules() if isinstance(m, CenConv2d)]
    gen = torch.Generator().manual_seed(1)
    for n in range(steps):
        x = torch.randn(4, 3, 32, 32, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 5, (4,), generator=gen)
        outs = []
        for net, opt in zip((reference, model), optimizers):
            out = net(x)
            F.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12, msg=f"step {n}")
        for ref, conv in zip(ref_convs, convs):
            used = conv.weight if conv.centred_in_place else conv.centred_weight()
            torch.testing.assert_close(used, ref.centred_weight(), rtol=1e-10, atol=1e-12, msg=f"step {n}")
        conv_weights = {id(c.weight) for c in convs} | {id(c.weight) for c in ref_convs}
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if id(p) not in conv_weights:
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{name}, step {n}")


@pytest.mark.parametrize(
    "sgd",
    [
        pytest.param({"momentum": 0.9, "weight_decay": 1e-4}, id="momentum"),
        pytest.param({"momentum": 0.9, "weight_decay": 1e-4, "nesterov": True}, id="nesterov"),
    ],
)
@pytest.mark.slow  # two fits side by side
def test_keep_centred_trains_as_forward_centring_does(sgd):
    reference, model = _pair()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01, **sgd) for m in (reference, model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SGD: no warning
        handle = keep_centred(model, optimizers[1])
    convs = [m for m in model.modules() if isinstance(m, CenConv2d)]
    assert handle is not None and len(convs) == 20 and all(c.centred_in_place for c in convs)
    _train_side_by_side(reference, model, optimizers)
    means = torch.stack([c.weight.mean(dim=(1, 2, 3)).abs().max() for c in convs])
    assert means.max() < 1e-15  # stored centred, so the forward is a plain convolution
    handle.remove()
    assert not any(c.centred_in_place for c in convs)


@pytest.mark.slow  # two fits side by side
def test_keep_centred_with_adam_warns_once_and_keeps_the_forward_centring():
    reference, model = _pair()
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=1e-4) for m in (reference, model)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert keep_centred(model, optimizers[1]) is None
        _train_side_by_side(reference, model, optimizers, steps=3)
    assert [str(w.message) for w in caught] == [
        "keep_centred: Adam is not torch.optim.SGD, whose update alone commutes with the centring; the 20 CenConv2d "
        "layer(s) keep centring their weights in every forward"
    ]
    assert not any(m.centred_in_place for m in model.modules() if isinstance(m, CenConv2d))


def test_keep_centred_is_public_and_what_the_stages_call():
    from mabn.norm import cenconv
    from mabn.tasks import base

    assert "keep_centred" in mabn.__all__ and mabn.keep_centred is cenconv.keep_centred
    assert base.keep_centred is keep_centred  # the one function, under the one name
    plain = torchvision.models.resnet18()  # no CenConv2d: nothing to keep centred, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert keep_centred(plain, torch.optim.Adam(plain.parameters())) is None


@pytest.mark.slow
def test_step_bench_has_the_plain_loop_rows_for_resnet50(monkeypatch, capsys):
    """A user's loop (convert_norm + SGD) with and without keep_centred, timed beside the other rows (ResNet-18
    stands in for ResNet-50 here); the dry run lists the rows, and PSPNet-101 has none of them."""
    assert step.PLAIN not in step.row_names(None) and step.PLAIN_FORWARD not in step.row_names(None)
    kept = []
    real = step.keep_centred
    monkeypatch.setattr(step, "keep_centred", lambda model, opt: kept.append(real(model, opt)))
    monkeypatch.setattr(step.torchvision.models, "resnet50", torchvision.models.resnet18)
    rows = step.run(torch.device("cpu"), repeats=1, crop=32, batch=2, model="resnet50", num_classes=4)
    names = [r.norm for r in rows]
    assert names == ["bn", "gn", "brn", "mabn", "mabn + stats logging", step.PLAIN, step.PLAIN_FORWARD]
    kept = [h for h in kept if h is not None]  # BN, GN and BRN have no CenConv2d
    assert len(kept) == 3  # mabn, its logging row, and the plain loop: not the plain loop without keep_centred
    plain = kept[-1].convs[0].weight
    assert plain.mean(dim=(1, 2, 3)).abs().max() < 1e-6  # still centred after its steps
    assert all(r.seconds > 0 and r.time_ratio > 0 for r in rows)
    text = step.table(rows, 1, 32, 2, model="resnet50")
    assert f"| {step.PLAIN} |" in text and '`convert_norm(model, "mabn")` (the whole batch)' in text

    from mabn.tools.bench.command import main

    capsys.readouterr()
    main(["step", "--model", "resnet50", "--batch", "8", "--crop", "160", "--dry-run"])
    assert f"{step.PLAIN}, {step.PLAIN_FORWARD}; 5 repeats" in capsys.readouterr().out
