"""What accelerate's compile_regions loses on shared structure, next to what we keep.

Each test asserts accelerate's current behaviour (1.15) and ours on the same model,
so a change on either side shows up here.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import compile_regions as accelerate_compile_regions
from models import SharedModel, tokens
from torch import nn

from lightning_regions import compile_regions, snapshot


def test_alias_vanishes_under_accelerate_and_survives_here():
    with pytest.raises(AttributeError, match="blocks_alias"):
        accelerate_compile_regions(SharedModel(), backend="eager")(tokens())
    model = SharedModel()
    torch.testing.assert_close(compile_regions(model, backend="eager")(tokens()), model(tokens()))


def test_block_at_two_positions_gets_two_wrappers_under_accelerate_one_here():
    theirs = accelerate_compile_regions(SharedModel(), backend="eager")
    assert theirs.blocks[0] is not theirs.blocks[-1]
    ours = compile_regions(SharedModel(), backend="eager")
    assert ours.blocks[0] is ours.blocks[-1]


def test_none_child_vanishes_under_accelerate_and_stays_here():
    theirs = accelerate_compile_regions(SharedModel(), backend="eager")
    assert "dropped" not in theirs._modules
    ours = compile_regions(SharedModel(), backend="eager")
    assert "dropped" in ours._modules and ours.dropped is None


def test_state_dict_keys_gain_orig_mod_under_accelerate_not_in_place_here():
    model = SharedModel()
    keys = list(model.state_dict())
    theirs = accelerate_compile_regions(SharedModel(), backend="eager")
    assert any("_orig_mod." in key for key in theirs.state_dict())
    with pytest.raises(RuntimeError, match="Missing key"):
        SharedModel().load_state_dict(theirs.state_dict(), strict=True)
    ours = compile_regions(model, inplace=True, backend="eager")
    assert list(ours.state_dict()) == keys


def test_iterated_mixed_list_is_wrapped_whole_by_accelerate_and_kept_here():
    theirs = accelerate_compile_regions(SharedModel(), backend="eager")
    with pytest.raises(TypeError, match="not iterable"):
        list(theirs.classifier)
    ours = compile_regions(SharedModel(), backend="eager")
    assert isinstance(ours.classifier, nn.ModuleList) and len(list(ours.classifier)) == 2


def test_alias_groups_lost_by_accelerate_are_kept_here():
    model = SharedModel()
    groups = snapshot(model).alias_groups
    theirs = snapshot(accelerate_compile_regions(SharedModel(), backend="eager"))
    assert len(theirs.alias_groups) < len(groups)
    assert snapshot(compile_regions(model, backend="eager")).alias_groups == groups
