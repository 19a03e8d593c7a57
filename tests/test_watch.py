"""torch's compile records read (``core/watch.py``): a recompile reason parsed into its
guard, the user's source line and its location, across torch's forms."""

from __future__ import annotations

from lightning_regions.core.watch import parse_guard


def test_recompile_reasons_parse_into_guard_source_and_location():
    reason = (
        "0/7: self.layer_idx == 7            # return x * self.layer_idx  # a/b.py:14 in "
        "forward (HINT: torch.compile considers integer attributes ...)\nUser stack trace:\n"
    )
    guard = parse_guard(reason)
    assert guard.expression == "self.layer_idx == 7"
    assert guard.source == "return x * self.layer_idx"
    assert guard.location == "a/b.py:14 in forward"
    assert parse_guard("0/1: tensor 'x' requires_grad mismatch").on_input_tensor
    # a float torch < 2.13 specialised after its restart: no user line, torch's forms
    for older in (
        "0/2: ___as_tensor(self.drop_prob).item() == 0.01  # (unknown source "
        "___as_tensor(self.drop_prob).item(), please file a bug)",
        "0/2: self.drop_prob == 0.01  # (_dynamo/output_graph.py:3205 in "
        "remove_tensorify_specialized_graphargs)",
    ):
        assert parse_guard(older) == parse_guard("0/2: self.drop_prob == 0.01")
        assert parse_guard(older).expression == "self.drop_prob == 0.01"
