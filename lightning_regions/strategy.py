"""Lightning glue: strategies that compile regions in place inside ``model_to_device``.

``model_to_device`` is the one hook every Lightning strategy calls once per ``setup``.
Right after ``super().model_to_device()`` the model is on its device and in its
precision, DDP has not wrapped it yet and no optimizer holds its parameters, so
in-place compilation changes nothing those later steps see but the forward.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .cache import (
    CHECKPOINT_KEY,
    CompileCache,
    artifact_guard,
    cache_dir_option,
    pack_artifacts,
    unpack_artifacts,
)
from .compat import OptimizedModule, dynamo_config, recompile_limit
from .compile import (
    compile_regions,
    end_observation,
    tracker_of,
    validate_compile_arguments,
    validate_on_compile_error,
)
from .diagnosis import judge_limit_fallback
from .kv_cache import (
    disable_kv_cache_unless_asked,
    eager_generation,
    restore_generation,
    restore_kv_cache,
)
from .nested import validate_granularity
from .regions import RegionPlan, Selectors
from .report import (
    PerInstanceRecompileWarning,
    RegionGraphBreakWarning,
    RegionNotCompiledWarning,
    RegionReport,
    region_report,
    warn_graph_breaks,
    warn_if_not_compiled,
    warn_per_instance_recompiles,
)
from .variants import compress_paths


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


class RegionalCompileBase:
    """What every regional strategy does, Trainer's or Fabric's: validate the arguments,
    compile a module's regions in place, report after the first optimizer step, and keep
    compile caches in the run's directory."""

    def _init_regional(
        self,
        backend: str | Callable[..., Any],
        mode: str | None,
        fullgraph: bool,
        dynamic: bool | None,
        options: dict[str, Any] | None,
        regions: Selectors,
        on_compile_error: str,
        recompile_warn_threshold: int | Literal["auto"] | None,
        cache_dir: str | bool | None,
        trust_unsigned_artifacts: bool = False,
        disable_training_kv_cache: bool = True,
        unspecialize_module_ints: bool = True,
        granularity: str = "regions",
    ) -> None:
        validate_compile_arguments(backend, mode, options)
        validate_granularity(granularity)
        validate_on_compile_error(on_compile_error)
        if recompile_warn_threshold != "auto" and (
            recompile_warn_threshold is not None
            and (not isinstance(recompile_warn_threshold, int) or recompile_warn_threshold < 1)
        ):
            raise ValueError(
                f"recompile_warn_threshold={recompile_warn_threshold!r}: use a positive count, "
                "'auto' (one less than dynamo's recompile_limit) or None to turn the warning off."
            )
        self.compile_kwargs: dict[str, Any] = {
            "backend": backend,
            "fullgraph": fullgraph,
            "dynamic": dynamic,
            **({"mode": mode} if mode is not None else {}),
            **({"options": options} if options is not None else {}),
        }
        self.regions = regions
        self.on_compile_error = on_compile_error
        self._recompile_warn_threshold = recompile_warn_threshold
        self.compile_cache = CompileCache(cache_dir_option(cache_dir))
        self.trust_unsigned_artifacts = trust_unsigned_artifacts
        self.disable_training_kv_cache = disable_training_kv_cache
        self.unspecialize_module_ints = unspecialize_module_ints
        self.granularity = granularity
        self._module_ints_release: weakref.finalize | None = None
        self._kv_cache_module: Any = None
        self._generation_module: Any = None
        self._runtime_reported = False  # this setup's first optimizer step reported
        self._trained = False  # some optimizer step ran, in this or an earlier setup

    @property
    def recompile_warn_threshold(self) -> int | None:
        """Recompiles of one class that give a ``RecompileStormWarning``: ``"auto"`` is one
        less than dynamo's ``recompile_limit`` (read when used), so the warning comes
        while the class still runs compiled, before the next recompile would fall back."""
        if self._recompile_warn_threshold == "auto":
            return max(1, recompile_limit() - 1)
        return self._recompile_warn_threshold

    @property
    def cache_dir(self) -> str | None:
        """The folder passed as ``cache_dir``, or None for torch's own compile cache."""
        return self.compile_cache.chosen

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        self.compile_cache.enter()

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        self.compile_cache.exit()
        if self._module_ints_release is not None:
            self._module_ints_release()  # once; a weakref.finalize does nothing the second time
            self._module_ints_release = None
        if self._kv_cache_module is not None:
            restore_kv_cache(self._kv_cache_module)
            self._kv_cache_module = None
        if self._generation_module is not None:
            restore_generation(self._generation_module)
            self._generation_module = None

    def _prepare_for_one_graph_per_class(self, module: Any) -> None:
        """Remove the common per-instance recompiles before anything compiles: a transformers
        KV cache that nobody asked for, generation's cached forwards (``generate()`` runs
        eager), and per-instance int attributes (torch's ``allow_unspec_int_on_nn_module``,
        set while this strategy is set up)."""
        if self.disable_training_kv_cache:
            models = disable_kv_cache_unless_asked(module)
            if models:
                self._kv_cache_module = module
                rank_zero_info(
                    "regional compile: transformers KV cache off in forwards that do not pass "
                    f"use_cache (a training or validation step never reads it, and each layer "
                    f"indexing it recompiles the block) for {', '.join(models)}; generate() "
                    "and use_cache=True keep it. disable_training_kv_cache=False keeps it on."
                )
        generating = eager_generation(module)
        if generating:
            self._generation_module = module
            rank_zero_info(
                f"regional compile: generate() of {', '.join(generating)} runs eager, as "
                "plain Lightning runs it (compiled, each cached forward would compile the "
                "block once per layer until the recompile limit left it eager in training too)"
            )
        if self.unspecialize_module_ints and self._module_ints_release is None:
            # Released at teardown, or when the module is collected (Fabric has no teardown).
            UnspecializedModuleInts.acquire()
            self._module_ints_release = weakref.finalize(module, UnspecializedModuleInts.release)

    def compile_in_place(
        self, module: Any, root_is_called: bool, plan: RegionPlan | None = None
    ) -> None:
        """Compile ``module``'s regions in place (by ``plan`` when given) and log them."""
        _refuse_whole_model_compile(module)
        self.compile_cache.enter()
        self._prepare_for_one_graph_per_class(module)
        compile_regions(
            module,
            inplace=True,
            regions=self.regions,
            on_compile_error=self.on_compile_error,
            observe_calls=None,  # until the first optimizer step is reported
            root_is_called=root_is_called,
            plan=plan,
            granularity=self.granularity,
            **self.compile_kwargs,
        )
        rank_zero_info(f"{region_report(module)}")
        self._runtime_reported = False

    def after_optimizer_step(self, module: Any, phase: str = "training") -> None:
        """Watch recompiles; after the first step, report once and end observation."""
        tracker = tracker_of(module)
        if tracker is None:
            return
        if self._runtime_reported:
            self.watch_recompiles(module, phase)
            return
        threshold = self.recompile_warn_threshold
        if threshold is not None:
            tracker.watch.warn_storms(threshold)
        self._runtime_reported = self._trained = True
        report = region_report(module)
        end_observation(module)
        tracker.watch.new_limit_hits()  # the first step's are in the warnings below
        rank_zero_info(runtime_summary(report))
        with warnings.catch_warnings():
            for category in WARNED_AT_FIRST_STEP:
                warnings.simplefilter("always", category)
            warn_per_instance_recompiles(report)
            warn_graph_breaks(report)
            warn_if_not_compiled(report)

    def watch_recompiles(self, module: Any, phase: str) -> None:
        """Warn once per region class that reached dynamo's recompile limit since the last
        look (``RegionNotCompiledWarning``, naming ``phase``, torch's guard and the fix),
        and of recompile storms. Reads torch's compile records: called at loop ends and
        optimizer steps, never per region call."""
        tracker = tracker_of(module)
        if tracker is None:
            return
        for entry in tracker.watch.new_limit_hits():
            entry.warned = True  # this says more than a storm warning would
            fallback = judge_limit_fallback(entry, phase, recompile_limit(), trained=self._trained)
            with warnings.catch_warnings():
                warnings.simplefilter("always", RegionNotCompiledWarning)
                warnings.warn(str(fallback), RegionNotCompiledWarning, stacklevel=2)
        threshold = self.recompile_warn_threshold
        if threshold is not None:
            tracker.watch.warn_storms(threshold)


