"""The snapshot (``core/graph.py``): every registration path, ``None`` children, alias
and tie groups, and the path formatting, on a plain ``nn.Module`` graph (nothing
compiles)."""

from __future__ import annotations

from models import SharedModel
from torch import nn

from lightning_regions import snapshot
from lightning_regions.core.graph import canonical_path, compress_paths, iter_registrations


def test_every_registration_path_is_kept_with_none_children():
    model = SharedModel(depth=4)
    graph = snapshot(model)
    assert graph.modules["blocks.4"] is model.blocks[0] is graph.modules["blocks_alias.0"]
    assert "dropped" in graph.modules and graph.modules["dropped"] is None
    assert "dropped" in graph.none_paths and "blocks.0.unused" in graph.none_paths  # Block's own
    assert {path for path, _ in iter_registrations(model)} == set(graph.modules)
    assert graph.paths_of(model.positional)[0] == "positional"
    assert "blocks.1.positional" in graph.paths_of(model.positional)


def test_alias_and_tie_groups_name_one_object_each():
    model = SharedModel(depth=4)
    graph = snapshot(model)
    assert ("blocks", "blocks_alias") in graph.own_alias_groups()
    assert ("blocks.0", "blocks.4") in graph.own_alias_groups()
    assert graph.own_tie_groups() == [("embed.weight", "head.weight")]
    assert graph.parameters["head.weight"] is graph.parameters["embed.weight"]
    distinct = graph.distinct_modules()
    assert len({id(m) for m in distinct}) == len(distinct)  # one entry per object


def test_a_plain_tree_has_no_alias_or_tie():
    graph = snapshot(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    assert graph.own_alias_groups() == [] and graph.own_tie_groups() == []
    assert graph.none_paths == []


def test_paths_are_compressed_into_ranges_and_canonical_names():
    paths = ["layers.0", "layers.1", "layers.2", "layers.5", "layers.7", "layers.8", "head"]
    assert compress_paths(paths) == "layers.0-2,5,7-8, head"
    assert compress_paths([""]) == "<root>"
    assert canonical_path("model._orig_mod.blocks.0") == canonical_path("model.blocks.0")
