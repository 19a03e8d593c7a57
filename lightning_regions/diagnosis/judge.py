"""Why a region class compiled more than once or ran in pieces, and what removes it.

Three judgements, from the plan's variants and torch's own records (a region that ran in
pieces, graph breaks or DDP's split, is ``pieces.py``'s):

- **Recompiles per instance.** A class whose instances compiled graphs of their own is
  judged against its variants (``variants.py``): one graph per variant, or a per-instance
  number that torch compiles as a constant once and symbolic after (2 graphs whatever the
  depth), is bounded and reported as such; more graphs within one variant, a
  recompile-limit hit or a region left eager grow with depth, and are warned about with a
  fix that fits the guard torch recorded.
- **The recompile limit filled by other live models.** A region class that fell back to
  eager because its code already holds torch's ``recompile_limit`` in graphs of other
  models still alive (a sweep's), with the fix.
- **A fallback at any step.** A region class whose code reached dynamo's recompile limit
  during some phase (a validation that generates, ``predict``, a later epoch) runs eager
  from then on, in every phase: named with the phase, torch's guard and the fix.

Plain data in, plain data out: with ``pieces.py``, the home of judgements.
``report.py`` assembles the data and formats the result; the strategies warn.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

from torch import nn

from ..compat import graphs_held, recompile_limit
from ..core.kv_cache import models_without_use_cache
from ..core.nested import NESTED_TRACED_APART_FIX
from ..core.regions import Region, RegionPlan
from ..core.variants import ClassVariants
from ..core.watch import ClassRecompiles, Guard, parse_guard, region_codes

#: Up to this many instances of one variant compiling graphs of their own is torch
#: compiling a per-instance number as a constant once and then as a symbolic value:
#: bounded, 2 graphs whatever the depth. More (or a recompile-limit hit) grows with depth.
SYMBOLIC_AFTER_FIRST_CHANGE = 2


# --- fix texts ------------------------------------------------------------------------

#: What each diagnosis tells the user to do, by kind: the judgements below choose the
#: kind; the texts are data (no measurements in them: those live in docs/ and
#: benchmarks/, where they are dated and re-run).
FIXES: dict[str, str] = {
    "unknown": (
        "torch recorded no guard; TORCH_LOGS=recompiles names it. Store per-instance "
        "numbers as tensor buffers and give every instance the same objects."
    ),
    "shapes": (
        "an input's shape changed from call to call (guards on tensor sizes); pad inputs to "
        "fixed sizes, or leave dynamic=None (torch's default) so that a size that changed "
        "once is compiled as symbolic."
    ),
    "uncontrolled_kv_cache": (
        "{model} builds a KV cache in every forward and takes no use_cache to turn it off "
        "(nothing the caller passes removes it), and each layer indexes it by its own layer "
        "index. Leave {blocks} that read the cache out of regions={without}: they run "
        "eager, and the other blocks compile once."
    ),
    "training_kv_cache": (
        "a transformers KV cache is built in training (config.use_cache=True) and each "
        "layer indexes it by its layer_idx. The strategies turn it off where not asked "
        "for (disable_training_kv_cache=True, the default); elsewhere pass use_cache=False."
    ),
    "object_differs": (
        "an attribute whose object or class differs per instance; give every instance "
        "the same object and class, or choose outside forward."
    ),
    "argument_none": (
        "a forward argument that is None for some instances and a tensor for others: "
        "pass the same kind of value to every instance."
    ),
    "int_attribute": (
        "a per-instance int attribute. unspecialize_module_ints=True (the strategies' "
        "default; torch._dynamo.config.allow_unspec_int_on_nn_module) compiles it as a "
        "symbolic int after the first change; or store it as a tensor buffer."
    ),
    "float_by_config": (
        "a per-instance float attribute, specialised because "
        "torch._dynamo.config.specialize_float is True; set it False (torch's default) "
        "or store the value as a tensor buffer."
    ),
    "float_specialised": (
        "a per-instance float attribute that torch specialised (it could not keep it "
        "symbolic in this forward); store the value as a tensor buffer, or make it the "
        "same on every instance."
    ),
    "attribute": (
        "make the attribute the guard reads the same on every instance, or pass it to "
        "forward as a tensor."
    ),
    "bounded_variants": "one graph per variant, whatever the depth.",
    "bounded_argument_none": (
        "a forward argument is None for some instances and a tensor for the others (a "
        "different call site, as when block 0 computes what the others receive): one "
        "graph each, whatever the depth."
    ),
    "bounded_number": (
        "a per-instance number, compiled as a constant for the first instance and "
        "symbolic from the second: 2 graphs whatever the depth. Store it as a tensor "
        "buffer (register_buffer) for one graph."
    ),
    "bounded": "2 graphs whatever the depth.",
    "moe_experts": (
        "the experts of a transformers MoE model: set its experts_implementation to "
        "'batched_mm' (from_pretrained(..., experts_implementation='batched_mm'), or "
        "config._experts_implementation before building the model): one graph per layer. "
        "Its cost: one weight slice per token-expert pair, so memory grows with tokens x top_k."
    ),
    "transformers_loss_type": (
        "transformers logs on every call that this model's loss_type is unset (a class "
        "whose name holds no loss type, such as GPT2LMHeadModel), and dynamo breaks the "
        "graph on the log call, as plain torch.compile does. Set model.loss_type = "
        "'ForCausalLM' (the loss it uses) before training: one graph."
    ),
    "graph_break_hint": "torch's hint: {hints} (not turned on for you).",
    "graph_break_unknown": "TORCH_LOGS=graph_breaks names each break and its line.",
}


@dataclass(frozen=True)
class PerInstanceRecompiles:
    """One block class whose instances compiled graphs of their own, and why.

    ``bounded``: the graphs do not grow with depth (one per variant, or a per-instance
    number compiled symbolic after its first change); reported, not warned about.
    """

    class_name: str
    instances: int
    instances_compiled: int
    instances_eager: int
    graphs: int
    limit_hits: int
    guards: tuple[Guard, ...]
    fix: str
    nested: bool = False  # nested regions traced apart, not graphs compiled apart
    bounded: bool = False
    variants: int = 1

    def __str__(self) -> str:
        if self.nested:
            return (
                f"nested {self.class_name}: {self.graphs} of {self.instances} instances traced a "
                "block of their own instead of reusing one, so the compile grows with depth "
                f"(torch records no guard for it). Fix: {self.fix}"
            )
        eager = (
            f", {self.instances_eager} left eager (recompile-limit hits {self.limit_hits})"
            if self.instances_eager or self.limit_hits
            else ""
        )
        of_variants = f" ({self.variants} variants)" if self.variants > 1 else ""
        guards = "; ".join(str(guard) for guard in self.guards) or "not recorded by torch"
        if self.bounded:
            return (
                f"{self.class_name}: {self.graphs} graph(s) from {self.instances_compiled} of "
                f"{self.instances} instances{of_variants}, bounded: {self.fix} Guard: {guards}."
            )
        return (
            f"{self.class_name}: {self.graphs} graph(s) from {self.instances_compiled} of "
            f"{self.instances} instances{of_variants}{eager}. Guard that differs per instance: "
            f"{guards}. Fix: {self.fix}"
        )


@dataclass(frozen=True)
class ClassRun:
    """What one region class did, as the judgements need it."""

    class_name: str
    paths: tuple[str, ...]  # each instance's first path
    graphs: tuple[int, ...]  # graphs compiled for each instance
    eager: int  # instances called whose observed calls never ran compiled code
    reasons: tuple[str, ...]  # torch's recompile reasons for the class's code
    limit_hits: int


def judge_recompiles(
    run: ClassRun,
    variants: ClassVariants | None,
    uncontrolled_cache: str = "",
    other_classes: tuple[str, ...] = (),
) -> PerInstanceRecompiles | None:
    """The judgement of one class's graphs against its variants, or None when one
    instance compiled everything (or nothing was recorded). ``other_classes``: the plan's
    other region classes, for a fix that leaves this one out."""
    guards = _distinct_guards(run.reasons)
    compiled = [path for path, graphs in zip(run.paths, run.graphs, strict=True) if graphs]
    if not run.limit_hits and not run.eager and (len(compiled) < 2 or not guards):
        return None
    per_variant: dict[int, int] = {}
    for path in compiled:
        index = variants.variant_of(path) if variants else 0
        per_variant[index] = per_variant.get(index, 0) + 1
    # torch compiles each kind of difference (an int attribute, an input's size) as a
    # constant once and symbolic after its first change: each kind recompiles a variant's
    # entry at most once, whatever the depth. A kind that recompiles it again, or an
    # attribute's value guarded by a graph compiled after a change (a float specialised
    # again per instance), grows with depth.
    kinds = _recompiles_per_kind(run.reasons)
    frames = [frame for frame, _kind in kinds]
    allowed = max([SYMBOLIC_AFTER_FIRST_CHANGE, *(1 + frames.count(f) for f in frames)])
    grows = (
        run.limit_hits > 0
        or run.eager > 0
        or max(kinds.values(), default=0) > 1
        or _specialised_again(run.reasons)
        or max(per_variant.values(), default=0) > allowed
    )
    count = len(variants.variants) if variants else 1
    spread = max(per_variant.values(), default=0) <= 1 and count > 1
    if grows:
        fix = fix_for(guards, uncontrolled_cache, run.class_name, other_classes)
        fix = fix if guards else FIXES["unknown"]
    elif spread:
        fix = FIXES["bounded_variants"]
    else:
        fix = bounded_fix(guards[0] if guards else None)
    return PerInstanceRecompiles(
        class_name=run.class_name,
        instances=len(run.paths),
        instances_compiled=len(compiled),
        instances_eager=run.eager,
        graphs=sum(run.graphs),
        limit_hits=run.limit_hits,
        guards=guards,
        fix=fix,
        bounded=not grows,
        variants=count,
    )


def _recompiles_per_kind(reasons: tuple[str, ...]) -> dict[tuple[str, str], int]:
    """How often each kind of guard recompiled one compiled entry: by the frame torch
    names first in each reason (``"3/1: ..."``: frame 3, one per code object, so per
    variant's entry) and the guard with its values left out (``layer_idx == 1`` and
    ``layer_idx == 2`` are one kind, as are two objects' ids; a size mismatch at index 2
    is another kind than one at index 1)."""
    counts: dict[tuple[str, str], int] = {}
    for reason in reasons:
        frame = re.match(r"\s*(\d+)/\d+: ", reason)
        expression = parse_guard(reason).expression
        if not expression:
            continue
        kind = _guard_kind(expression)
        key = (frame.group(1) if frame else "", kind)
        counts[key] = counts.get(key, 0) + 1
    return counts


def uncontrolled_kv_caches(root: nn.Module | None) -> str:
    """The transformers models under ``root`` that build a KV cache in every forward and
    take no ``use_cache`` to turn it off, for the fix text."""
    return ", ".join(models_without_use_cache(root)) if root is not None else ""


def judge_nested_traced(
    class_name: str, instances: int, traced: int
) -> PerInstanceRecompiles | None:
    """A nested region class of which more instances traced a block of their own than
    torch's symbolic-after-first-change bound, or None: torch without a reuse limit
    (``compat.NESTED_REUSE_LIMIT``) traces every instance whose guards differ."""
    if traced <= SYMBOLIC_AFTER_FIRST_CHANGE:
        return None
    return PerInstanceRecompiles(
        class_name=class_name,
        instances=instances,
        instances_compiled=traced,
        instances_eager=0,
        graphs=traced,
        limit_hits=0,
        guards=(),
        fix=NESTED_TRACED_APART_FIX,
        nested=True,
    )


def _guard_kind(expression: str) -> str:
    """A guard with every number left out but a tensor's dimension (``at index 2``)."""
    parts = re.split(r"(at index \d+)", expression)
    return "".join(p if p.startswith("at index") else re.sub(r"\d+", "N", p) for p in parts)


