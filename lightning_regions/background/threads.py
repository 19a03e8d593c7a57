"""Intra-op threads, without ``torch.set_num_threads``'s side effect on MKL: how the
background mode shares the CPU while its child compiles (the training process runs on
fewer threads until the switch, ``switch.BackgroundCompile``), and gives the threads back.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class IntraOpThreads:
    """The calling thread's intra-op thread settings before ``limit_intra_op_threads``."""

    count: int  # torch.get_num_threads()
    mkl_local: int | None  # MKL's thread-local count (0: its global one); None: not set
    through_torch: bool  # whether the limit went through torch.set_num_threads


@functools.cache
def _openmp_set_num_threads() -> Any:
    """The OpenMP runtime's ``omp_set_num_threads`` that ATen's parallel ops follow, from
    the process's global symbols (torch's wheels load their OpenMP runtime globally on
    Linux); None where ATen's parallel backend is not OpenMP or the symbol is not there."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        function = ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        return None
    function.argtypes, function.restype = [ctypes.c_int], None
    return function


@functools.cache
def torch_cpu_library() -> ctypes.CDLL | None:
    """torch's libtorch_cpu, where torch's Linux wheels link MKL (its ``MKL_*`` setters
    are exported there); None where it is not found."""
    try:
        return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return None


@functools.cache
def _mkl_set_num_threads_local() -> Any:
    """MKL's ``mkl_set_num_threads_local`` (a count for the calling thread alone, which
    leaves MKL's dynamic adjustment as it is), where torch links MKL into libtorch_cpu."""
    if not torch.backends.mkl.is_available():
        return None
    library = torch_cpu_library()
    function = getattr(library, "MKL_Set_Num_Threads_Local", None)
    if function is None:
        return None
    function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
    return function


def limit_intra_op_threads(count: int) -> IntraOpThreads:
    """Run the calling thread's intra-op work (ATen's parallel ops, MKL's BLAS) on ``count``
    threads until ``restore_intra_op_threads`` with what this returns.

    ``torch.set_num_threads`` would do it, but it also turns MKL's dynamic thread
    adjustment off for the rest of the process (``mkl_set_dynamic(false)``, pytorch#13868),
    and a process that never called it keeps MKL's default (on), with which eager steps
    ran faster here (``benchmarks/results/mkl_dynamic.md``). So the count is set
    where ATen and MKL read it for this thread (OpenMP's ``omp_set_num_threads``, MKL's
    ``mkl_set_num_threads_local``), and only where those are not found (another OpenMP
    runtime, another parallel backend) through ``torch.set_num_threads``."""
    before = torch.get_num_threads()
    openmp = _openmp_set_num_threads()
    if openmp is not None:
        openmp(count)
        if torch.get_num_threads() == count:
            mkl = _mkl_set_num_threads_local()
            local = None if mkl is None else int(mkl(count))
            return IntraOpThreads(before, local, through_torch=False)
        openmp(before)
    torch.set_num_threads(count)
    return IntraOpThreads(before, None, through_torch=True)


def restore_intra_op_threads(before: IntraOpThreads) -> None:
    """Give the calling thread back the settings ``limit_intra_op_threads`` changed."""
    if before.through_torch:
        torch.set_num_threads(before.count)
        return
    openmp = _openmp_set_num_threads()
    openmp(before.count)
    mkl = _mkl_set_num_threads_local()
    if mkl is not None and before.mkl_local is not None:
        mkl(before.mkl_local)
