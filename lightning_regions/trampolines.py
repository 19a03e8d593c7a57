"""Per-class call functions for torch built-in region classes.

Dynamo skips frames in ``torch.nn``, so ``nn.Module.compile()`` on an ``nn.Sequential``
or ``nn.TransformerEncoderLayer`` silently runs it eager. Such a region's call goes
through a function of ours instead, one copy per class, which dynamo compiles and
inlines the module through. Both ``compile`` (which makes them) and ``watch`` (which
names their code in torch's records) read the registry here.
"""

from __future__ import annotations

from types import FunctionType
from typing import Any

from torch import nn

_TRAMPOLINES: dict[type, FunctionType] = {}


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module._call_impl(*args, **kwargs)


def needs_trampoline(cls: type) -> bool:
    """True when ``cls.forward`` is torch's own code, which dynamo would skip."""
    return cls.forward.__module__.startswith("torch.")


def trampoline(cls: type) -> FunctionType:
    """A copy of ``_call_module`` with its own code object for ``cls``.

    Dynamo caches compiled code per code object; one copy per class keeps each
    class's recompile budget its own, as ``nn.Module.compile`` gets from ``forward``.
    """
    if cls not in _TRAMPOLINES:
        name = f"call_{cls.__name__}"
        code = _call_module.__code__.replace(co_name=name, co_qualname=name)
        _TRAMPOLINES[cls] = FunctionType(code, _call_module.__globals__, name)
    return _TRAMPOLINES[cls]


def existing_trampoline(cls: type) -> FunctionType | None:
    """The trampoline made for ``cls``, if a region of that class was compiled."""
    return _TRAMPOLINES.get(cls)
