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
own, one per (class, variant), which dynamo compiles and inlines the module through.
Both ``compile`` (which makes them) and ``watch`` (which names their code in torch's
records) read the registry here.
"""

from __future__ import annotations

from types import FunctionType
from typing import Any

from torch import nn

from .compat import call_past_compiled

_TRAMPOLINES: dict[tuple[type, int], FunctionType] = {}


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return call_past_compiled(module, *args, **kwargs)


def needs_trampoline(cls: type[nn.Module]) -> bool:
    """True when ``cls.forward`` is torch's own code, which dynamo would skip."""
    return cls.forward.__module__.startswith("torch.")


def trampoline(cls: type, variant: int = 0) -> FunctionType:
    """A copy of ``_call_module`` with its own code object for variant ``variant`` of
    ``cls`` (named ``call_<class>``, ``call_<class>_v<variant>`` for variants after the
    first)."""
    if (cls, variant) not in _TRAMPOLINES:
        name = f"call_{cls.__name__}" + (f"_v{variant}" if variant else "")
        code = _call_module.__code__.replace(co_name=name, co_qualname=name)
        _TRAMPOLINES[cls, variant] = FunctionType(code, _call_module.__globals__, name)
    return _TRAMPOLINES[cls, variant]


def existing_trampolines(cls: type) -> list[FunctionType]:
    """The trampolines made for ``cls``, one per variant compiled so far."""
    return [function for (owner, _), function in _TRAMPOLINES.items() if owner is cls]
