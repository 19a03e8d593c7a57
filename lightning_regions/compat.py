"""torch's private names and version differences: the one place that knows them.

Two tables:

- ``PRIVATE_APIS``: every torch name we use that torch does not promise to keep. They
  are checked once at import, so a torch without one fails here, naming the version,
  the API and what it is for, instead of with an ``AttributeError`` deep in a run. The
  rest of the package reaches them through this module only.
- ``TORCH_GATES``: every place where we work around a torch bug or answer a difference
  between torch releases, with the releases it applies to (as measured, each by a test
  that runs on every torch CI runs), what torch does, and what we do about it.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

#: The range ``setup.cfg`` declares. CI runs the suite on the oldest and the newest
#: release of it and on the pinned default (``TESTED_TORCH``).
SUPPORTED_TORCH = ">=2.11,<2.16"
#: Where the suite has passed: 2.13.0 (``make test``, the pinned CPU wheel), 2.11.0
#: and 2.15.0 (``make test-torch``, CI), 2.14.1 (by hand). The gates below were also
#: measured on 2.12.1.
TESTED_TORCH = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")

#: This torch's release, without a local build tag (``2.15.0+cu132`` -> ``2.15.0``).
TORCH_RELEASE = Version(torch.__version__.split("+")[0]).base_version

#: (module, attribute or dotted attribute path, what we use it for)
PRIVATE_APIS = (
    ("torch", "_TorchCompileInductorWrapper", "the tracking backend around inductor"),
    ("torch", "_TorchCompileWrapper", "the tracking backend around other backends"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "recognising compiled modules"),
    ("torch._dynamo.exc", "TensorifyScalarRestartAnalysis", "passing dynamo's restart through"),
    ("torch._dynamo.exc", "ShortenTraceback", "passing dynamo's control flow through"),
    ("torch._dynamo.exc", "SkipFrame", "passing dynamo's control flow through"),
    ("torch._dynamo.exc", "exceptions_allowed_to_be_fallback", "passing graph breaks through"),
    ("torch._dynamo.utils", "get_compilation_metrics", "counting recompiles"),
    ("torch._dynamo.utils", "counters", "counting graph breaks"),
    ("torch.fx._lazy_graph_module", "_LazyGraphModule", "calling graphs as dynamo does"),
    ("torch._inductor.utils", "clear_caches", "switching the cache directory"),
    ("torch._inductor", "list_mode_options", "inductor options of a mode"),
    ("torch.compiler", "save_cache_artifacts", "compile artifacts in checkpoints"),
    ("torch.compiler._cache", "CacheArtifactManager", "checking artifacts before loading"),
    ("torch.compiler._cache", "CacheArtifactFactory._artifact_types", "checking artifact types"),
    (
        "torch.compiler._cache",
        "CacheArtifactManager._ensure_cache_artifacts_registered",
        "knowing every artifact type",
    ),
    ("torch._inductor.runtime.cache_dir_utils", "cache_dir", "where artifacts would land"),
    (
        "torch._inductor.runtime.cache_dir_utils",
        "default_cache_dir",
        "where torch caches without TORCHINDUCTOR_CACHE_DIR",
    ),
    ("torch._dynamo.config", "allow_unspec_int_on_nn_module", "per-instance ints symbolic"),
    ("torch._dynamo.config", "specialize_float", "naming a specialised float's fix"),
    ("torch._dynamo.config", "recompile_limit", "warning of recompiles before the limit"),
    ("torch._dynamo.eval_frame", "_debug_get_cache_entry_list", "graphs held for a code"),
    ("torch._dynamo.eval_frame", "remove_from_cache", "dropping gone models' graphs"),
    ("torch._dynamo.eval_frame", "_stance", "telling torch.compile turned off"),
    ("torch._dynamo.config", "disable", "telling torch.compile turned off"),
    ("torch._dynamo.config", "optimize_ddp", "keeping regions whole under DDP"),
    ("torch._dynamo.config", "_is_default", "leaving a dynamo setting the user made alone"),
    ("torch._dynamo.config", "save_config_portable", "the background child's dynamo settings"),
    ("torch._dynamo.config", "load_config", "the background child's dynamo settings"),
    ("torch._inductor.config", "save_config_portable", "the background child's inductor settings"),
    ("torch._inductor.config", "load_config", "the background child's inductor settings"),
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state", "FSDP2 groups' mesh sizes"),
    ("torch.nn", "Module._call_impl", "calling a module past its compiled call"),
    ("torch.utils._pytree", "tree_flatten", "shipping a region's example inputs"),
    (
        "torch._guards",
        "CompileContext.current_compile_id",
        "telling the pieces of DDP's graph split from graph breaks",
    ),
    ("torch.utils._pytree", "tree_unflatten", "shipping a region's example inputs"),
    ("torch._dynamo", "callback_handler", "showing a compile while it runs"),
    ("torch._dynamo.callback", "CallbackTrigger", "showing what compiles"),
    ("torch._dynamo.utils", "get_chromium_event_logger", "the phase a compile is in"),
)

#: The slots every ``nn.Module`` instance keeps its registrations in (``__init__`` sets
#: them, so they are checked on an instance): the plan reads every registration, ``None``
#: and repeated ones included, which ``named_children()`` and ``named_parameters()`` skip.
MODULE_CHILDREN = "_modules"
MODULE_PARAMETERS = "_parameters"
MODULE_BUFFERS = "_buffers"
#: The slots of a module's forward pre-hooks, by handle id, and of those taking kwargs.
MODULE_PRE_HOOKS = "_forward_pre_hooks"
MODULE_PRE_HOOKS_WITH_KWARGS = "_forward_pre_hooks_with_kwargs"
PRE_HOOK_SLOTS = (MODULE_PRE_HOOKS, MODULE_PRE_HOOKS_WITH_KWARGS)
#: Where ``nn.Module.compile`` puts the compiled call (instance ``__dict__``).
COMPILED_CALL = "_compiled_call_impl"
#: Where an ``OptimizedModule`` keeps the module it wraps; also a path segment of it.
COMPILED_SOURCE = "_orig_mod"


def missing_torch_apis() -> list[str]:
    """``module.attribute (what for)`` for each API this torch lacks."""
    missing = []
    for module_name, attribute, purpose in PRIVATE_APIS:
        try:
            found: Any = importlib.import_module(module_name)
        except ImportError:
            found = None
        for name in attribute.split("."):
            found = getattr(found, name, None)
        if found is None:
            missing.append(f"{module_name}.{attribute} ({purpose})")
    instance = torch.nn.Module()
    for slot in (MODULE_CHILDREN, MODULE_PARAMETERS, MODULE_BUFFERS, *PRE_HOOK_SLOTS):
        if not isinstance(vars(instance).get(slot), dict):
            missing.append(f"torch.nn.Module().{slot} (reading every registration)")
    if COMPILED_CALL not in vars(torch.nn.Module):  # None there, so not a PRIVATE_APIS row
        missing.append(f"torch.nn.Module.{COMPILED_CALL} (compiling a region in place)")
    return missing


def require_torch_apis() -> None:
    """Raise ``ImportError`` naming the torch version and every missing API."""
    missing = missing_torch_apis()
    if missing:
        raise ImportError(
            f"lightning_regions needs torch{SUPPORTED_TORCH}; this torch {torch.__version__} "
            f"lacks: {'; '.join(missing)}."
        )


require_torch_apis()  # before the imports below touch any of them

# The private names, for the rest of the package.
from torch._dynamo import callback_handler as compile_callbacks  # noqa: E402
from torch._dynamo import eval_frame as _eval_frame  # noqa: E402
from torch._dynamo import exc as _dynamo_exc  # noqa: E402
from torch._dynamo.eval_frame import OptimizedModule  # noqa: E402
from torch._dynamo.utils import counters as dynamo_counters  # noqa: E402
from torch._dynamo.utils import get_chromium_event_logger, get_compilation_metrics  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir  # noqa: E402
from torch._inductor.runtime.cache_dir_utils import (  # noqa: E402
    default_cache_dir as default_inductor_cache_dir,
)
from torch._inductor.utils import clear_caches as clear_inductor_caches  # noqa: E402
from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager  # noqa: E402
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: E402

__all__ = [
    "CacheArtifactFactory",
    "CacheArtifactManager",
    "LazyGraphModule",
    "OptimizedModule",
    "clear_inductor_caches",
    "compile_callbacks",
    "default_inductor_cache_dir",
    "dynamo_counters",
    "get_compilation_metrics",
    "inductor_cache_dir",
    "tree_flatten",
    "tree_unflatten",
]


@dataclass(frozen=True)
class TorchGate:
    """A torch behaviour that only some releases have, and what we do about it.

    ``releases`` is a version specifier over torch releases (``">=2.13"``), measured on
    2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0, and checked by ``test`` on every torch CI
    runs.
    """

    releases: str
    torch_does: str
    we_do: str
    test: str

    @property
    def applies(self) -> bool:
        """True on this torch."""
        return TORCH_RELEASE in SpecifierSet(self.releases)


NESTED_BACKWARD_BUFFER_REUSE = TorchGate(
    releases=">=2.8",  # every torch with nested_compile_region; not fixed in 2.15.0
    torch_does=(
        "inductor reuses buffers across the calls of a nested region's backward, so a later "
        "call reads what an earlier one overwrote: wrong gradients, right outputs. Measured "
        "on tests/test_nested.py's canary (a Linear, 3 Linear+tanh nested blocks, LayerNorm "
        "and a Linear head, width 1024), largest gradient error relative to eager's largest: "
        "0.66 on 2.13.0 and 2.15.0 (right on 2.11.0); without the LayerNorm 1.0 on 2.11.0 and "
        "2.13.0 (right on 2.15.0), where a matmul writes over its own input, so at width 8 "
        "the result is the BLAS's (one machine's MKL wrong, another's right); the tiny GPT "
        "at depth 4: an absolute error of 22 on 2.13.0 and 2.15.0"
    ),
    we_do=(
        "graphs holding nested regions are compiled with allow_buffer_reuse=False "
        "(nested.NESTED_INDUCTOR_OPTIONS): gradients equal eager's on every one"
    ),
    test="tests/test_nested.py::test_torch_still_needs_buffer_reuse_off_for_nested_regions",
)

BACKEND_INDEX_ERROR_REACHES_USER = TorchGate(
    releases=">=2.13",
    torch_does=(
        "OutputGraph._call_user_compiler re-raises an IndexError from the backend untouched "
        "(2.11 and 2.12 wrap it in BackendCompilerFailed)"
    ),
    we_do="pass IndexError through the tracking backend on these releases only",
    test="tests/test_dynamo_passthrough.py::test_the_reraised_group_is_the_one_torch_reraises",
)

FLOAT_ATTRIBUTE_SYMBOLIC_AFTER_FIRST_CHANGE = TorchGate(
    releases=">=2.13",
    torch_does=(
        "a float attribute that differs per instance is compiled as a constant for the "
        "first instance and symbolic from the second: 2 graphs whatever the depth. 2.11 and "
        "2.12 specialise it again for every instance after dynamo's tensorify restart, "
        "until the recompile limit leaves the rest eager (12 layers: 8 graphs, 4 eager)"
    ),
    we_do=(
        "nothing differs in our code: the report counts the graphs either way and names the "
        "attribute with the fix (a tensor buffer)"
    ),
    test="tests/test_per_instance.py::test_a_drop_path_float_schedule_is_reported_with_its_cost",
)

SPECIALISED_FLOAT_GUARD_WITHOUT_SOURCE = TorchGate(
    releases="<2.13",
    torch_does=(
        "a float specialised after the tensorify restart is recorded without the user's "
        "line: 2.11 writes `___as_tensor(self.scale).item() == 0.1  # (unknown source ...)`, "
        "2.12 `self.scale == 0.1  # (_dynamo/output_graph.py:3205 in "
        "remove_tensorify_specialized_graphargs)`; 2.13+ `self.scale == 0.1  # <the line>`"
    ),
    we_do="watch.parse_guard reads each form as the attribute's guard, with no source line",
    test="tests/test_watch.py::test_recompile_reasons_parse_into_guard_source_and_location",
)

NESTED_REUSE_LIMIT = TorchGate(
    releases=">=2.12",
    torch_does=(
        "a nested region whose guards fail per instance is traced again per call until "
        "torch's reuse limit (8), then compiling fails ('exceeded maximum reuse entries'). "
        "2.11 has no limit: it traces every instance's block, silently, so the cost grows "
        "with depth"
    ),
    we_do=(
        "the limit's error becomes a NestedRegionError naming the regions and the fix; "
        "without the limit, the report counts traced and reused calls and warns "
        "(PerInstanceRecompileWarning) when instances of a class are traced apart"
    ),
    test="tests/test_nested.py::test_torchs_limits_raise_naming_the_regions_and_the_fix",
)

TORCH_GATES: dict[str, TorchGate] = {
    "nested_backward_buffer_reuse": NESTED_BACKWARD_BUFFER_REUSE,
    "backend_index_error_reaches_user": BACKEND_INDEX_ERROR_REACHES_USER,
    "float_attribute_symbolic_after_first_change": FLOAT_ATTRIBUTE_SYMBOLIC_AFTER_FIRST_CHANGE,
    "specialised_float_guard_without_source": SPECIALISED_FLOAT_GUARD_WITHOUT_SOURCE,
    "nested_reuse_limit": NESTED_REUSE_LIMIT,
}


def dynamo_reraised_exceptions() -> tuple[type[BaseException], ...]:
    """What dynamo re-raises from a backend call untouched, on this torch: its restart of
    the analysis with a float specialised, its traceback shortening, a request to skip the
    frame, and (``BACKEND_INDEX_ERROR_REACHES_USER``) IndexError."""
    reraised: tuple[type[BaseException], ...] = (
        _dynamo_exc.TensorifyScalarRestartAnalysis,
        _dynamo_exc.ShortenTraceback,
        _dynamo_exc.SkipFrame,
    )
    if BACKEND_INDEX_ERROR_REACHES_USER.applies:
        reraised += (IndexError,)
    return reraised


def dynamo_graph_break_exceptions() -> tuple[type[BaseException], ...]:
    """Backend exceptions dynamo turns into a graph break with a warning."""
    return tuple(_dynamo_exc.exceptions_allowed_to_be_fallback)


def compile_wrapper(
    backend: Any, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None
) -> Any:
    """What ``torch.compile`` builds around ``backend`` (its private wrapper classes)."""
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode or "default", options, dynamic)
    return torch._TorchCompileWrapper(backend, mode or "default", options, dynamic)


def inductor_modes() -> list[str]:
    """The names ``torch.compile(mode=...)`` takes."""
    return sorted(torch._inductor.list_mode_options())


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The inductor options ``mode`` stands for."""
    return dict(torch._inductor.list_mode_options(mode))