def _specialised_again(reasons: tuple[str, ...]) -> bool:
    """An attribute's value guarded by a graph that was itself a recompile (``"0/1:
    self.scale == 0.1"``: entry 1 specialised the value again rather than keeping it
    symbolic), in any of the guard failures a reason lists."""
    for reason in reasons:
        for line in reason.strip().splitlines():
            failure = re.match(r"\s*-?\s*\d+/(\d+): (.*)", line)
            if failure and int(failure.group(1)) > 0:
                guard = parse_guard(failure.group(2))
                if not guard.on_input_tensor and re.search(r" == [-\w.'\"]+$", guard.expression):
                    return True
    return False


def _distinct_guards(reasons: tuple[str, ...]) -> tuple[Guard, ...]:
    """Guards not on a tensor input, one per kind (``_guard_kind``: ``layers[7]`` and
    ``layers[6]`` are one), with their locations as the real paths of the files."""
    distinct: dict[str, Guard] = {}
    for reason in reasons:
        guard = parse_guard(reason)
        if guard.expression and not guard.on_input_tensor:
            real = Guard(guard.expression, guard.source, real_location(guard.location))
            distinct.setdefault(_guard_kind(guard.expression), real)
    return tuple(distinct.values())


def is_argument_none(guard: Guard) -> bool:
    """A guard on a forward argument being ``None`` (or a tensor where it was ``None``)."""
    text = guard.expression
    return bool(
        re.search(r"(args\[\d+\]|L\['\w+'\]|kwargs\['\w+'\]) is (not )?None", text)
        or ("NoneType" in text and "args[" in text)
    )


