"""The meta device standing in for an accelerator, with data: CPU code paths that mix devices fail here as
they would on CUDA.

Inside `standin()`, a tensor made on (or moved to) `STANDIN` (the meta device) is a `StandIn`: it reports
the meta device but carries a CPU tensor, so arithmetic gives real values. Any op other than a copy that
takes a StandIn together with a plain CPU tensor of one or more dimensions raises, as CUDA does for a CUDA
and a CPU operand (a 0-dim CPU tensor is allowed beside device tensors, as CUDA allows it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

STANDIN = torch.device("meta")
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class StandIn(torch.Tensor):
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "StandIn":
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                device=STANDIN, requires_grad=elem.requires_grad)
        t.elem = elem
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("StandIn tensors are used only inside standin()")


class DeviceMixing(RuntimeError):
    pass


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        has_standin = any(isinstance(t, StandIn) for t in leaves)
        host = [t for t in leaves if not isinstance(t, StandIn) and t.dim() > 0]
        if func not in _COPIES and has_standin and host:
            raise DeviceMixing(f"{func}: tensors on the accelerator and on the CPU "
                               f"({[tuple(t.shape) for t in host]} on the CPU)")
        to_standin = kwargs.get("device") == STANDIN
        if to_standin:
            kwargs["device"] = torch.device("cpu")
        elif func is torch.ops.aten._to_copy.default and "device" in kwargs:
            has_standin = False  # an explicit move to the CPU
        inner = {id(t.elem): t for t in leaves if isinstance(t, StandIn)}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        wrap = has_standin or to_standin

        def back(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in inner:  # an in-place op returned its own operand
                return inner[id(t)]
            return StandIn(t) if wrap else t

        return tree_map(back, out)


def _unwrap(t: Any) -> Any:
    return t.elem if isinstance(t, StandIn) else t


@contextlib.contextmanager
def standin() -> Iterator[None]:
    # torch.tensor(data, device=...) moves its data without a dispatched op: build on the CPU, then move
    plain = torch.tensor

    def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        t = plain(data, *args, **kwargs)
        return t.to(device) if device is not None else t

    torch.tensor = tensor  # type: ignore[assignment]
    try:
        with _Mode():
            yield
    finally:
        torch.tensor = plain  # type: ignore[assignment]


def value(t: torch.Tensor) -> torch.Tensor:
    """The data of a StandIn (or the tensor itself), on the CPU."""
    return t.elem if isinstance(t, StandIn) else t
