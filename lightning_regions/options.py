"""The regional options, defined once: names, defaults, types, checks and docs.

Every strategy (Trainer's and Fabric's) takes these as keyword arguments next to its
Lightning strategy's own, and keeps them as one frozen ``RegionalOptions``.
``strategy_signature`` gives each strategy the signature LightningCLI reads
(``trainer.strategy.init_args.backend: ...`` in YAML), and ``options_doc`` the lines
of its docstring's ``Args`` section, both made from the fields here. Adding an option
is a field here and the one place that reads it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, TypeVar, get_type_hints

import torch

from .cache import cache_dir_option
from .compat import inductor_modes

#: What ``on_compile_error`` accepts.
COMPILE_ERROR_POLICIES = ("raise", "eager")
#: What ``granularity`` accepts.
GRANULARITIES = ("regions", "nested")
#: A strategy class ``takes_options`` decorates.
StrategyClass = TypeVar("StrategyClass", bound=type)


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True, kw_only=True)
class RegionalOptions:
    """The regional options of a strategy, checked when made (``ValueError`` naming the
    value and the fix). See each field's ``doc``."""

    backend: str | Callable[..., Any] = field(
        default="inductor", metadata=_doc("``torch.compile`` backend name or callable.")
    )
    mode: str | None = field(
        default=None,
        metadata=_doc(
            'inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``...).'
        ),
    )
    fullgraph: bool = field(
        default=False, metadata=_doc("require each region to compile into one graph.")
    )
    dynamic: bool | None = field(
        default=None, metadata=_doc("``torch.compile``'s dynamic-shape setting.")
    )
    options: dict[str, Any] | None = field(
        default=None, metadata=_doc("inductor options (not together with ``mode``).")
    )
    regions: str | list[str] | None = field(
        default=None, metadata=_doc("class names and/or path globs; default: repeated blocks.")
    )
    on_compile_error: Literal["raise", "eager"] = field(
        default="raise",
        metadata=_doc(
            '``"raise"`` naming the failing region, or ``"eager"``: that region alone runs '
            "eager, with a warning."
        ),
    )
    recompile_warn_threshold: int | Literal["auto"] | None = field(
        default="auto",
        metadata=_doc(
            'warn when a block class recompiles this many times; ``"auto"``: one less than '
            "dynamo's ``recompile_limit`` (7 of torch's 8), so the warning comes before any "
            "region falls back; ``None``: never."
        ),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=_doc(
            "where compile caches go: ``None`` for torch's own cache, the one a plain "
            "``torch.compile`` run uses (``$TORCHINDUCTOR_CACHE_DIR``, else torch's "
            "default), shared by every run; or a folder, shared by every run that names it "
            "(docs/caches.md)."
        ),
    )
    trust_unsigned_artifacts: bool = field(
        default=False,
        metadata=_doc(
            "load compile artifacts from checkpoints not signed with this user's key. "
            "They run code when loaded: only for checkpoints you trust (Trainer only; "
            "docs/security.md)."
        ),
    )
    disable_training_kv_cache: bool = field(
        default=True,
        metadata=_doc(
            "pass ``use_cache=False`` to transformers models in every forward that does not "
            "pass ``use_cache`` (``generate()`` does): a training or validation step never "
            "reads the cache, and each layer indexing it recompiles the block."
        ),
    )
    unspecialize_module_ints: bool = field(
        default=True,
        metadata=_doc(
            "compile per-instance int attributes (a layer index) as symbolic ints after "
            "their first change (torch's ``allow_unspec_int_on_nn_module``, set while the "
            "strategy is set up)."
        ),
    )
    compile_in_background: bool = field(
        default=False,
        metadata=_doc(
            "start training at once with the regions eager while one child process in the "
            "job compiles them; every process compiles them in place, warm, at an "
            "optimizer step after it is done (docs/background.md). Not with "
            "``granularity='nested'`` or FSDP2; ``validate``, ``test`` and ``predict`` "
            "alone compile at their start."
        ),
    )
    background_timeout_s: float = field(
        default=1800.0,
        metadata=_doc(
            "seconds the background compile may take; after that it is stopped, with a "
            "warning, and the regions compile in the training process."
        ),
    )
    keep_if_faster: bool = field(
        default=True,
        metadata=_doc(
            "time this run's own training steps with the regions compiled and eager in turns "
            "(4 each, from the fourth compiled step, up to 12 where the turns disagree; a "
            "step that recompiled or ran a full garbage collection not counted; "
            "batches of varying size compared at one size; with several optimizers, a step "
            "of each), on one CUDA device also with CUDA graphs (shapes not varying), "
            "and keep the fastest, compiled only where that is at least 1% faster, agreed "
            "by every process; the log and the report give the figures and the decision, "
            "once a fit; the same Trainer's validate, test and predict of the model follow "
            "it (docs/diagnosis.md). ``False``: always compiled."
        ),
    )
    granularity: Literal["regions", "nested"] = field(
        default="regions",
        metadata=_doc(
            '``"regions"`` compiles each repeated block by itself; ``"nested"`` compiles '
            "what runs whole (each top-level child of a LightningModule), with the blocks "
            "inside marked as torch nested compile regions (traced once, reused; "
            "docs/granularity.md)."
        ),
    )

    def __post_init__(self) -> None:
        validate_compile_arguments(self.backend, self.mode, self.options)
        validate_on_compile_error(self.on_compile_error)
        validate_granularity(self.granularity)
        threshold = self.recompile_warn_threshold
        if threshold not in ("auto", None) and (
            not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1
        ):
            raise ValueError(
                f"recompile_warn_threshold={threshold!r}: use a positive count, 'auto' (one "
                "less than dynamo's recompile_limit) or None to turn the warning off."
            )
        if self.compile_in_background and self.granularity == "nested":
            raise ValueError(
                "compile_in_background=True with granularity='nested': a nested unit is "
                "compiled whole around its blocks, so no block can be shipped alone. Use "
                "granularity='regions', or leave compile_in_background off."
            )
        if not self.background_timeout_s > 0:
            raise ValueError(
                f"background_timeout_s={self.background_timeout_s!r}: use a positive number "
                "of seconds."
            )
        object.__setattr__(self, "cache_dir", cache_dir_option(self.cache_dir))

    @property
    def compile_kwargs(self) -> dict[str, Any]:
        """What goes to ``torch.compile`` for each region."""
        return {
            "backend": self.backend,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            **({"mode": self.mode} if self.mode is not None else {}),
            **({"options": self.options} if self.options is not None else {}),
        }


