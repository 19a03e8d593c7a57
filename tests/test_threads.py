"""The background mode's CPU sharing (``background/threads.py``): the calling thread's
intra-op threads limited and given back without ``torch.set_num_threads``'s side effect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_regions.background import threads as intra_op

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")
def test_limiting_intra_op_threads_leaves_mkls_dynamic_adjustment_as_it_was():
    """``torch.set_num_threads`` turns MKL's dynamic thread adjustment off for the rest of
    the process (a process that never called it keeps it on: the tiny GPT's eager step
    1.14x faster here, ``benchmarks/mkl_dynamic.py``); ``limit_intra_op_threads`` changes
    the count alone."""
    from process_state import mkl_dynamic_adjustment, set_mkl_dynamic_adjustment

    was, threads = mkl_dynamic_adjustment(), torch.get_num_threads()
    set_mkl_dynamic_adjustment(True)
    try:
        before = intra_op.limit_intra_op_threads(1)
        assert torch.get_num_threads() == 1 and not before.through_torch
        intra_op.restore_intra_op_threads(before)
        assert torch.get_num_threads() == threads
        assert mkl_dynamic_adjustment() is True
    finally:
        set_mkl_dynamic_adjustment(bool(was))
    # what the limit avoids, torch's own setter, in a process of its own: after it, ATen
    # may call it again (it did at ``torch.__config__.parallel_info()`` after the flag was
    # put back, in one order of calls), so this worker could not be sure to have it back
    canary = (
        "import sys, torch; sys.path.insert(0, 'tests')\n"
        "from process_state import mkl_dynamic_adjustment as on\n"
        "first = on(); torch.set_num_threads(torch.get_num_threads()); print(first, on())"
    )
    done = subprocess.run(
        [sys.executable, "-c", canary], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.split()[-2:] == ["True", "False"], done.stdout
