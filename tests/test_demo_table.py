"""The demo's comparison table, built on a tiny model with the eager backend: every row
runs in its own process, and a broken row fails here."""

from __future__ import annotations

from examples.demo_table import build_table

TINY = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, "batch_size": 4}


def test_the_demo_table_has_every_row_and_shows_accelerates_failure():
    rows, table = build_table(backend="eager", size=TINY, steps=6)
    by_name = {row.name: row for row in rows}
    assert list(by_name) == ["eager", "torch.compile", "accelerate", "lightning_regions"]
    accelerate = by_name.pop("accelerate")
    assert accelerate.error == "AttributeError: 'TinyGPT' object has no attribute 'layers'"
    for row in by_name.values():
        assert row.error is None, row.error
        assert row.time_to_first_step_s > 0 and row.steady_step_ms > 0
        assert row.ties_kept and row.aliases_kept and row.checkpoint_loads == "yes"
    assert "failed: AttributeError: 'TinyGPT' object has no attribute 'layers'" in table
    assert "saving: lightning_regions reaches its first step in" in table