def option_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(RegionalOptions))


def split_options(
    kwargs: dict[str, Any], excluded: Iterable[str] = ()
) -> tuple[RegionalOptions, dict[str, Any]]:
    """The regional options among ``kwargs`` (checked), and the rest for the Lightning
    strategy. An excluded option (one the strategy cannot use) raises ``TypeError``."""
    excluded = tuple(excluded)
    refused = sorted(set(kwargs) & set(excluded))
    if refused:
        raise TypeError(f"{', '.join(refused)}: not an option of this strategy.")
    names = option_names()
    chosen = {key: value for key, value in kwargs.items() if key in names}
    rest = {key: value for key, value in kwargs.items() if key not in names}
    return RegionalOptions(**chosen), rest


def strategy_signature(
    own: Callable[..., Any], excluded: Iterable[str] = (), base: Callable[..., Any] | None = None
) -> inspect.Signature:
    """``self``, the options (keyword-only), then ``own``'s keyword parameters; with
    ``base``, that Lightning strategy's ``__init__`` parameters stand for ``own``'s
    ``**kwargs``. What LightningCLI and ``help()`` read."""
    hints = get_type_hints(RegionalOptions)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=f.default if f.default is not MISSING else inspect.Parameter.empty,
            annotation=hints[f.name],
        )
        for f in fields(RegionalOptions)
        if f.name not in set(excluded)
    ]
    taken = {param.name for param in params}
    for function in (own, base):
        if function is None:
            continue
        for param in list(inspect.signature(function).parameters.values())[1:]:
            if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL) or param.name in taken:
                continue
            params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))
            taken.add(param.name)
    return inspect.Signature(params, return_annotation=None)


