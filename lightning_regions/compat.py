"""The torch APIs we rely on that torch does not promise to keep, checked once at import.

A torch without one of them fails here, naming the version, the API and what it is for,
instead of with an ``AttributeError`` deep in a training run.
"""

from __future__ import annotations

import importlib

import torch

#: The range ``setup.cfg`` declares; 2.13 is the one the test suite runs on.
SUPPORTED_TORCH = ">=2.7,<2.14"

#: (module, attribute, what we use it for)
PRIVATE_APIS = (
    ("torch", "_TorchCompileInductorWrapper", "the tracking backend around inductor"),
    ("torch", "_TorchCompileWrapper", "the tracking backend around other backends"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "recognising compiled modules"),
    ("torch._dynamo.exc", "TensorifyScalarRestartAnalysis", "passing dynamo's restart through"),
    ("torch._dynamo.exc", "ShortenTraceback", "passing dynamo's control flow through"),
    ("torch._dynamo.exc", "SkipFrame", "passing dynamo's control flow through"),
    ("torch._dynamo.exc", "exceptions_allowed_to_be_fallback", "passing graph breaks through"),
    ("torch._dynamo.utils", "get_compilation_metrics", "counting recompiles"),
    ("torch.fx._lazy_graph_module", "_LazyGraphModule", "calling graphs as dynamo does"),
    ("torch._inductor.utils", "clear_caches", "switching the cache directory"),
    ("torch.compiler", "save_cache_artifacts", "compile artifacts in checkpoints"),
    ("torch.compiler._cache", "CacheArtifactManager", "checking artifacts before loading"),
    ("torch.compiler._cache", "CacheArtifactFactory", "checking artifact types"),
    ("torch._inductor.runtime.cache_dir_utils", "cache_dir", "where artifacts would land"),
    ("torch._dynamo.config", "allow_unspec_int_on_nn_module", "per-instance ints symbolic"),
)


def missing_torch_apis() -> list[str]:
    """``module.attribute (what for)`` for each API this torch lacks."""
    missing = []
    for module_name, attribute, purpose in PRIVATE_APIS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        if module is None or not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute} ({purpose})")
    return missing


def require_torch_apis() -> None:
    """Raise ``ImportError`` naming the torch version and every missing API."""
    missing = missing_torch_apis()
    if missing:
        raise ImportError(
            f"lightning_regions needs torch{SUPPORTED_TORCH}; this torch {torch.__version__} "
            f"lacks: {'; '.join(missing)}."
        )
