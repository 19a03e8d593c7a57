"""Two-process DDP over gloo on CPU, run as a script (Lightning re-launches it per rank).

Usage: python tests/ddp_run.py {regional,nested,eager,background,eager_long,payoff} OUT_DIR
Each rank writes its final parameters and losses to OUT_DIR/<mode>_rank<r>.pt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import PAYOFF_STEPS, LenientRankOne, SlowAotEager, WaitForTheSwitch
from helpers import trainer as make_trainer

from examples.lightning_gpt import CharDataModule, GPTModule
from lightning_regions import RegionalCompileDDPStrategy, TiedWeightsCheck, region_report


def main(mode: str, out: Path) -> None:
    data = CharDataModule(block_size=16, batch_size=4)
    model = GPTModule(
        vocab_size=data.vocab_size, block_size=16, n_layer=3, n_head=2, n_embd=16, unique_blocks=2
    )
    if mode == "regional":
        strategy = RegionalCompileDDPStrategy(backend="eager", process_group_backend="gloo")
    elif mode == "background":
        strategy = RegionalCompileDDPStrategy(
            backend="aot_eager",
            process_group_backend="gloo",
            compile_in_background=True,
            keep_if_faster=False,  # 120 steps: the switch is tested here, the payoff below
        )
    elif mode == "payoff":  # rank 0 finds compiled slower; rank 1 would keep it
        strategy = RegionalCompileDDPStrategy(
            backend=SlowAotEager(only_rank=0), process_group_backend="gloo"
        )
    elif mode == "nested":
        strategy = RegionalCompileDDPStrategy(
            backend="aot_eager", process_group_backend="gloo", granularity="nested"
        )
    else:
        strategy = "ddp"
    long = mode in ("background", "eager_long")  # long enough for the child to finish
    waiting = [WaitForTheSwitch(0.5)] if mode == "background" else []  # 60 s for the child
    waiting += [LenientRankOne()] if mode == "payoff" else []
    steps = BACKGROUND_STEPS if long else PAYOFF_STEPS if mode == "payoff" else 3
    trainer = make_trainer(None, strategy, steps, [TiedWeightsCheck(), *waiting], devices=2)
    trainer.fit(model, data)
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    unit = model.model if mode == "nested" else model.model.blocks[0]
    compiled = unit._compiled_call_impl is not None
    payload = {"params": state, "losses": model.losses, "compiled": compiled}
    payload["saved_loads_equal"] = saved_loads_equal(model, trainer.model)
    if mode == "background":
        background = trainer.strategy.background
        payload["steps_eager"] = background.steps_eager
        payload["switched"] = background.switched and not background.failure
        payload["child_left"] = background.process is not None
        payload["children"] = len(background.children)
        payload["threads"] = waiting[0].threads
    if mode == "payoff":
        decision = trainer.strategy.payoff.decision
        payload["kept"] = decision.kept
        payload["compiled_ms"], payload["eager_ms"] = decision.compiled_ms, decision.eager_ms
    if mode == "nested":
        rows = region_report(model).nested
        payload["nested_calls"] = sum(row.nested_calls for row in rows)
        payload["never_ran_compiled"] = len(region_report(model).never_ran_compiled)
    torch.save(payload, out / f"{mode}_rank{trainer.global_rank}.pt")


#: Steps of the background runs: the child needs seconds to start and compile.
BACKGROUND_STEPS = 120


def saved_loads_equal(model: GPTModule, wrapped: torch.nn.Module) -> bool:
    """``torch.save`` of the trained module and of what the Trainer holds works, and the
    module loads as a plain one with the same outputs."""
    saved, trainer_model = io.BytesIO(), io.BytesIO()
    torch.save(model, saved)
    torch.save(wrapped, trainer_model)
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
    x = torch.randint(0, model.model.config.vocab_size, (2, 16))
    model.eval(), loaded.eval()
    with torch.no_grad():
        return torch.equal(model.model(x), loaded.model(x))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