def bounded_fix(guard: Guard | None) -> str:
    """What a bounded class's extra graph is, by the guard torch recorded."""
    if guard is not None and is_argument_none(guard):
        return FIXES["bounded_argument_none"]
    if guard is not None and re.fullmatch(r"self(\.\w+)+ == .+", guard.expression):
        return FIXES["bounded_number"]
    return FIXES["bounded"]


def reads_a_kv_cache(guard: Guard) -> bool:
    """A guard on a transformers KV cache, or made by a line that reads one."""
    text = f"{guard.expression} {guard.source} {guard.location}"
    return bool(re.search(r"cache_utils|past_key_value|use_cache|\bcache\b", text))


def fix_for(
    guards: tuple[Guard, ...],
    uncontrolled_cache: str = "",
    class_name: str = "",
    other_classes: tuple[str, ...] = (),
) -> str:
    """What removes per-instance guards of these kinds (the first decides, unless one
    reads a KV cache), when the graphs grow with depth. ``uncontrolled_cache`` names a
    transformers model that builds a KV cache in every forward and takes no
    ``use_cache`` to turn it off; ``other_classes`` the plan's other region classes."""
    if not guards:
        return FIXES["unknown"]
    guard = guards[0]
    text = f"{guard.expression} {guard.source} {guard.location}"
    if any(reads_a_kv_cache(each) for each in guards):
        if uncontrolled_cache:
            without = f" (here regions={sorted(other_classes)!r})" if other_classes else ""
            return FIXES["uncontrolled_kv_cache"].format(
                model=uncontrolled_cache, blocks=class_name or "the blocks", without=without
            )
        return FIXES["training_kv_cache"]
    if "___check_type_id" in text or "___check_obj_id" in text:
        return FIXES["object_differs"]
    if is_argument_none(guard):
        return FIXES["argument_none"]
    number = re.fullmatch(r"self(\.\w+)+ == (-?[\d.e+-]+)", guard.expression)
    if number and re.fullmatch(r"-?\d+", number.group(2)):
        return FIXES["int_attribute"]
    if number and specialize_float():
        return FIXES["float_by_config"]
    if number:
        return FIXES["float_specialised"]
    return FIXES["attribute"]


