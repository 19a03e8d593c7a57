"""Lightning glue: the Trainer strategies, which plan the regions in ``model_to_device``
and compile them in place there, or (``compile_in_background``) start the background
compile there and compile at its switch, after an optimizer step.

``model_to_device`` is the one hook every Lightning strategy calls once per ``setup``.
Right after ``super().model_to_device()`` the model is on its device and in its
precision, DDP has not wrapped it yet and no optimizer holds its parameters, so
in-place compilation changes nothing those later steps see but the forward; compiling
later, at a step boundary, is in place too and changes nothing either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    SingleDeviceStrategy,
    Strategy,
    StrategyRegistry,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from ..background.switch import BackgroundCompile
from ..cache import CHECKPOINT_KEY, CompileCache, artifact_guard, pack_artifacts, unpack_artifacts
from ..compat import (
    OptimizedModule,
    compile_turned_off,
    compiled_by_torch_compile_context,
    compiled_call,
)
from ..core.calls import COMPILED, EAGER
from ..core.compile import tracker_of
from ..core.recipe import CompileRecipe
from ..core.regions import RegionPlan, find_regions
from ..diagnosis.report import region_report
from ..gate.gate import Candidate, CompilePayoff, Decided, cuda_graphs_candidate, follow
from ..options import RegionalOptions, split_options, takes_options
from .environment import CompileEnvironment
from .figures import decision_figures, first_step_figures, log_figures, switch_figures
from .first_step import FirstStepReporter
from .status import CompileStatus


class RegionalCompileBase:
    """What every regional strategy does, Trainer's or Fabric's: keep the options, and
    own four parts, each entered at setup and left at teardown: the run's compile cache
    (``cache.CompileCache``), the training compile environment
    (``environment.CompileEnvironment``), the first-step reporter
    (``first_step.FirstStepReporter``) and the compile's status while it runs
    (``status.CompileStatus``); with ``compile_in_background``, a fifth:
    ``background.BackgroundCompile``, made at each setup that trains."""

    #: The name that registers the strategy, and its registry description.
    strategy_name: str
    description: str
    #: Whether DDP wraps the module (its strategy sets it): then regions compile whole
    #: (``environment.DDPGraphSplitOff``).
    wraps_in_ddp = False
    #: Regional options this kind of strategy cannot use (``split_options`` refuses them).
    excluded_options: tuple[str, ...] = ()
    #: Whether the engine's hooks on each region run eager, outside its compiled forward
    #: (``compile_regions(eager_hooks=True)``; DeepSpeed's strategy sets it).
    eager_hooks = False
    #: What the keep-or-revert gate's eager turns run (``gate.CompilePayoff``): every
    #: call eager; the Trainer's teardown puts the compiled calls back after a run that
    #: stopped mid-turn.
    EAGER_TURN = EAGER

    if TYPE_CHECKING:  # what the parts need of the Lightning or Fabric strategy mixed in
        # after this class (``gate.Processes``, ``background.switch.Processes``)

        @property
        def root_device(self) -> torch.device: ...

        @property
        def is_global_zero(self) -> bool: ...

        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...

        def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def __init__(self, **kwargs: Any) -> None:
        """The regional options and the Lightning strategy's own arguments, all
        keyword-only: the options are kept here, the rest go to the strategy."""
        options, own = split_options(kwargs, self.excluded_options)
        super().__init__(**own)
        self._init_regional(options)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this class under ``strategy_name`` in ``strategy_registry`` (the
        Trainer's ``StrategyRegistry`` or Fabric's ``STRATEGY_REGISTRY``)."""
        strategy_registry.register(
            cls.strategy_name, cls, description=cls.description, override=True
        )

    def _init_regional(self, options: RegionalOptions) -> None:
        self.options = options
        self.compile_cache = CompileCache(options.cache_dir)
        self.environment = CompileEnvironment(
            options.disable_training_kv_cache,
            options.unspecialize_module_ints,
            whole_graphs_under_ddp=self.wraps_in_ddp,
        )
        self.reporter = FirstStepReporter(options.recompile_warn_threshold)
        self.status = CompileStatus()
        self.background: BackgroundCompile | None = None
        #: Whether the compiled regions pay on this run's steps (``keep_if_faster``).
        self.payoff: CompilePayoff | None = None
        #: Each module's last keep-or-revert decision, for its validate, test, predict.
        self.decided = Decided()
        #: Whether a setup compiled here and has not been torn down yet.
        self._set_up = False

    @property
    def compile_kwargs(self) -> dict[str, Any]:
        """What goes to ``torch.compile`` for each region."""
        return self.options.compile_kwargs

    @property
    def cache_dir(self) -> str | None:
        """The folder passed as ``cache_dir``, or None for torch's own compile cache."""
        return self.compile_cache.chosen

    def artifact_guard(self) -> dict[str, str]:
        """What compile artifacts made here must match to be loaded elsewhere."""
        device = self.root_device
        device_type = device.type
        if device_type == "cuda":  # kernels are built for one GPU model: name it
            device_type = f"cuda ({torch.cuda.get_device_name(device)})"
        return artifact_guard(device_type, self.compile_kwargs)

    def leave_parts(self) -> None:
        """Leave what setup entered: an undecided keep-or-revert (the regions compiled
        again; the log says how far it got), the background compile, the compile cache
        and the compile environment."""
        if self.payoff is not None:
            undecided = self.payoff.end()
            if undecided is not None:
                rank_zero_info(f"regional compile on this run's steps: {undecided}")
        if self.background is not None:
            if not self.background.switched:
                rank_zero_info(self.background.summary())
            self.background.stop()
        self.status.exit()
        self.compile_cache.exit()
        self.environment.exit()
        self._set_up = False

    def attached_trainer(self) -> Any:
        """The Trainer whose progress bar shows a compile while it runs and whose loggers
        get its figures (``status``, ``figures``); None for Fabric's loops (the log
        shows them)."""
        return None

    def trains_here(self) -> bool:
        """Whether this setup runs optimizer steps, at whose boundaries the background
        compile can switch (the Trainer's ``fit``; Fabric's loop always may)."""
        return True

    def compile_in_place(self, module: Any, root_is_called: bool) -> None:
        """The one compile point of every regional strategy: plan ``module``'s regions,
        let the engine prepare them (``before_compile``), compile them in place and log
        them, then let the engine finish (``after_compile``); with
        ``compile_in_background`` in a setup that trains, start the background compile
        instead (``background.BackgroundCompile``), which compiles by the same plan at
        its switch."""
        _refuse_whole_model_compile(module)
        self._set_up = True
        self.compile_cache.enter()
        self.environment.enter(module)
        recipe = CompileRecipe(self.options, self.eager_hooks)  # after the environment's flags
        plan = find_regions(module, self.options.regions, root_is_called=root_is_called)
        self.status.enter(plan, self.attached_trainer)
        self.before_compile(plan)
        if self.background is not None:
            self.background.stop()
            self.background = None
        if self.options.compile_in_background and not self.trains_here():
            rank_zero_info(
                "regional compile: compile_in_background switches at optimizer steps, and "
                "this run has none (validate, test or predict): the regions compile now"
            )
        elif self.options.compile_in_background and tracker_of(module) is None:
            self.background = BackgroundCompile(
                module,
                root_is_called,
                plan,
                recipe,
                self.options.background_timeout_s,
                self.artifact_guard(),
            )
            rank_zero_info(
                f"regional compile: {len(plan.regions)} region(s) run eager while one child "
                "process compiles them (compile_in_background=True)"
            )
            return
        self._compile_now(module, root_is_called, plan, recipe)
        self.after_compile(plan)

    def before_compile(self, plan: RegionPlan) -> None:
        """What the engine does to the planned regions before they compile (none here;
        FSDP2 shards by the plan, DeepSpeed makes each region a ZeRO-3 leaf)."""

    def after_compile(self, plan: RegionPlan) -> None:
        """What the engine does to the regions once they are compiled in place (none
        here; FSDP2 shards then where it compiles before sharding)."""

    def at_step_boundary(self, *modules: Any, phase: str = "training") -> None:
        """After a step's optimizer steps: until the background switch, its step boundary
        (which may compile the regions now); then report each of ``modules`` (the
        LightningModule; the modules a Fabric loop set up) as the default mode does, and
        time the step for the keep-or-revert gate."""
        background = self.background
        if background is not None and not background.switched:
            if background.at_step_boundary(self):  # the switch: compile now, warm
                module, plan = background.module, background.plan
                self._compile_now(module, background.root_is_called, plan, background.recipe)
                background.warm_evaluation()
            self.status.note(background.state())
            return
        first = not all(self.reporter.has_reported(module) for module in modules)
        fallbacks = self.reporter.fallbacks
        for module in modules:
            report = self.reporter.after_optimizer_step(module, phase)
            if report is not None:
                log_figures(self.attached_trainer(), first_step_figures(report))
        if self.reporter.fallbacks != fallbacks:
            log_figures(self.attached_trainer(), {"fallbacks": self.reporter.fallbacks})
        if first and self.background is not None and self.background.switched:
            self.background.first_compiled_step_done()
            rank_zero_info(self.background.summary())
            log_figures(self.attached_trainer(), switch_figures(self.background))
        if self.payoff is not None:
            decision = self.payoff.at_step_boundary(modules, self)
            if decision is not None:
                rank_zero_info(f"regional compile on this run's steps: {decision}")
                log_figures(self.attached_trainer(), decision_figures(decision))
                self.decided.record(modules, decision)

    def _compile_now(
        self, module: Any, root_is_called: bool, plan: RegionPlan, recipe: CompileRecipe
    ) -> None:
        recipe.compile(module, plan, root_is_called)
        rank_zero_info(f"{region_report(module)}")
        self.reporter.enter()
        self.payoff = None
        # a fit measures its own steps (its batch size, its trainable layers); validate,
        # test and predict after it run the regions as its decision chose
        earlier = None if self.trains_here() else self.decided.get(module)
        if earlier is not None and earlier.chosen in (COMPILED, EAGER):
            rank_zero_info(f"regional compile, {follow(module, earlier)}")
            if earlier.chosen == EAGER:
                self.reporter.runs_eager(module)
            return
        # nothing to time where torch.compile is turned off: the report says why
        pays = self.options.keep_if_faster and self.trains_here() and not compile_turned_off()
        if pays:
            self.payoff = CompilePayoff(self.payoff_candidates(), self.EAGER_TURN)
            self.decided.forget([module])

    def payoff_candidates(self) -> tuple[Candidate, ...]:
        """The ways besides compiled and eager that ``keep_if_faster`` times: none here
        (Fabric's loop may accumulate gradients unseen); the Trainer's single-device
        strategy adds CUDA graphs (``payoff.cuda_graphs_candidate``)."""
        return ()