def options_doc(excluded: Iterable[str] = ()) -> str:
    """The options as lines of a Google-style ``Args`` section."""
    lines = []
    for f in fields(RegionalOptions):
        if f.name not in set(excluded):
            lines.append(f"        {f.name}: {f.metadata['doc']}")
    return "\n".join(lines)


def options_table() -> str:
    """The options as the Markdown table the README shows: name, default, what it does
    (the field's doc). ``tests/test_readme.py`` holds the README to it."""
    lines = ["| option | default | what it does |", "|---|---|---|"]
    for f in fields(RegionalOptions):
        doc = f.metadata["doc"].replace("``", "`")
        lines.append(f"| `{f.name}` | `{f.default!r}` | {doc} |")
    return "\n".join(lines)


def refuse_background_and_nested(
    options: RegionalOptions, engine: str, background_why: str, nested_why: str
) -> None:
    """Raise ``ValueError`` where an engine (FSDP2, FSDP1, DeepSpeed) cannot take
    ``compile_in_background`` or ``granularity="nested"``, naming the engine, its reason
    and the fix."""
    if options.compile_in_background:
        raise ValueError(
            f"compile_in_background=True is not supported under {engine}: {background_why}. "
            "Use RegionalCompileDDPStrategy or RegionalCompileStrategy with it, or leave it "
            "off."
        )
    if options.granularity == "nested":
        raise ValueError(
            f"granularity='nested' is not supported under {engine}: {nested_why}. Use "
            "granularity='regions'."
        )


def validate_on_compile_error(policy: str) -> None:
    if policy not in COMPILE_ERROR_POLICIES:
        raise ValueError(f"on_compile_error={policy!r}: use one of {COMPILE_ERROR_POLICIES}.")


def validate_granularity(granularity: str) -> None:
    """Raise ``ValueError`` for an unknown granularity, ``RuntimeError`` for a torch
    without ``torch.compiler.nested_compile_region`` when ``"nested"`` is asked for."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}: use one of {GRANULARITIES}.")
    if granularity == "nested" and not callable(
        getattr(torch.compiler, "nested_compile_region", None)
    ):
        raise RuntimeError(
            f"granularity='nested' needs torch.compiler.nested_compile_region (torch >= 2.8); "
            f"this is torch {torch.__version__}. Use granularity='regions' or upgrade torch."
        )


def validate_compile_arguments(
    backend: str | Callable[..., Any], mode: str | None, options: dict[str, Any] | None
) -> None:
    """Raise ``ValueError``, naming the value and the fix, for arguments torch would refuse."""
    if not callable(backend):
        known = torch.compiler.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"Unknown torch.compile backend {backend!r}. Known backends: {known}.")
    if mode is not None and options is not None:
        raise ValueError("Pass either mode= or options=, not both (a torch.compile rule).")
    if mode is None:
        return
    known_modes = inductor_modes()
    if mode not in known_modes:
        raise ValueError(f"Unknown torch.compile mode {mode!r}. Known modes: {known_modes}.")
    if backend != "inductor":
        raise ValueError(f"mode={mode!r} applies to backend='inductor' only, not {backend!r}.")


def takes_options(
    excluded: Iterable[str] = (), base: Callable[..., Any] | None = None
) -> Callable[[StrategyClass], StrategyClass]:
    """A class decorator for a strategy whose ``__init__`` takes ``**options``: gives it
    an ``__init__`` of its own whose signature lists every option (keyword-only) and the
    strategy's own parameters (``base``'s for its ``**kwargs``), and adds the options to
    its docstring's ``Args`` section (its last section). LightningCLI reads both."""
    excluded = tuple(excluded)

    def decorate(cls: StrategyClass) -> StrategyClass:
        inherited = cls.__init__  # type: ignore[misc]

        @functools.wraps(inherited)
        def __init__(self: Any, **kwargs: Any) -> None:
            inherited(self, **kwargs)

        __init__.__signature__ = strategy_signature(inherited, excluded, base)  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[misc]
        cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n{options_doc(excluded)}\n"
        return cls

    return decorate
