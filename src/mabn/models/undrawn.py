"""Networks built to be loaded: inside ``Undrawn``, modules are built without their initial random draws."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# The in-place draws of torch.nn.init's schemes: kaiming_normal_ (torchvision's ResNet start) reaches torch only
# through normal_, and kaiming_uniform_ (every conv's constructor) through its own entry, which these do not see.
_DRAWS = (torch.Tensor.normal_, torch.Tensor.uniform_)


class Undrawn(TorchFunctionMode):
    """Inside it, the initial draws (``torch.nn.init``'s functions, a tensor's ``normal_`` and ``uniform_``) leave
    their tensor as it is: a module built there holds uninitialized memory where its constructor would have drawn
    its parameters. For a network whose every parameter is loaded next (a checkpoint's state dict, ``strict=True``):
    on the CPU the draws are most of a PSPNet-101's build (0.47 s with them, 0.07 s without), and torch's generator
    stays as it was. Everything else (buffers made by ``torch.zeros``, ``fill_``, the running statistics' resets)
    runs."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DRAWS or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)