class RegionalCompileMixin(RegionalCompileBase):
    """Compiles the LightningModule's regions in place after device placement.

    Mixed into a Lightning strategy before the strategy class, so ``model_to_device``
    and ``optimizer_step`` wrap the strategy's own.
    """

    lightning_module: Any
    model: Any

    def attached_trainer(self) -> Any:
        """The Trainer of the LightningModule, or None before one is attached
        (``strategy.load_checkpoint`` may be called then)."""
        module = self.lightning_module
        return getattr(module, "_trainer", None) if module is not None else None

    def artifact_guard(self) -> dict[str, str]:
        device = self.root_device  # type: ignore[attr-defined]
        device_type = device.type
        if device_type == "cuda":  # kernels are built for one GPU model: name it
            device_type = f"cuda ({torch.cuda.get_device_name(device)})"
        return artifact_guard(device_type, self.compile_kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """Store this process's compile-cache artifacts in the checkpoint, then save it."""
        if self.is_global_zero:  # type: ignore[attr-defined]
            payload = pack_artifacts(self.artifact_guard())
            if payload is not None:
                checkpoint[CHECKPOINT_KEY] = payload
        super().save_checkpoint(checkpoint, *args, **kwargs)  # type: ignore[misc]

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load the checkpoint, and its compile-cache artifacts if they fit this run.
        Called before a Trainer is attached, it loads the checkpoint alone: there is no
        run yet whose cache the artifacts belong to (a Trainer restoring the checkpoint
        loads them then)."""
        checkpoint = super().load_checkpoint(*args, **kwargs)  # type: ignore[misc]
        if self.attached_trainer() is None:
            return checkpoint
        self.compile_cache.enter()  # artifacts are written into the run's compile cache
        unpack_artifacts(
            checkpoint.get(CHECKPOINT_KEY), self.artifact_guard(), self.trust_unsigned_artifacts
        )
        return checkpoint

    def model_to_device(self) -> None:
        super().model_to_device()  # type: ignore[misc]
        self.compile_in_place(self.lightning_module, root_is_called=False)  # training_step

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)  # type: ignore[misc]
        self.after_optimizer_step(self.lightning_module)
        return output

    def on_validation_end(self) -> None:
        super().on_validation_end()  # type: ignore[misc]
        trainer = self.attached_trainer()
        sanity = trainer is not None and trainer.sanity_checking
        self.watch_recompiles(
            self.lightning_module, "the validation sanity check" if sanity else "validation"
        )

    def on_test_end(self) -> None:
        super().on_test_end()  # type: ignore[misc]
        self.watch_recompiles(self.lightning_module, "test")

    def on_predict_end(self) -> None:
        super().on_predict_end()  # type: ignore[misc]
        self.watch_recompiles(self.lightning_module, "predict")


#: What the strategies warn about once, after the first optimizer step.
WARNED_AT_FIRST_STEP = (
    RegionNotCompiledWarning,
    PerInstanceRecompileWarning,
    RegionGraphBreakWarning,
)


def runtime_summary(report: RegionReport) -> str:
    """From torch's own records, taken after the first optimizer step: one line, then a
    line per class whose extra graphs are bounded (variants, a per-instance number) and
    one for regions never called; what loses something is warned about instead."""
    recompiles = sum(entry.recompiles for entry in report.recompiles)
    lines = [
        f"regional compile after first step: {report.graphs} graph(s) compiled, "
        f"{recompiles} recompile(s), {report.graph_breaks} graph break(s), "
        f"{report.compile_seconds:.2f}s in the backend, "
        f"{len(report.ran_eager)} region(s) called without a compiled call"
    ]
    lines += [f"  graphs of {entry}" for entry in report.per_instance if entry.bounded]
    if report.never_called:
        names = compress_paths(row.paths[0] for row in report.never_called)
        lines.append(
            f"  {len(report.never_called)} region(s) not called in the first step (nothing "
            f"ran eager there): {names}"
        )
    return "\n".join(lines)


def _refuse_whole_model_compile(module: Any) -> None:
    if isinstance(module, OptimizedModule) or getattr(module, "_compiler_ctx", None):
        raise ValueError(
            f"{type(module).__name__} was passed wrapped by torch.compile. Regional "
            "compilation compiles the blocks itself: pass the plain LightningModule."
        )
    if module._compiled_call_impl is not None:
        raise ValueError(
            f"{type(module).__name__} was compiled whole with .compile(). Regional "
            "compilation compiles the blocks itself: pass the plain LightningModule."
        )


class RegionalCompileStrategy(RegionalCompileMixin, SingleDeviceStrategy):
    """Single-device training with the LightningModule's repeated blocks compiled in place.

    Args:
        backend: ``torch.compile`` backend name or callable.
        mode: inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``...).
        fullgraph: require each region to compile into one graph.
        dynamic: ``torch.compile``'s dynamic-shape setting.
        options: inductor options (not together with ``mode``).
        regions: class names and/or path globs; default: repeated blocks.
        on_compile_error: ``"raise"`` naming the failing region, or ``"eager"``: that
            region alone runs eager, with a warning.
        recompile_warn_threshold: warn when a block class recompiles this many times;
            ``"auto"``: one less than dynamo's ``recompile_limit`` (7 of torch's 8), so the
            warning comes before any region falls back; ``None``: never.
        cache_dir: where compile caches go: ``None`` for torch's own cache, the one a
            plain ``torch.compile`` run uses (``$TORCHINDUCTOR_CACHE_DIR``, else torch's
            default), shared by every run; or a folder, shared by every run that names
            it. Checkpoints also carry the compiled artifacts.
        trust_unsigned_artifacts: load compile artifacts from checkpoints not signed
            with this user's key. They run code when loaded: only for checkpoints you trust.
        disable_training_kv_cache: pass ``use_cache=False`` to transformers models in
            every forward that does not pass ``use_cache`` (``generate()`` does): a training
            or validation step never reads the cache, and each layer indexing it
            recompiles the block.
        unspecialize_module_ints: compile per-instance int attributes (a layer index) as
            symbolic ints after their first change (torch's
            ``allow_unspec_int_on_nn_module``, set while the strategy is set up).
        granularity: ``"regions"`` compiles each repeated block by itself; ``"nested"``
            compiles each top-level child of the LightningModule whole, with the blocks
            inside marked as torch nested compile regions (traced once, reused).
        accelerator: passed to ``SingleDeviceStrategy``.
        checkpoint_io: passed to ``SingleDeviceStrategy``.
        precision_plugin: passed to ``SingleDeviceStrategy``.

    The device is the Trainer's (``accelerator=`` and ``devices=``). More than one
    device raises: use ``RegionalCompileDDPStrategy`` (``"regional_compile_ddp"``).
    """

    strategy_name = "regional_compile"

    def __init__(
        self,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
        regions: str | list[str] | None = None,
        on_compile_error: Literal["raise", "eager"] = "raise",
        recompile_warn_threshold: int | Literal["auto"] | None = "auto",
        cache_dir: str | None = None,
        trust_unsigned_artifacts: bool = False,
        disable_training_kv_cache: bool = True,
        unspecialize_module_ints: bool = True,
        granularity: Literal["regions", "nested"] = "regions",
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            device="cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._init_regional(
            backend,
            mode,
            fullgraph,
            dynamic,
            options,
            regions,
            on_compile_error,
            recompile_warn_threshold,
            cache_dir,
            trust_unsigned_artifacts,
            disable_training_kv_cache,
            unspecialize_module_ints,
            granularity,
        )
        self._device_from_trainer: torch.device | None = None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """Set by the Trainer's accelerator connector from ``accelerator=``/``devices=``."""
        return None if self._device_from_trainer is None else [self._device_from_trainer]

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if not devices:
            return
        if len(devices) > 1:
            raise ValueError(
                f"RegionalCompileStrategy runs on one device, but the Trainer asks for "
                f"{len(devices)} ({devices}). For several devices use "
                "RegionalCompileDDPStrategy, or strategy='regional_compile_ddp'."
            )
        self._device_from_trainer = devices[0]
        self._root_device = devices[0]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Single device, repeated blocks compiled in place",
            override=True,
        )


