"""Call functions of our own for regions that need a compiled entry of their own.

Dynamo keeps compiled code, and counts its recompile limit, per code object. A region
compiled with ``nn.Module.compile`` is entered through its class's ``forward``, so every
instance of the class shares one entry. Three kinds of region need another:

- a torch built-in class (``nn.Sequential``, ``nn.TransformerEncoderLayer``): dynamo skips
  frames in ``torch.nn``, so ``module.compile()`` would silently run it eager;
- a variant of a class with several (``variants.py``: ResNet's conv layers in 17 shapes):
  one entry per variant, so variants known before compiling never compete for one
  recompile limit, and a shape that differs by variant is a graph of its own rather than
  a reason for automatic dynamic shapes;
- a class whose ``forward`` code is another region class's too (transformers'
  ``GradientCheckpointingLayer`` gives every subclass one ``forward`` wrapper).

Such a region's call goes through a copy of ``_call_module`` with a code object of its
own, one per (class, variant), which dynamo compiles and inlines the module through. A
region compiled with its hooks eager (``compile_regions(eager_hooks=True)``, DeepSpeed)
goes through a copy of ``_call_forward`` instead: the module's ``forward`` alone.
Both ``compile`` (which makes them) and ``watch`` (which names their code in torch's
records) read the registry here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import FunctionType
from typing import Any

from torch import nn

from ..compat import FORWARD, call_forward, call_past_compiled

_TRAMPOLINES: dict[tuple[type, int, bool], FunctionType] = {}


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return call_past_compiled(module, *args, **kwargs)


def _call_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return call_forward(module, *args, **kwargs)


def needs_trampoline(cls: type[nn.Module]) -> bool:
    """True when ``cls.forward`` is torch's own code, which dynamo would skip."""
    # a function defined where globals have no __name__ (exec'd code) has __module__ None
    return (cls.forward.__module__ or "").startswith("torch.")


def trampoline(cls: type, variant: int = 0, hooks: bool = True) -> FunctionType:
    """A copy of ``_call_module`` (``hooks``) or ``_call_forward`` with its own code
    object for variant ``variant`` of ``cls`` (named ``call_<class>`` or
    ``forward_<class>``, with ``_v<variant>`` for variants after the first)."""
    if (cls, variant, hooks) not in _TRAMPOLINES:
        template = _call_module if hooks else _call_forward
        name = ("call_" if hooks else "forward_") + cls.__name__
        name += f"_v{variant}" if variant else ""
        code = template.__code__.replace(co_name=name, co_qualname=name)
        _TRAMPOLINES[cls, variant, hooks] = FunctionType(code, template.__globals__, name)
    return _TRAMPOLINES[cls, variant, hooks]


def existing_trampolines(cls: type) -> list[FunctionType]:
    """The trampolines made for ``cls``, one per variant and entry compiled so far."""
    return [function for (owner, _, _), function in _TRAMPOLINES.items() if owner is cls]


class CompiledForward:
    """A region's compiled ``forward``, kept in its ``__dict__`` (``compat.FORWARD``) when
    its hooks run eager: ``nn.Module._call_impl`` runs the module's hooks, eager, around
    it. ``compiled`` is ``torch.compile`` of the class's ``forward`` or of a ``forward_``
    trampoline, called with the module.

    Saved (``torch.save``, pickle) and deep-copied as the module's plain ``forward``, as
    torch drops the compiled call of ``module.compile()`` there: the copy is a plain model.
    """

    def __init__(self, module: nn.Module, compiled: Callable[..., Any]) -> None:
        self.module = module
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(self.module, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, (self.module, FORWARD))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return getattr(copy.deepcopy(self.module, memo), FORWARD)


def compiled_forward(module: nn.Module) -> CompiledForward | None:
    """The compiled forward in ``module``'s ``__dict__`` (also while a tracker observes
    it, through the observer's ``call``), or None."""
    found = vars(module).get(FORWARD)
    found = getattr(found, "call", found)  # tracking.ObservedRegion
    return found if isinstance(found, CompiledForward) else None