class RegionalCompileMixin(RegionalCompileBase, Strategy):
    """Compiles the LightningModule's regions in place after device placement.

    Mixed in before a Lightning strategy class, so each hook here wraps the strategy's
    own and delegates to the parts in a few lines: ``class MyRegional(
    RegionalCompileMixin, MyStrategy)``, or ``regional_strategy(MyStrategy)``, which
    also chooses the right mixin for DDP, FSDP and DeepSpeed strategies
    (docs/usage.md). Takes the regional options and the strategy's own arguments, all
    keyword-only.
    """

    #: Whether the regions compile in ``model_to_device`` (else in a hook of the
    #: engine's own, before it wraps the model: FSDP1's and DeepSpeed's).
    compiles_in_model_to_device = True

    @override
    def attached_trainer(self) -> Any:
        """The Trainer of the LightningModule, or None before one is attached
        (``strategy.load_checkpoint`` may be called then)."""
        module = self.lightning_module
        if module is None:
            return None
        try:
            return module.trainer
        except RuntimeError:  # "... is not attached to a `Trainer`."
            return None

    def set_up_module(self) -> Any:
        """The LightningModule being set up (Lightning attaches it before ``setup``)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{type(self).__name__}: no LightningModule is attached yet.")
        return module

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.compile_cache.enter()

    @override
    def teardown(self) -> None:
        super().teardown()
        self.leave_parts()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Store this process's compile-cache artifacts in the checkpoint, then save it."""
        if self.is_global_zero:
            payload = pack_artifacts(self.artifact_guard())
            if payload is not None:
                checkpoint[CHECKPOINT_KEY] = payload
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint, and its compile-cache artifacts if they fit this run.
        Called before a Trainer is attached, it loads the checkpoint alone: there is no
        run yet whose cache the artifacts belong to (a Trainer restoring the checkpoint
        loads them then)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if self.attached_trainer() is None:
            return checkpoint
        if self._set_up and self.payoff is not None and self.payoff.phases:
            self.payoff.rolled_back()
            self.decided.forget([self.lightning_module])
            self.payoff = CompilePayoff(self.payoff.candidates, self.payoff.eager_turn)
            rank_zero_info(
                "regional compile: a checkpoint restored mid-fit rolled back the steps "
                "timed so far (Lightning's batch-size and learning-rate searches do after "
                "their trials): the keep-or-revert decision is made on the steps that follow"
            )
        self.compile_cache.enter()  # artifacts are written into the run's compile cache
        unpack_artifacts(
            checkpoint.get(CHECKPOINT_KEY),
            self.artifact_guard(),
            self.options.trust_unsigned_artifacts,
        )
        return checkpoint

    @override
    def payoff_candidates(self) -> tuple[Candidate, ...]:
        if not isinstance(self, SingleDeviceStrategy) or self.eager_hooks:
            return ()  # several processes or an engine's hooks (its device may not be set)
        plain_steps = self.one_backward_a_step()
        candidate = cuda_graphs_candidate(self.options, self.root_device, True, plain_steps)
        return () if candidate is None else (candidate,)

    def one_backward_a_step(self) -> bool:
        """Whether each optimizer step follows one forward and backward: automatic
        optimization without gradient accumulation (manual optimization may run several
        backwards a step, a GAN's two, and we cannot see how many)."""
        trainer = self.attached_trainer()
        if trainer is None or self.manual_optimization():
            return False
        return trainer.accumulate_grad_batches == 1

    @override
    def model_to_device(self) -> None:
        # abstract in Strategy: the Lightning strategy mixed in after this one defines it
        super().model_to_device()  # type: ignore[safe-super]
        if self.compiles_in_model_to_device:
            self.compile_in_place(self.lightning_module, root_is_called=False)  # training_step

    #: Manual optimization: whether an optimizer stepped in the training step running.
    _stepped_in_training_step = False

    def manual_optimization(self) -> bool:
        """Whether the LightningModule steps its optimizers itself, in ``training_step``
        (``automatic_optimization = False``: a GAN's two, a step every N batches)."""
        module = self.lightning_module
        return module is not None and not module.automatic_optimization

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.payoff is not None:  # the timed step starts here, after any validation
            self.payoff.training_starts((args, kwargs))  # the batch, its index (no tensor)
        if not self.manual_optimization():
            return super().training_step(*args, **kwargs)
        self._stepped_in_training_step = False
        output = super().training_step(*args, **kwargs)
        if self._stepped_in_training_step:  # every optimizer step of it is done
            self.at_step_boundary(self.lightning_module)
        return output

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        """The step boundary: after the optimizer step (automatic optimization, one a
        step), or at the end of the ``training_step`` that stepped (manual optimization:
        a GAN's generator and discriminator steps are one step, not two of two ways)."""
        output = super().optimizer_step(*args, **kwargs)
        if self.manual_optimization():
            self._stepped_in_training_step = True
        else:
            self.at_step_boundary(self.lightning_module)
        return output

    @override
    def trains_here(self) -> bool:
        trainer = self.attached_trainer()
        return trainer is None or trainer.state.fn == TrainerFn.FITTING

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        trainer = self.attached_trainer()
        sanity = trainer is not None and trainer.sanity_checking
        self.watch_after("the validation sanity check" if sanity else "validation")

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self.watch_after("test")

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self.watch_after("predict")

    def watch_after(self, phase: str) -> None:
        """After an evaluation loop: warn of regions that fell back to eager in it, and
        log their count."""
        if self.reporter.watch_recompiles(self.lightning_module, phase):
            log_figures(self.attached_trainer(), {"fallbacks": self.reporter.fallbacks})


