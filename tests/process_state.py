"""What a test may change in its process for the tests after it, read as plain values.

The suite runs many tests in one worker process, so a mode, flag, hook or setting a test
leaves behind changes how the later tests' models trace and run (an active torch
function mode, say, makes every eager op slower and breaks dynamo's graphs). The
``conftest.py`` fixture compares this state around each test and fails the one that
leaves it changed. The private torch names it reads are kept here, beside the public
ones (the library's own are in ``lightning_regions.compat``).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile
from typing import Any

import torch
import torch.nn.modules.module as module_globals

from lightning_regions import compat
from lightning_regions.background import threads as intra_op

#: The process-wide module hooks ``torch.nn.modules.module`` keeps (``register_module_*``).
GLOBAL_MODULE_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)
#: Environment variables that change how torch or this plugin compiles and runs.
WATCHED_ENVIRONMENT = ("TORCH", "LIGHTNING_REGIONS", "OMP_", "MKL_", "MALLOC_", "PYTORCH")


def process_state() -> dict[str, Any]:
    """The process-wide settings a test could leave changed, by name."""
    state: dict[str, Any] = {
        "torch function modes": torch._C._len_torch_function_stack(),
        "torch dispatch modes": torch._C._len_torch_dispatch_stack(),
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "anomaly detection": torch.is_anomaly_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "intra-op threads": torch.get_num_threads(),
        # off after any torch.set_num_threads: every later test's small matmuls then run
        # on all threads, and beside a busy worker wait tens of ms for the second core
        "MKL dynamic adjustment": mkl_dynamic_adjustment(),
        "default dtype": torch.get_default_dtype(),
        "default device": str(torch.get_default_device()),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "compiler stance": repr(torch._dynamo.eval_frame._stance),
        # dynamo's frame callback, set while a compiled call runs: left set, every frame
        # after it would be traced
        "dynamo frame callback": torch._C._dynamo.eval_frame.get_eval_frame_callback(),
        # autograd's saved-tensor hooks (checkpointing, offload): left set, every eager
        # backward would pack through them and dynamo would break graphs on them
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(True),
        "cpu autocast": torch.is_autocast_enabled("cpu"),
        "cuda autocast": torch.is_autocast_enabled("cuda"),
        "sys.getprofile()": sys.getprofile(),
        "sys.gettrace()": sys.gettrace(),
    }
    for name in GLOBAL_MODULE_HOOKS:
        state[f"torch.nn.modules.module.{name}"] = len(getattr(module_globals, name, {}))
    for config, settings in compat.compile_settings().items():
        for name, value in settings.items():
            state[f"{config} config {name}"] = value
    for name, value in os.environ.items():
        if name.startswith(WATCHED_ENVIRONMENT):
            state[f"${name}"] = value
    return state


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """``name: before -> after`` for each setting that differs (``unset`` where absent)."""
    return [
        f"{name}: {before.get(name, 'unset')!r} -> {after.get(name, 'unset')!r}"
        for name in sorted(before.keys() | after.keys())
        if before.get(name, "unset") != after.get(name, "unset")
    ]


def restore(before: dict[str, Any]) -> None:
    """Put back what can be put back by value: threads, grad mode, the environment and
    the compile settings (so that one test's leak does not fail the tests after it)."""
    put_back_threads(before["intra-op threads"], before["MKL dynamic adjustment"])
    torch.set_grad_enabled(before["grad enabled"])
    for name in [n for n in os.environ if n.startswith(WATCHED_ENVIRONMENT)]:
        if f"${name}" not in before:
            del os.environ[name]
    for key, value in before.items():
        if key.startswith("$"):
            os.environ[key[1:]] = value
    compat.load_compile_settings(
        {
            config: {
                key.split(" config ", 1)[1]: value
                for key, value in before.items()
                if key.startswith(f"{config} config ")
            }
            for config in ("dynamo", "inductor")
        }
    )


def mkl_dynamic_adjustment() -> bool | None:
    """Whether MKL may use fewer threads than its maximum (its dynamic adjustment, on by
    default; ``torch.set_num_threads`` turns it off), None without MKL. MKL has no getter
    that torch exports: read from the ``Dyn:`` field of its verbose line for one matmul,
    which it prints to file descriptor 1."""
    if not torch.backends.mkl.is_available():
        return None
    square = torch.ones(64, 64)
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    with tempfile.TemporaryFile() as printed:
        saved = os.dup(1)
        os.dup2(printed.fileno(), 1)
        try:
            with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                square @ square
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        printed.seek(0)
        found = re.search(rb"Dyn:(\d)", printed.read())
    return None if found is None else found.group(1) == b"1"


def put_back_threads(threads: int, mkl_dynamic: bool | None) -> None:
    """Intra-op ``threads`` and MKL's dynamic adjustment as they were, without
    ``torch.set_num_threads``: once it was called, ATen may call it again (it did at
    ``torch.__config__.parallel_info()``, in one order of calls), turning the flag off
    again, so a flag put back after it may not stay."""
    if torch.get_num_threads() != threads:
        intra_op.limit_intra_op_threads(threads)
    if mkl_dynamic is not None and mkl_dynamic_adjustment() != mkl_dynamic:
        set_mkl_dynamic_adjustment(mkl_dynamic)


def set_mkl_dynamic_adjustment(on: bool) -> None:
    """Turn MKL's dynamic adjustment on or off (``mkl_set_dynamic``, which torch links
    into libtorch_cpu)."""
    intra_op.torch_cpu_library().MKL_Set_Dynamic(ctypes.c_int(int(on)))  # type: ignore[union-attr]
