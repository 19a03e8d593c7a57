"""Lightning's private names, in one place, as ``compat.py`` holds torch's: each is a
name a Lightning class keeps for itself that our strategies must reach, checked by the
tests on every Lightning CI declares."""

from __future__ import annotations

from typing import Any

from torch import nn

#: The hook where Lightning's ``DDPStrategy``, ``FSDPStrategy`` (FSDP1) and
#: ``DeepSpeedStrategy`` take the model, in its precision, to wrap it (DeepSpeed's hands it
#: on to ``deepspeed.initialize``). Private, but each of those strategies overrides it.
LIGHTNING_WRAP_HOOK = "_setup_model"


def lightning_wrap_model(strategy_super: Any, model: nn.Module) -> Any:
    """Call the Lightning wrap hook (``LIGHTNING_WRAP_HOOK``) of ``strategy_super``, the
    ``super()`` of a strategy class that overrides it."""
    return getattr(strategy_super, LIGHTNING_WRAP_HOOK)(model)


def fabric_original_module(module: nn.Module) -> nn.Module:
    """The user's module under Fabric's ``_FabricModule`` (and DDP inside it), or
    ``module`` itself where it is not one."""
    return getattr(module, "_original_module", module)


def model_parallel_sizes(strategy: object) -> tuple[Any, Any]:
    """Lightning's ``ModelParallelStrategy`` data- and tensor-parallel sizes as passed
    (``"auto"`` or a number), which it keeps in private attributes."""
    return strategy._data_parallel_size, strategy._tensor_parallel_size  # type: ignore[attr-defined]


def set_model_parallel_sizes(strategy: object, data: int, tensor: int) -> None:
    """Set those sizes before Lightning builds the device mesh from them."""
    strategy._data_parallel_size = data  # type: ignore[attr-defined]
    strategy._tensor_parallel_size = tensor  # type: ignore[attr-defined]
