"""transformers' KV cache: kept off where nothing asked for it, and generation, which
keeps it, run eager.

A transformers model (a ``PreTrainedModel``) whose config says ``use_cache=True`` builds
a ``DynamicCache`` in every forward, training and validation included, although a
training or validation step never reads it. Each layer then updates the cache through
its own ``layer_idx``, so the layer's compiled graph guards on that index and a repeated
block recompiles once per layer until dynamo's recompile limit leaves the rest eager
(GPT-2 and Llama at 12 layers: 8 graphs and 4 layers eager, in training and again in
the validation sanity check).

``disable_kv_cache_unless_asked`` registers a forward pre-hook on each outermost
``PreTrainedModel`` that passes ``use_cache=False`` when the caller did not pass
``use_cache`` itself (by keyword where its ``forward`` takes none but hands its
``**kwargs`` to a model that does). ``generate()`` always passes it (``model_kwargs["use_cache"]``),
so generation keeps the cache; so does any call with ``use_cache=True``. The config is
not changed, and the strategies remove the hook at teardown. The returned cache is the
only difference, so losses and logits are unchanged, unless a forward reads back a cache
it wrote itself (dory with sections that overlap, 8 + 20 + 8 of 12 layers: see
``benchmarks/families.py``).

Generation is the one place that reads the cache, and each cached forward guards on a
per-layer value of it (``cache.layers[i].is_initialized``), so ``generate()`` compiled
regions would compile one graph per layer until dynamo's recompile limit, which counts
per code object: from then on the block runs eager everywhere, training included (GPT-2
and Llama at 12 layers, a ``validation_step`` that generates: 48 of 48 training block
calls eager). ``eager_generation`` wraps each outermost model's ``generate`` in
``torch.compiler.set_stance("force_eager")``, as plain Lightning generates (and as it
does under ``torch.compile(lightning_module)``, whose ``validation_step`` reaches the
decoder's ``generate`` outside the compiled call): generation compiles nothing, costs
no block its compiled code, and gives eager's tokens. ``restore_generation`` takes the
wrapper off.

Plain torch: transformers is recognised by class name and not imported.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

#: Set on a model whose hook is registered, so a second setup adds none.
HOOK_ATTRIBUTE = "_lightning_regions_kv_cache_hook"


def is_transformers_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (found in the class's bases, not imported)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def _use_cache_position(module: nn.Module) -> int | None:
    """Where ``use_cache`` sits among ``forward``'s positional parameters, or None when
    ``forward`` takes no ``use_cache``."""
    parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    for position, parameter in enumerate(parameters):
        if parameter.name == "use_cache":
            return position
    return None


def _forwards_use_cache(module: nn.Module) -> bool:
    """``forward`` takes no ``use_cache`` but passes its ``**kwargs`` on, and a
    transformers model inside takes one: a ``use_cache`` keyword reaches that model
    (GraniteMoE's and Fuyu's ``*ForCausalLM``, Gemma 3's and GOT-OCR2's
    ``*ForConditionalGeneration`` build the cache in the model they wrap)."""
    parameters = inspect.signature(type(module).forward).parameters.values()
    if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return False
    return any(
        inner is not module
        and is_transformers_model(inner)
        and _use_cache_position(inner) is not None
        for inner in module.modules()
    )


def _cache_on(module: nn.Module) -> bool:
    """Whether the config of ``module`` or of a transformers model inside it turns the
    cache on (a multimodal model's own config may have no ``use_cache``: Fuyu's and
    Gemma 3's live in their ``text_config``, which the language model inside reads)."""
    return any(
        getattr(getattr(inner, "config", None), "use_cache", False)
        for inner in module.modules()
        if is_transformers_model(inner)
    )


def _cache_switch(module: nn.Module) -> tuple[bool, int | None]:
    """Whether a ``use_cache`` argument reaches ``module``'s KV cache, and where it sits
    among ``forward``'s positional parameters (None: by keyword only)."""
    position = _use_cache_position(module)
    if position is not None:
        return True, position
    return _forwards_use_cache(module), None


def outermost_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, model)`` of each outermost transformers model under ``root``."""
    found: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for path, module in root.named_modules(remove_duplicate=True):
        if id(module) not in inside and is_transformers_model(module):
            inside.update(id(m) for m in module.modules())
            found.append((path, module))
    return found


def models_without_use_cache(root: nn.Module | None) -> list[str]:
    """Class names of the outermost transformers models under ``root`` whose ``forward``
    takes no ``use_cache``: if such a model builds a KV cache (XLM builds one in every
    forward), nothing the caller passes turns it off."""
    if root is None:
        return []
    return sorted(
        {type(model).__name__ for _, model in outermost_models(root) if not _cache_switch(model)[0]}
    )


def disable_kv_cache_unless_asked(root: nn.Module) -> list[str]:
    """Register the ``use_cache=False``-unless-asked hook on each outermost transformers
    model under ``root`` whose config turns the cache on; return their paths."""
    changed = []
    for path, module in outermost_models(root):
        switch, position = _cache_switch(module)
        if not switch or not _cache_on(module):
            continue
        if getattr(module, HOOK_ATTRIBUTE, None) is None:
            handle = module.register_forward_pre_hook(
                WithoutCacheUnlessAsked(position), with_kwargs=True
            )
            module.__dict__[HOOK_ATTRIBUTE] = handle
        changed.append(path)
    return changed


class WithoutCacheUnlessAsked:
    """The forward pre-hook: ``use_cache=False`` unless the caller passed ``use_cache``
    (by keyword, or as positional argument ``position``; None: it has no position). An
    object, not a closure, so a model saved with ``torch.save`` while the strategy holds
    it still pickles."""

    def __init__(self, position: int | None) -> None:
        self.position = position

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        passed = self.position is not None and len(args) > self.position
        if "use_cache" in kwargs or passed:
            return None  # the caller chose
        return args, {**kwargs, "use_cache": False}


class EagerGenerate:
    """A model's ``generate`` run under ``torch.compiler.set_stance("force_eager")``.

    Pickled and copied as the model's own ``generate``: a model saved with ``torch.save``
    or copied while the strategy holds it is a plain model."""

    def __init__(self, generate: Any) -> None:
        self.generate = generate

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return self.generate(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (getattr, (self.generate.__self__, "generate"))


def eager_generation(root: nn.Module) -> list[str]:
    """Run ``generate()`` of each outermost transformers model under ``root`` eager;
    return their paths."""
    changed = []
    for path, module in outermost_models(root):
        generate = getattr(module, "generate", None)
        if generate is None or isinstance(generate, EagerGenerate):
            continue
        module.__dict__["generate"] = EagerGenerate(generate)
        changed.append(path)
    return changed


def restore_generation(root: nn.Module) -> None:
    """Take the wrappers ``eager_generation`` put on ``root``'s models off."""
    for module in root.modules():
        if isinstance(module.__dict__.get("generate"), EagerGenerate):
            del module.__dict__["generate"]


def restore_kv_cache(root: nn.Module) -> None:
    """Remove the hooks ``disable_kv_cache_unless_asked`` registered under ``root``."""
    for module in root.modules():
        handle = module.__dict__.pop(HOOK_ATTRIBUTE, None)
        if handle is not None:
            handle.remove()
