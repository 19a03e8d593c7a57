"""Property test: the architecture's invariants on random module graphs, in both modes.

Random graphs nest ``Node``s, ``ModuleList``s, ``Sequential``s and ``ModuleDict``s, and
mix in aliases (an already-built module registered again), repeated blocks, ``None``
children and tied weights. 200 examples by default; ``HYPOTHESIS_PROFILE=thorough``
runs 1,000.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import registrations
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from lightning_regions import compile_regions, region_report, snapshot

WIDTH = 4


def run(module: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    if module is None:
        return x
    if isinstance(module, nn.ModuleDict):
        module = list(module.values())
    if isinstance(module, (nn.ModuleList, list)):
        for child in module:
            x = run(child, x)
        return x
    return module(x)


class Node(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self._modules.values():
            x = torch.tanh(run(child, x))
        return x


class Rep(Node):
    """The repeated-block class."""


class Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.proj(x))


class GraphBuilder:
    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.built: list[nn.Module] = []  # finished modules: safe to alias (no cycles)

    def module(self, depth: int, callable_only: bool = False) -> nn.Module | None:
        kinds = ["leaf", "linear"]
        if depth > 0:
            kinds += ["node", "seq"] + ([] if callable_only else ["rep_list", "list", "dict"])
        if self.built:
            kinds.append("alias")
        if not callable_only:
            kinds.append("none")
        kind = self.draw(st.sampled_from(kinds))
        if kind == "alias":
            candidates = [m for m in self.built if not callable_only or _is_callable(m)]
            if candidates:
                return self.draw(st.sampled_from(candidates))
            kind = "leaf"
        result = self._new(kind, depth)
        if result is not None:
            self.built.append(result)
        return result

    def _new(self, kind: str, depth: int) -> nn.Module | None:
        n = self.draw(st.integers(1, 3))
        if kind == "none":
            return None
        if kind == "leaf":
            return Leaf()
        if kind == "linear":
            return nn.Linear(WIDTH, WIDTH)
        if kind == "node":
            node = Node()
            for i in range(n):
                node.register_module(f"c{i}", self.module(depth - 1))
            return node
        if kind == "seq":
            return nn.Sequential(*(self.module(depth - 1, callable_only=True) for _ in range(n)))
        if kind == "rep_list":
            blocks = []
            for _ in range(n + 1):
                if blocks and self.draw(st.booleans()):
                    blocks.append(self.draw(st.sampled_from(blocks)))  # same block again
                    continue
                block = Rep()
                block.register_module("body", self.module(depth - 1))
                blocks.append(block)
            return nn.ModuleList(blocks)
        children = [self.module(depth - 1) for _ in range(n)]
        if kind == "list":
            container = nn.ModuleList()
            for child in children:
                container._modules[str(len(container._modules))] = child
            return container
        return nn.ModuleDict({f"k{i}": child for i, child in enumerate(children)})


def _is_callable(module: nn.Module) -> bool:
    return not isinstance(module, (nn.ModuleList, nn.ModuleDict))


@st.composite
def module_graphs(draw: st.DrawFn) -> nn.Module:
    builder = GraphBuilder(draw)
    root = Node()
    for i in range(draw(st.integers(1, 3))):
        root.register_module(f"top{i}", builder.module(depth=3))
    linears = [m for m in root.modules() if isinstance(m, nn.Linear)]
    for _ in range(draw(st.integers(0, 2))):
        if len(linears) >= 2:
            a, b = draw(st.permutations(linears))[:2]
            b.weight = a.weight
    return root


def resolves_like(result: nn.Module, source: nn.Module) -> None:
    """Invariant 1: every path resolves, and an alias group names one object."""
    before, after = snapshot(source), snapshot(result)
    assert after.modules.keys() == before.modules.keys()
    assert after.none_paths == before.none_paths
    assert after.alias_groups == before.alias_groups
    for group in before.alias_groups:
        assert len({id(result.get_submodule(path)) for path in group if path}) <= 1, group


def ties_hold(result: nn.Module, source: nn.Module) -> None:
    """Invariant 2: tied parameters are one object, held once by an optimizer."""
    before, after = snapshot(source), snapshot(result)
    assert after.tie_groups == before.tie_groups
    for path, param in after.parameters.items():
        assert param is before.parameters[path], path
    params = list(result.parameters())
    if params:
        optimizer = torch.optim.SGD(params, lr=0.1)
        held = [id(p) for group in optimizer.param_groups for p in group["params"]]
        assert len(held) == len(set(held)) == len({id(p) for p in before.parameters.values()})


def matches_eager(result: nn.Module, eager: nn.Module) -> None:
    """Invariant 3: outputs and gradients equal those of an eager copy."""
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1))
    got, want = result(x), eager(x)
    torch.testing.assert_close(got, want)
    if not want.requires_grad:
        return
    got.square().sum().backward()
    want.square().sum().backward()
    eager_params = snapshot(eager).parameters
    for path, param in snapshot(result).parameters.items():
        torch.testing.assert_close(param.grad, eager_params[path].grad, msg=path)
    for param in (*result.parameters(), *eager.parameters()):
        param.grad = None


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(module_graphs())
def test_invariants_hold_on_random_graphs(source):
    torch._dynamo.reset()
    eager = copy.deepcopy(source)
    keys = list(source.state_dict())
    kept = registrations(source)

    out_of_place = compile_regions(source, backend="eager")
    resolves_like(out_of_place, source)
    ties_hold(out_of_place, source)
    matches_eager(out_of_place, eager)
    assert registrations(source) == kept  # invariant 4: the source is unchanged
    assert not region_report(out_of_place).never_ran_compiled
    again = compile_regions(out_of_place, backend="eager")  # invariant 6
    wrappers = [m for m in again.modules() if isinstance(m, OptimizedModule)]
    assert not any(isinstance(w._orig_mod, OptimizedModule) for w in wrappers)

    in_place_source = copy.deepcopy(eager)
    in_place = compile_regions(in_place_source, inplace=True, backend="eager")
    assert in_place is in_place_source
    assert list(in_place.state_dict()) == keys  # invariant 5
    resolves_like(in_place, eager)
    matches_eager(in_place, eager)
    assert not region_report(in_place).never_ran_compiled
    compiled_calls = {id(m): m._compiled_call_impl for m in in_place.modules()}
    compile_regions(in_place, inplace=True, backend="eager")  # invariant 6
    assert {id(m): m._compiled_call_impl for m in in_place.modules()} == compiled_calls
