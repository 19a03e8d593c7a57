"""The suite's check that a test leaves its process as it found it (``conftest.py``)."""

from __future__ import annotations

import os

import torch
from process_state import changes, process_state, restore

from lightning_regions.background import threads as intra_op


def test_what_a_test_leaves_changed_is_named_and_what_can_be_is_put_back():
    before = process_state()
    torch.set_default_device("cpu")  # a torch function mode on the stack
    torch._dynamo.config.recompile_limit = 3
    intra_op.limit_intra_op_threads(1 if torch.get_num_threads() > 1 else 2)
    os.environ["TORCH_LOGS"] = "recompiles"
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    hooks.__enter__()
    try:
        left = changes(before, process_state())
    finally:
        hooks.__exit__(None, None, None)
        torch.set_default_device(None)
        restore(before)
    named = {change.split(":")[0] for change in left}
    assert {
        "torch function modes",
        "dynamo config recompile_limit",
        "intra-op threads",
        "$TORCH_LOGS",
        "saved-tensor hooks",
    } <= named, left
    assert "dynamo config recompile_limit: 8 -> 3" in left
    assert changes(before, process_state()) == []  # all put back