def _refuse_whole_model_compile(module: Any) -> None:
    if isinstance(module, OptimizedModule) or compiled_by_torch_compile_context(module):
        raise ValueError(
            f"{type(module).__name__} was passed wrapped by torch.compile. Regional "
            "compilation compiles the blocks itself: pass the plain LightningModule."
        )
    if compiled_call(module) is not None:
        raise ValueError(
            f"{type(module).__name__} was compiled whole with .compile(). Regional "
            "compilation compiles the blocks itself: pass the plain LightningModule."
        )


@takes_options()
class RegionalCompileStrategy(RegionalCompileMixin, SingleDeviceStrategy):
    """Single-device training with the LightningModule's repeated blocks compiled in place.

    The device is the Trainer's (``accelerator=`` and ``devices=``). More than one
    device raises: use ``RegionalCompileDDPStrategy`` (``"regional_compile_ddp"``).
    Checkpoints also carry the compiled artifacts. Every argument is keyword-only.

    Args:
        accelerator: passed to ``SingleDeviceStrategy``.
        checkpoint_io: passed to ``SingleDeviceStrategy``.
        precision_plugin: passed to ``SingleDeviceStrategy``.
    """

    strategy_name = "regional_compile"
    description = "Single device, repeated blocks compiled in place"

    def __init__(
        self,
        *,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(
            device="cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            **options,
        )
        self._device_from_trainer: torch.device | None = None

    @property
    @override
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


@takes_options(base=DDPStrategy.__init__)
class RegionalCompileDDPStrategy(RegionalCompileMixin, DDPStrategy):
    """Multi-process DDP with each process's repeated blocks compiled in place.

    Regions are compiled after the model is on its device and before DDP wraps it.
    Every argument is keyword-only: the regional options below, and every
    ``DDPStrategy`` argument (``process_group_backend``, ``start_method``,
    ``find_unused_parameters``...).

    Args:
    """

    strategy_name = "regional_compile_ddp"
    description = "DDP, repeated blocks compiled in place in each process"
    wraps_in_ddp = True


def register(*classes: type[RegionalCompileBase]) -> None:
    """Make ``"regional_compile"`` and ``"regional_compile_ddp"`` (and the names of
    ``classes``) Trainer strategy names."""
    ours: tuple[type[RegionalCompileBase], ...] = (
        RegionalCompileStrategy,
        RegionalCompileDDPStrategy,
        *classes,
    )
    for cls in ours:
        cls.register_strategies(StrategyRegistry)