def registered_artifact_types() -> set[str]:
    """The compile-cache artifact types this torch registers (all of them imported)."""
    CacheArtifactManager._ensure_cache_artifacts_registered()
    return set(CacheArtifactFactory._artifact_types)


def isa_probe_sources() -> set[str]:
    """The C++ sources of inductor's CPU instruction-set probes (``VecISA`` subclasses'
    ``_*_code``): a process with a fresh cache directory builds each with g++ before its
    first CPU kernel, cached or not. Empty where this torch names them otherwise."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return set()
    sources = set()
    for cls in vars(cpu_vec_isa).values():
        if isinstance(cls, type) and issubclass(cls, getattr(cpu_vec_isa, "VecISA", ())):
            for name, value in vars(cls).items():
                if name.startswith("_") and name.endswith("_code") and isinstance(value, str):
                    sources.add(value)
    return sources


def dynamo_config() -> Any:
    """``torch._dynamo.config``, the module whose flags we read and set."""
    return torch._dynamo.config


def compile_settings() -> dict[str, dict[str, Any]]:
    """dynamo's and inductor's settings in effect, as inductor's cache key reads them
    (``save_config_portable``: without the settings that are this process's own, such
    as the compile threads or the cache switches)."""
    return {
        "dynamo": torch._dynamo.config.save_config_portable(),
        "inductor": inductor_config.save_config_portable(),
    }


def load_compile_settings(settings: dict[str, dict[str, Any]]) -> None:
    """Make ``compile_settings()``'s result this process's settings (only those that
    differ are set: setting a deprecated one warns)."""
    for config, saved in (
        (torch._dynamo.config, settings["dynamo"]),
        (inductor_config, settings["inductor"]),
    ):
        current = config.save_config_portable()
        changed = {k: v for k, v in saved.items() if k not in current or current[k] != v}
        if changed:
            config.load_config(changed)


#: torch's counters of its compile caches, by the names ``cache_counts`` gives them.
CACHE_COUNTERS = {
    "fx_graph_hits": ("inductor", "fxgraph_cache_hit"),
    "fx_graph_misses": ("inductor", "fxgraph_cache_miss"),
    "aot_autograd_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_autograd_misses": ("aot_autograd", "autograd_cache_miss"),
}


def cudagraph_skips() -> int:
    """Graphs that inductor compiled for CUDA graphs (``mode="reduce-overhead"``) and runs
    without them, in this process so far; ``TORCH_LOGS=cudagraphs`` says why."""
    return int(dynamo_counters["inductor"]["cudagraph_skips"])


def graphs_held(code: CodeType) -> int:
    """The compiled graphs dynamo holds for ``code`` in this process (its cache entries,
    which count against ``recompile_limit``)."""
    return len(_eval_frame._debug_get_cache_entry_list(code))


def drop_graphs(code: CodeType) -> None:
    """Drop every compiled graph dynamo holds for ``code``: its next call compiles anew."""
    _eval_frame.remove_from_cache(code)


def compile_turned_off() -> str:
    """How torch.compile is turned off in this process, so every compiled call runs
    eager ('' where it is not): ``torch._dynamo.config.disable`` (``TORCH_COMPILE_DISABLE
    =1``) or ``torch.compiler.set_stance("force_eager")``."""
    if torch._dynamo.config.disable:
        return "torch._dynamo.config.disable is True, as TORCH_COMPILE_DISABLE=1 sets it"
    stance = _eval_frame._stance.stance
    if stance == "force_eager":
        return 'torch.compiler.set_stance("force_eager") is in force'
    return ""


def frames_compiled() -> int:
    """Frames dynamo set out to compile in this process so far (a first compile or a
    recompile, any backend): unchanged over a step that only ran compiled code."""
    return int(dynamo_counters["frames"]["total"])


def cache_counts() -> dict[str, int]:
    """This process's FX-graph and AOTAutograd cache hits and misses so far."""
    return {
        name: int(dynamo_counters[group][counter])
        for name, (group, counter) in CACHE_COUNTERS.items()
    }