class RegionalCompileDDPStrategy(RegionalCompileMixin, DDPStrategy):
    """Multi-process DDP with each process's repeated blocks compiled in place.

    Regions are compiled after the model is on its device and before DDP wraps it.

    Args:
        backend: ``torch.compile`` backend name or callable.
        mode: inductor mode.
        fullgraph: require each region to compile into one graph.
        dynamic: ``torch.compile``'s dynamic-shape setting.
        options: inductor options (not together with ``mode``).
        regions: class names and/or path globs; default: repeated blocks.
        on_compile_error: ``"raise"`` or ``"eager"``, as for ``RegionalCompileStrategy``.
        recompile_warn_threshold: as for ``RegionalCompileStrategy``.
        cache_dir: as for ``RegionalCompileStrategy``.
        trust_unsigned_artifacts: load compile artifacts from checkpoints not signed
            with this user's key. They run code when loaded: only for checkpoints you trust.
        disable_training_kv_cache, unspecialize_module_ints, granularity: as for
            ``RegionalCompileStrategy``.
        **kwargs: every ``DDPStrategy`` argument (``process_group_backend``,
            ``start_method``, ``find_unused_parameters``...).
    """

    strategy_name = "regional_compile_ddp"

    def __init__(
        self,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
        regions: str | list[str] | None = None,
        on_compile_error: Literal["raise", "eager"] = "raise",
        recompile_warn_threshold: int | Literal["auto"] | None = "auto",
        cache_dir: str | None = None,
        trust_unsigned_artifacts: bool = False,
        disable_training_kv_cache: bool = True,
        unspecialize_module_ints: bool = True,
        granularity: Literal["regions", "nested"] = "regions",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._init_regional(
            backend,
            mode,
            fullgraph,
            dynamic,
            options,
            regions,
            on_compile_error,
            recompile_warn_threshold,
            cache_dir,
            trust_unsigned_artifacts,
            disable_training_kv_cache,
            unspecialize_module_ints,
            granularity,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP, repeated blocks compiled in place in each process",
            override=True,
        )


def register() -> None:
    """Make ``"regional_compile"`` and ``"regional_compile_ddp"`` Trainer strategy names."""
    RegionalCompileStrategy.register_strategies(StrategyRegistry)
    RegionalCompileDDPStrategy.register_strategies(StrategyRegistry)
