"""find_regions: automatic detection, model hints, user selectors and their errors."""

from __future__ import annotations

import pytest
from models import Block, Flat, SharedModel, Stack
from torch import nn

from lightning_regions import NoRepeatedBlocksWarning, compile_regions, find_regions


def region_paths(plan) -> list[tuple[str, ...]]:
    return [region.paths for region in plan.regions]


def test_repeated_blocks_are_found_once_each_with_all_their_paths():
    plan = find_regions(SharedModel(depth=3))
    assert region_paths(plan) == [
        ("blocks.0", "blocks.3", "blocks_alias.0", "blocks_alias.3"),
        ("blocks.1", "blocks_alias.1"),
        ("blocks.2", "blocks_alias.2"),
    ]
    assert all(r.class_name == "Block" for r in plan.regions)
    assert "repeated Block in 'blocks'" in plan.regions[0].reason


def test_mixed_class_lists_are_not_regions():
    plan = find_regions(SharedModel(depth=2))
    assert not any(p.startswith("classifier") for r in plan.regions for p in r.paths)


def test_nested_repeats_inside_a_region_are_left_to_the_outer_region():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    model = nn.Module()
    model.layers = nn.ModuleList(Outer() for _ in range(2))
    plan = find_regions(model)
    assert region_paths(plan) == [("layers.0",), ("layers.1",)]


def test_sequential_of_one_class_is_a_repeat():
    plan = find_regions(Stack(depth=3))
    assert region_paths(plan) == [("layers.0",), ("layers.1",), ("layers.2",)]


def test_repeated_blocks_hint_is_honoured():
    class Hinted(nn.Module):
        _repeated_blocks = ["Block"]

        def __init__(self):
            super().__init__()
            self.first = Block(SharedModel().positional)
            self.second = Block(self.first.positional)
            self.others = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    plan = find_regions(Hinted())
    assert region_paths(plan) == [("first",), ("second",)]
    assert plan.regions[0].reason == "named by Hinted._repeated_blocks"


def test_no_split_modules_hint_is_honoured():
    class Wrapped(nn.Module):
        _no_split_modules = ["Linear"]

        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

    plan = find_regions(Wrapped())
    assert region_paths(plan) == [("a",), ("b",)]
    assert "_no_split_modules" in plan.regions[0].reason


def test_hint_naming_absent_classes_warns_and_falls_back():
    class Stale(Stack):
        _no_split_modules = ["GoneBlock"]

    with pytest.warns(UserWarning, match="GoneBlock"):
        plan = find_regions(Stale(depth=2))
    assert region_paths(plan) == [("layers.0",), ("layers.1",)]


def test_class_name_selector():
    plan = find_regions(SharedModel(depth=2), regions=["PositionalBias"])
    assert len(plan.regions) == 1
    assert plan.regions[0].paths[0] == "positional"
    assert "blocks.1.positional" in plan.regions[0].paths


def test_path_glob_selector_and_container_selector_select_entries():
    by_glob = find_regions(SharedModel(depth=2), regions="blocks.*")
    by_container = find_regions(SharedModel(depth=2), regions="blocks")
    assert len(by_glob.regions) == len(by_container.regions) == 2
    assert all(r.class_name == "Block" for r in by_container.regions)


def test_selector_that_matches_nothing_names_what_it_saw():
    with pytest.raises(ValueError) as error:
        find_regions(SharedModel(depth=2), regions=["layers.*", "Block"])
    message = str(error.value)
    assert "['layers.*'] matched no module" in message
    assert "'Block'" in message and "'blocks'" in message and "'classifier'" in message


def test_compile_regions_raises_for_unmatched_selector_before_compiling():
    model = SharedModel(depth=2)
    with pytest.raises(ValueError, match="matched no module"):
        compile_regions(model, inplace=True, regions="nope", backend="eager")
    assert all(m._compiled_call_impl is None for m in model.modules())


def test_no_repeated_blocks_plans_the_whole_model_with_a_warning():
    with pytest.warns(NoRepeatedBlocksWarning, match="Flat has no repeated blocks"):
        plan = find_regions(Flat())
    assert plan.whole_model and region_paths(plan) == [("",)]


def test_a_list_of_lists_is_never_a_region():
    model = nn.Module()
    model.grid = nn.ModuleList(nn.ModuleList([nn.Linear(8, 8)]) for _ in range(2))
    with pytest.warns(NoRepeatedBlocksWarning):
        plan = find_regions(model)
    assert plan.whole_model
    model.grid[0].append(nn.Linear(8, 8))
    assert region_paths(find_regions(model)) == [("grid.0.0",), ("grid.0.1",)]


#: A model defined by ``exec`` in globals with no ``__name__`` (a launcher that runs a
#: config file so): its functions' ``__module__`` is None, its classes' ``"builtins"``.
EXECUTED_SOURCE = """
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = Layer()

    def forward(self, x):
        for _ in range(3):
            x = self.layer(x)
        return x
"""


def test_a_model_defined_by_exec_without_a_module_name_is_planned_and_compiled():
    import torch

    namespace = {"nn": nn, "torch": torch}
    exec(EXECUTED_SOURCE, namespace)
    assert namespace["Looped"].forward.__module__ is None
    model, plain = namespace["Looped"](), namespace["Looped"]()
    plain.load_state_dict(model.state_dict())
    plan = find_regions(model)
    assert [region.paths for region in plan.regions] == [("layer",)]
    compile_regions(model, backend="eager")
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), plain(x))
