"""The one recipe for compiling a strategy's regions, in the training process and in the
background child alike.

A warm switch needs the child's graphs to be the ones the training process asks torch's
caches for: the same ``compile_regions`` arguments and the same dynamo and inductor
settings (a setting the user changed in their script is part of inductor's cache key).
``CompileRecipe`` holds both, made once from the strategy's options in the training
process; ``compile`` is the only call that compiles a strategy's regions, there and in
the child.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..compat import compile_settings, load_compile_settings
from ..options import RegionalOptions
from .compile import compile_regions
from .regions import RegionPlan


@dataclass(frozen=True)
class CompileRecipe:
    """``compile_regions``' arguments for a strategy's regions, and torch's compile
    settings in effect when the recipe was made. ``eager_hooks``: the engine's hooks on
    each region stay outside its compiled code (DeepSpeed's)."""

    options: RegionalOptions
    eager_hooks: bool = False
    settings: dict[str, dict[str, Any]] = field(default_factory=compile_settings)

    @property
    def arguments(self) -> dict[str, Any]:
        """What ``compile_regions`` gets besides the module and the plan: in place, the
        strategy's error policy and granularity, observed until the strategy ends it
        (after its first optimizer step), and ``torch.compile``'s own arguments."""
        return {
            "inplace": True,
            "on_compile_error": self.options.on_compile_error,
            "observe_calls": None,
            "granularity": self.options.granularity,
            "eager_hooks": self.eager_hooks,
            **self.options.compile_kwargs,
        }

    def compile(self, module: nn.Module, plan: RegionPlan | None, root_is_called: bool) -> None:
        """Compile ``module``'s regions in place by ``plan`` (planned from the options'
        ``regions`` when None)."""
        compile_regions(
            module,
            regions=self.options.regions,
            root_is_called=root_is_called,
            plan=plan,
            **self.arguments,
        )

    def enter_settings(self) -> None:
        """Make torch's compile settings this recipe's (in the child, before compiling)."""
        load_compile_settings(self.settings)
