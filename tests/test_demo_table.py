"""The demo's comparison table, built on a tiny model with the eager backend: every row
runs in its own process, and a broken row fails here."""

from __future__ import annotations

from examples.demo_table import Row, build_table, format_table

TINY = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, "batch_size": 4}


def test_the_demo_table_has_every_row_and_shows_accelerates_failure():
    rows, table = build_table(backend="eager", size=TINY, steps=6)
    by_name = {row.name: row for row in rows}
    assert list(by_name) == [
        "eager",
        "torch.compile",
        "accelerate",
        "lightning_regions",
        "background",
    ]
    accelerate = by_name.pop("accelerate")
    assert accelerate.error == "AttributeError: 'TinyGPT' object has no attribute 'layers'"
    for row in by_name.values():
        assert row.error is None, row.error
        assert row.time_to_first_step_s > 0 and row.steady_step_ms > 0
        assert row.ties_kept and row.aliases_kept and row.checkpoint_loads == "yes"
    assert "failed: AttributeError: 'TinyGPT' object has no attribute 'layers'" in table
    assert "lightning_regions reaches its first step in" in table
    assert (
        by_name["background"].compiled_from_step > 1
        and by_name["lightning_regions"].compiled_from_step == 1
    )
    assert "background: the first step in" in table


def rows(other_cores: float, uncertainty: float) -> list[Row]:
    kept = {"ties_kept": True, "aliases_kept": True, "checkpoint_loads": "yes"}
    return [
        Row("torch.compile", 30.0, 36.0, other_cores, 29.0, uncertainty, **kept),
        Row("lightning_regions", 18.0, 22.0, other_cores, 29.5, uncertainty, **kept),
    ]


def test_the_saving_line_states_the_condition_and_a_busy_machine_is_named():
    quiet = format_table(rows(other_cores=0.02, uncertainty=0.03))
    assert "saving, on a quiet machine: lightning_regions reaches its first step in 0.60x" in quiet
    assert "DISTURBED" not in quiet
    busy = format_table(rows(other_cores=1.2, uncertainty=0.03))
    assert "saving, on a busy machine (below): lightning_regions" in busy
    assert "DISTURBED MEASUREMENT (other programs used up to 1.2 of" in busy
    stalled = format_table(rows(other_cores=0.02, uncertainty=0.12))
    assert "DISTURBED MEASUREMENT (rounds too scattered: a median uncertain by up to +-12%" in (
        stalled
    )