def specialize_float() -> bool:
    from ..compat import dynamo_config  # a torch private name, read when a fix is chosen

    return bool(dynamo_config().specialize_float)


# --- a fallback at any step ----------------------------------------------------------


@dataclass(frozen=True)
class LimitFallback:
    """A region class whose code reached dynamo's recompile limit during ``phase``."""

    class_name: str
    phase: str
    recompiles: int
    limit: int
    guards: tuple[Guard, ...]
    fix: str
    trained: bool  # training's graph was compiled before the limit was reached

    def __str__(self) -> str:
        guards = "; ".join(str(guard) for guard in self.guards) or "not recorded by torch"
        lost = (
            "the graphs it has still run, but from now on every call that needs a new one "
            "runs eager, in every phase (training too)"
            if self.trained
            else "training has not compiled its graph yet, so its training calls run eager"
        )
        return (
            f"Region class {self.class_name} reached dynamo's recompile limit ({self.limit}) "
            f"during {self.phase} after {self.recompiles} recompile(s): {lost}. Guard that "
            f"changed: {guards}. Fix: {self.fix}"
        )


def judge_limit_fallback(
    entry: ClassRecompiles, phase: str, limit: int, trained: bool
) -> LimitFallback:
    """What a recompile-limit hit of ``entry``'s class during ``phase`` means, and its fix
    (``trained``: after training's first compiled step). torch runs the graphs a code
    object has when one fits (``FrameAction.RUN_ONLY``) and the call eager otherwise."""
    guards = _distinct_guards(tuple(entry.reasons))
    if any(reads_a_kv_cache(guard) for guard in guards) and "training" not in phase:
        fix = (
            "a forward given a transformers KV cache outside generate() (a decoding loop of "
            "your own) indexes it by each layer's index. The strategies run generate() "
            "eager; run such a loop under torch.compiler.set_stance('force_eager') as well, "
            "or call generate()."
        )
    elif guards:
        fix = fix_for(guards, class_name=entry.class_name)
    elif any(parse_guard(reason).on_input_tensor for reason in entry.reasons):
        fix = FIXES["shapes"]
    else:
        fix = FIXES["unknown"]
    return LimitFallback(entry.class_name, phase, entry.recompiles, limit, guards, fix, trained)


