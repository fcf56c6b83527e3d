"""What a network's build draws from torch's generator: the draws a build needs once (the heads' He start), none
where every value is replaced next (a conversion's new convs, a checkpoint's rebuild: ``mabn.models.Undrawn``),
and a rebuild that equals the task the fit built, in every parameter and buffer, persistent or not."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mabn.inference.checkpoint import load_task
from mabn.models import PSPNet
from mabn.norm import convert_norm
from mabn.tasks import ClassificationTask, SegmentationTask

ARCH = "resnet18"


class Draws(TorchFunctionMode):
    """Counts the draws on each tensor with values (the meta device's hold none): the calls of ``torch.nn.init``'s
    functions that torch dispatches (``kaiming_uniform_``, ...) and of a tensor's ``normal_`` and ``uniform_``
    (where ``kaiming_normal_`` draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, torch.Tensor] = {}  # kept alive: an id is never reused while counted
        self.count: Counter[int] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in (
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
        ):
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.device.type != "meta":
                self.tensors[id(tensor)] = tensor
                self.count[id(tensor)] += 1
        return func(*args, **kwargs)

    def of(self, tensor: torch.Tensor) -> int:
        return self.count[id(tensor)]


def test_the_heads_are_drawn_once_and_a_conversion_draws_nothing():
    with Draws() as draws:
        model = PSPNet(num_classes=5, norm="bn", arch=ARCH)
    convs = {n: m.weight for n, m in model.heads().named_modules() if isinstance(m, nn.Conv2d)}
    assert convs and {name: draws.of(w) for name, w in convs.items()} == dict.fromkeys(convs, 1)
    assert max(draws.of(p) for p in model.heads().parameters()) == 1  # biases and norms: ones and zeros
    # MABN's conversion replaces every conv by a centred one that takes the conv's weights: it draws none.
    state = torch.random.get_rng_state()
    with Draws() as draws:
        convert_norm(model, "mabn", norm_batch_size=2)
    assert sum(draws.count.values()) == 0
    assert torch.equal(torch.random.get_rng_state(), state)


def _trained(task: nn.Module) -> nn.Module:
    """``task`` with every parameter and floating buffer of its state dict away from its start."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for value in task.state_dict().values():
            if value.is_floating_point():
                value.copy_(torch.rand(value.shape, generator=generator, dtype=value.dtype) + 0.5)
    return task


@pytest.mark.parametrize(
    ("task_class", "hp"),
    [
        (SegmentationTask, {"norm": "mabn", "norm_batch_size": 2, "num_classes": 5, "arch": ARCH}),
        (SegmentationTask, {"norm": "brn", "norm_batch_size": 2, "num_classes": 5, "arch": ARCH}),
        (ClassificationTask, {"norm": "gn", "num_classes": 7, "arch": ARCH}),
    ],
    ids=["pspnet-mabn", "pspnet-brn", "resnet-gn"],
)
def test_a_checkpoints_task_is_rebuilt_without_draws_as_the_fit_built_it(task_class, hp, tmp_path):
    task = _trained(task_class(**hp))
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams)}, path)
    state = torch.random.get_rng_state()
    restored = load_task(path).task
    assert torch.equal(torch.random.get_rng_state(), state), "the rebuild drew initial values it then replaced"
    built = dict(task.named_parameters()) | dict(task.named_buffers())
    rebuilt = dict(restored.named_parameters()) | dict(restored.named_buffers())  # non-persistent ones included
    assert rebuilt.keys() == built.keys()
    for name, value in built.items():
        assert torch.equal(rebuilt[name], value), name
