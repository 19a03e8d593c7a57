"""The training compile environment: what a strategy changes while it is set up so that
each block class compiles one graph, and restores at teardown.

- a transformers KV cache nobody asked for is turned off in training forwards
  (``kv_cache.disable_kv_cache_unless_asked``);
- ``generate()`` runs eager, as plain Lightning runs it (``kv_cache.eager_generation``);
- per-instance int attributes compile as symbolic ints after their first change
  (torch's process-wide ``allow_unspec_int_on_nn_module``, counted across strategies);
- under DDP, each region's graph stays whole: dynamo's DDP optimizer is off
  (``optimize_ddp``), unless the user set it themselves (``DDPGraphSplitOff``).
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..compat import dynamo_config, dynamo_setting_is_default
from ..core.kv_cache import (
    disable_kv_cache_unless_asked,
    eager_generation,
    restore_generation,
    restore_kv_cache,
)


class UnspecializedModuleInts:
    """torch's ``allow_unspec_int_on_nn_module``, on while any strategy holds it.

    A process-wide dynamo flag read whenever a frame compiles, so it stays on from setup
    to teardown. Counted, so that two strategies set up in one process restore the
    user's own value only when the last one lets go, whatever the order.
    """

    holders = 0
    previous = False

    @classmethod
    def acquire(cls) -> None:
        if cls.holders == 0:
            cls.previous = dynamo_config().allow_unspec_int_on_nn_module
            dynamo_config().allow_unspec_int_on_nn_module = True
        cls.holders += 1

    @classmethod
    def release(cls) -> None:
        cls.holders -= 1
        if cls.holders == 0:
            dynamo_config().allow_unspec_int_on_nn_module = cls.previous


class DDPGraphSplitOff:
    """torch's ``optimize_ddp`` off while any DDP strategy holds it, where it is at its
    default (on): left on, dynamo's DDP optimizer compiles each region in pieces cut at
    DDP's gradient buckets. For regions that buys little and costs (measured in
    ``benchmarks/results/ddp_split.md``): a region's gradients are ready together at the
    end of its backward, so its all-reduce already overlaps the next region's backward;
    and the background child, which runs no DDP, compiles each region whole, so split
    graphs would miss its cache entries at the switch. A value the user set (the string
    ``"ddp_optimizer"`` keeps the split) is left alone. Counted as
    ``UnspecializedModuleInts``; put back to its default at the last release."""

    holders = 0
    changed = False
    restored = False  # it holds True because the last release put it back

    @classmethod
    def acquire(cls) -> None:
        if cls.holders == 0:
            config = dynamo_config()
            untouched = dynamo_setting_is_default("optimize_ddp")
            if untouched or (cls.restored and config.optimize_ddp is True):
                config.optimize_ddp = False
                cls.changed = True
        cls.holders += 1

    @classmethod
    def release(cls) -> None:
        cls.holders -= 1
        if cls.holders == 0 and cls.changed:
            dynamo_config().optimize_ddp = True
            cls.changed, cls.restored = False, True


class CompileEnvironment:
    """Entered on a module before its regions compile; left at teardown (or, for the
    dynamo flag, when the module is collected: Fabric has no teardown)."""

    def __init__(
        self,
        disable_training_kv_cache: bool,
        unspecialize_module_ints: bool,
        whole_graphs_under_ddp: bool = False,
    ) -> None:
        self.disable_training_kv_cache = disable_training_kv_cache
        self.unspecialize_module_ints = unspecialize_module_ints
        self.whole_graphs_under_ddp = whole_graphs_under_ddp
        self._kv_cache_modules: list[Any] = []  # each module entered (Fabric: several)
        self._generation_modules: list[Any] = []
        self._module_ints_release: weakref.finalize | None = None
        self._ddp_split_release: weakref.finalize | None = None

    def enter(self, module: Any) -> None:
        if self.disable_training_kv_cache:
            models = disable_kv_cache_unless_asked(module)
            if models:
                self._kv_cache_modules.append(module)
                rank_zero_info(
                    "regional compile: transformers KV cache off in forwards that do not pass "
                    f"use_cache (a training or validation step never reads it, and each layer "
                    f"indexing it recompiles the block) for {', '.join(models)}; generate() "
                    "and use_cache=True keep it. disable_training_kv_cache=False keeps it on."
                )
        generating = eager_generation(module)
        if generating:
            self._generation_modules.append(module)
            rank_zero_info(
                f"regional compile: generate() of {', '.join(generating)} runs eager, as "
                "plain Lightning runs it (compiled, each cached forward would compile the "
                "block once per layer until the recompile limit left it eager in training too)"
            )
        if self.unspecialize_module_ints and self._module_ints_release is None:
            UnspecializedModuleInts.acquire()
            self._module_ints_release = weakref.finalize(module, UnspecializedModuleInts.release)
        if self.whole_graphs_under_ddp and self._ddp_split_release is None:
            DDPGraphSplitOff.acquire()
            self._ddp_split_release = weakref.finalize(module, DDPGraphSplitOff.release)

    def exit(self) -> None:
        if self._module_ints_release is not None:
            self._module_ints_release()  # once; a weakref.finalize does nothing the second time
            self._module_ints_release = None
        if self._ddp_split_release is not None:
            self._ddp_split_release()
            self._ddp_split_release = None
        for module in self._kv_cache_modules:
            restore_kv_cache(module)
        for module in self._generation_modules:
            restore_generation(module)
        self._kv_cache_modules, self._generation_modules = [], []
