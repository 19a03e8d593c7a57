"""The region report (``diagnosis/report.py``): its rows, the regions that never ran
compiled, and its table naming regions, aliases and ties."""

from __future__ import annotations

import pytest
import torch
from models import SharedModel, Stack, tokens
from torch import nn

from lightning_regions import (
    RegionNotCompiledWarning,
    compile_regions,
    region_report,
    warn_if_not_compiled,
)

MODES = [pytest.param(False, id="out_of_place"), pytest.param(True, id="in_place")]


class SkippedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    @torch._dynamo.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@pytest.mark.parametrize("inplace", MODES)
def test_a_region_that_never_ran_compiled_is_reported(inplace, counting_backend):
    model = Stack(depth=2)
    model.extra = nn.ModuleList([SkippedBlock(), SkippedBlock()])
    compiled = compile_regions(model, inplace=inplace, backend=counting_backend)
    x = torch.randn(2, 8)
    compiled(x)
    compiled.extra[0](x)  # runs, but eager: dynamo skips the frame
    report = region_report(compiled)
    never = {row.paths for row in report.never_ran_compiled}
    assert never == {("extra.0",), ("extra.1",)}
    with pytest.warns(RegionNotCompiledWarning, match="extra.0"):
        warn_if_not_compiled(report)


def test_report_names_regions_aliases_and_ties():
    model = SharedModel()
    compiled = compile_regions(model, backend="eager")
    compiled(tokens())
    text = str(region_report(compiled))
    assert "4 region(s)" in text
    assert "blocks.0, blocks.4, blocks_alias.0, blocks_alias.4" in text
    assert "blocks = blocks_alias" in text
    assert "embed.weight = head.weight" in text
    assert "EAGER" not in text