def current_frame_compile() -> object:
    """Which frame compile is running (dynamo's compile id: the frame and its recompile
    number), or None outside one. The graphs dynamo's DDP optimizer splits one frame's
    graph into share it; a graph break starts a frame compile of its own."""
    return torch._guards.CompileContext.current_compile_id()


def dynamo_setting_is_default(name: str) -> bool:
    """Whether nobody set dynamo's setting ``name`` (by assignment or its environment
    variable): it holds torch's default."""
    return bool(dynamo_config()._is_default(name))


def recompile_limit() -> int:
    """dynamo's ``recompile_limit``: the graphs one code object may compile before torch
    runs it eager (8 by default)."""
    return int(torch._dynamo.config.recompile_limit)


# --- private attributes read on objects (not importable, so not in PRIVATE_APIS) -------


def registered_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s child registrations as stored: ``None`` children included."""
    return vars(module)[MODULE_CHILDREN]


def set_registered_children(module: nn.Module, children: dict[str, nn.Module | None]) -> None:
    """Replace ``module``'s child registrations (on a shallow copy)."""
    vars(module)[MODULE_CHILDREN] = children


def registered_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter registrations as stored: ``None`` ones included."""
    return vars(module)[MODULE_PARAMETERS]


def remove_forward_pre_hooks(module: nn.Module, hook_ids: set[int]) -> None:
    """Take the forward pre-hooks registered under ``hook_ids`` (their handles' ids) off
    ``module`` (a copy whose hooks dict it shares with nobody)."""
    for slot in PRE_HOOK_SLOTS:
        hooks = vars(module)[slot]
        for hook_id in hook_ids & set(hooks):
            del hooks[hook_id]


def registered_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffer registrations as stored: ``None`` ones included."""
    return vars(module)[MODULE_BUFFERS]


def compiled_call(module: nn.Module) -> Any:
    """What ``nn.Module.compile`` set as ``module``'s call, or None."""
    return getattr(module, COMPILED_CALL)


def set_compiled_call(module: nn.Module, call: Any) -> None:
    """Make ``call`` ``module``'s call, as ``nn.Module.compile`` does with its own."""
    setattr(module, COMPILED_CALL, call)


def call_past_compiled(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` as ``nn.Module.__call__`` does without a compiled call: hooks
    and ``forward``. Traced by dynamo inside a region's trampoline."""
    return module._call_impl(*args, **kwargs)


def call_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module``'s class ``forward`` alone, without its hooks. Traced by dynamo
    inside a region compiled with its hooks eager (``compile_regions(eager_hooks=True)``)."""
    return type(module).forward(module, *args, **kwargs)


#: Where a region compiled with its hooks eager keeps its compiled forward: in the
#: instance's ``__dict__``, which ``nn.Module._call_impl`` reads (``self.forward``)
#: between the module's hooks.
FORWARD = "forward"


@functools.cache
def trace_zero3_linear_as_torch_linear() -> None:
    """Have dynamo trace DeepSpeed ZeRO-3's replacement of ``F.linear`` as torch's own
    linear, once per process (``torch.compiler.substitute_in_graph``, torch 2.5+).

    ZeRO-3 with ``memory_efficient_linear`` (DeepSpeed's default) replaces
    ``torch.nn.functional.linear`` for the whole process with
    ``deepspeed.runtime.zero.linear.zero3_linear_wrap``, an autograd function that saves
    the weight ``Parameter`` rather than a view of its gathered data and gathers it again
    in backward if it was freed. Inside a region that is a ZeRO-3 leaf, the region's own
    hooks keep its parameters gathered through its forward and its backward, so what it
    adds is DeepSpeed's code in the region's graph; traced as torch's linear, the region
    holds none (its eager parts keep DeepSpeed's)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    @torch.compiler.substitute_in_graph(zero3_linear_wrap)
    def linear(input: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> Any:
        return torch._C._nn.linear(input, weight, bias)


def compiled_source(compiled: nn.Module) -> nn.Module:
    """The module an ``OptimizedModule`` wraps."""
    return getattr(compiled, COMPILED_SOURCE)


def set_compiled_source(module: nn.Module, source: nn.Module) -> None:
    """Give an out-of-place result's root the ``_orig_mod`` an ``OptimizedModule`` has."""
    vars(module).setdefault(COMPILED_SOURCE, source)


#: The name of a lazily recompiled ``GraphModule``'s bound ``forward`` before it compiles.
LAZY_FORWARD = "_lazy_forward"


#: The global names dynamo gives the compiled graphs of a frame it compiled.
COMPILED_FN_PREFIX = "__compiled_fn"
#: The name of dynamo's wrapper frame around a compiled frame's call.
DYNAMO_WRAPPER_FRAME = "_fn"


def dynamo_original_callable(wrapped: object) -> object:
    """What ``torch.compiler.disable`` (as dynamo installs a graph) wraps, or None."""
    return getattr(wrapped, "_torchdynamo_orig_callable", None)


def is_nested_compile_region(function: object) -> bool:
    """True for a function marked by ``torch.compiler.nested_compile_region``."""
    return hasattr(function, "__marked_compile_region_fn__")


def compiled_by_torch_compile_context(module: object) -> bool:
    """True for a module that ``torch.compile`` wrapped through a compile context."""
    return bool(getattr(module, "_compiler_ctx", None))


def fsdp_param_groups(module: object) -> list[Any]:
    """The FSDP2 parameter groups of a ``fully_shard``-ed module (torch >= 2.10 keeps one
    per mesh, earlier releases one)."""
    state = module._get_fsdp_state()  # type: ignore[attr-defined]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group else []
    return list(groups)


#: The frame of dynamo's that holds the code it compiles, and the local holding it.
DYNAMO_COMPILE_FRAME = ("compile_inner", "code")


def compile_events() -> list[str]:
    """This thread's stack of torch's compile events (``dynamo_timed``), the very list
    torch pushes and pops: another thread may read copies while this one compiles."""
    return get_chromium_event_logger().get_stack()


def compiling_code() -> CodeType | None:
    """The code dynamo is compiling, from its frame on this thread's stack, or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != DYNAMO_COMPILE_FRAME[0]:
        frame = frame.f_back
    code = None if frame is None else frame.f_locals.get(DYNAMO_COMPILE_FRAME[1])
    return code if isinstance(code, CodeType) else None
