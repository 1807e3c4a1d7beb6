"""Parameters that received no gradient: DDP's "Expected to have finished reduction" error, made to name them
and the flag that allows them."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

UNUSED_PARAMETERS_PATTERN = "Expected to have finished reduction in the prior iteration"


def is_unused_parameters_error(exception: BaseException) -> bool:
    """Whether ``exception`` is DDP's error for parameters that received no gradient."""
    return UNUSED_PARAMETERS_PATTERN in str(exception)


def name_unused_parameters(exception: BaseException, names: list[str]) -> None:
    """Prepend to ``exception``'s message the parameters without gradient and the three ways out."""
    listed = ", ".join(names) if names else "(names unknown: set TORCH_DISTRIBUTED_DEBUG=DETAIL)"
    exception.args = (
        f"DDP: these parameters received no gradient in the last step: {listed}. Use them in the loss, "
        "freeze them (requires_grad=False), or pass --find-unused-parameters "
        "(find_unused_parameters=True; costs one extra autograd-graph traversal per step).\n\n"
        f"{exception.args[0] if exception.args else ''}",
        *exception.args[1:],
    )


def unused_parameter_names(module: nn.Module, ignore: Any = (), message: str = "") -> list[str]:
    """Names of the parameters DDP reports without gradient (from its message, else grad is None)."""
    params = ddp_parameter_order(module, ignore)
    match = re.search(r"did not receive grad for rank \d+:\s*([\d\s]+)", message)
    if match:
        indices = [int(i) for i in match.group(1).split()]
        return [params[i][0] for i in indices if i < len(params)]
    return [name for name, p in params if p.grad is None]


def ddp_parameter_order(module: nn.Module, ignore: Any = ()) -> list[tuple[str, nn.Parameter]]:
    """The parameters in the order DDP's reducer indexes them (its ``_build_params_for_reducer``)."""
    seen: set[int] = set()
    ordered = []
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or full in ignore or id(param) in seen:
                continue
            seen.add(id(param))
            ordered.append((full, param))
    return ordered