# --- graph breaks inside regions ---------------------------------------------------


class LimitFilledByOthers(NamedTuple):
    """A region class some of whose instances ran eager because its code already held
    ``held`` graphs, at least torch's ``recompile_limit`` and more than this model
    compiled: graphs of other live models of the class (a sweep's, a notebook's)."""

    class_name: str
    held: int

    def fix(self) -> str:
        """Why, and what to do, for the warning."""
        return (
            f"its code already holds {self.held} compiled graph(s) in this process, torch's "
            f"recompile limit (torch._dynamo.config.recompile_limit = {recompile_limit()}), "
            f"made for other models of {self.class_name} that are still alive (a sweep's or "
            "a notebook's earlier models, at other shapes). Fix: drop your references to "
            "those models before building the next one (their graphs are then dropped at "
            "its setup), call torch.compiler.reset() between them, or raise the recompile "
            "limit."
        )


def judge_limit_filled(
    plan: RegionPlan, graphs_by_class: dict[str, int], fell_back: set[str]
) -> tuple[LimitFilledByOthers, ...]:
    """Of the region classes some of whose instances fell back to eager (``fell_back``),
    those whose code holds at least torch's ``recompile_limit`` in graphs, more than this
    model compiled for it (``graphs_by_class``): graphs of other models, still alive,
    of the same class (``drop_gone_graphs`` drops those of gone ones), left this one no
    room to compile."""
    first_of_class: dict[str, Region] = {}
    for region in plan.regions:
        first_of_class.setdefault(region.class_name, region)
    found = []
    for name, region in first_of_class.items():
        if name in fell_back:
            held = max(graphs_held(code) for code in region_codes(region.module))
            if held >= recompile_limit() and held > graphs_by_class.get(name, 0):
                found.append(LimitFilledByOthers(name, held))
    return tuple(found)


# --- locations -----------------------------------------------------------------------


def real_location(location: str) -> str:
    """torch's location of a guard (``transformers/models/t5/modeling_t5.py:337 in
    forward``, cut to a common prefix with torch's own path, sometimes mid-name) with the
    real path of the file, found among the imported modules; unchanged when none ends so."""
    match = re.match(r"(.+?\.py)(:\d+.*)$", location)
    if not match:
        return location
    real = _file_ending_with(match.group(1))
    return f"{real}{match.group(2)}" if real else location


@cache
def _file_ending_with(tail: str) -> str:
    found = {
        getattr(module, "__file__", None) or ""
        for module in list(sys.modules.values())
        if (getattr(module, "__file__", None) or "").endswith(tail)
    }
    found.discard("")
    return found.pop() if len(found) == 1 else ""
