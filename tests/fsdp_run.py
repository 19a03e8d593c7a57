"""Real FSDP2 over gloo on CPU: scenarios run in one pair of processes under torchrun.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=2 \
           tests/fsdp_run.py OUT_DIR SCENARIO [SCENARIO ...]
       python tests/fsdp_run.py OUT_DIR devices1          (one process, no torchrun)

Each scenario writes what it saw to OUT_DIR/<scenario>_rank<r>.pt; the tests compare.
Several scenarios share one process pair, so the interpreter and process group start
once; dynamo is reset between them, so nothing compiled is shared.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import PAYOFF_STEPS, LenientRankOne, SeenCacheDir, SlowAotEager, trainer

from examples.lightning_gpt import CharDataModule, GPTModule
from lightning_regions import (
    RegionalCompileFSDPStrategy,
    TiedWeightsCheck,
    region_report,
)
from lightning_regions.core.compile import tracker_of

SMALL = {"block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 16, "unique_blocks": None}
STEPS = 4
GRAPHS: list[torch.fx.GraphModule] = []


def counting_aot_eager(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """aot_eager that counts the graphs it is given."""
    GRAPHS.append(gm)
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class UserShardedGPT(GPTModule):
    """The tiny GPT sharded as the Lightning docs show: each block, then the model."""

    fsdp_options: dict[str, Any] = {}

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return  # a second setup (validate after fit) shards nothing again
        options = {"mesh": self.device_mesh["data_parallel"], **self.fsdp_options}
        for block in dict.fromkeys(self.model.blocks):  # a shared block once
            fully_shard(block, **options)
        fully_shard(self.model, **options)


class DefaultMeshGPT(GPTModule):
    """Sharded with fully_shard's default mesh (every process), as many users write it."""

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return
        for block in dict.fromkeys(self.model.blocks):
            fully_shard(block)
        fully_shard(self.model)


class UserShardedBF16GPT(UserShardedGPT):
    fsdp_options = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "reshard_after_forward": False,
    }


class UntiedBeforeShardingGPT(UserShardedGPT):
    """Breaks the embedding/head tie in configure_model, before sharding."""

    def configure_model(self) -> None:
        head = self.model.lm_head
        head.weight = nn.Parameter(head.weight.detach().clone())
        super().configure_model()


class FSDP1GPT(GPTModule):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.model = FullyShardedDataParallel(self.model, device_id=torch.device("cpu"))


def data() -> CharDataModule:
    return CharDataModule(block_size=16, batch_size=4)


def make(cls: type[GPTModule] = GPTModule, **overrides: Any) -> GPTModule:
    return cls(vocab_size=data().vocab_size, **{**SMALL, **overrides})


def regional(**kwargs: Any) -> RegionalCompileFSDPStrategy:
    options = {"backend": counting_aot_eager, "process_group_backend": "gloo"}
    return RegionalCompileFSDPStrategy(**{**options, **kwargs})


def plain(**kwargs: Any) -> ModelParallelStrategy:
    options = {"data_parallel_size": 2, "tensor_parallel_size": 1, "process_group_backend": "gloo"}
    return ModelParallelStrategy(**{**options, **kwargs})


def fit(
    model: GPTModule,
    strategy: Any,
    root: Path,
    steps: int = STEPS,
    ckpt_path: str | None = None,
    devices: int = 2,
    **kwargs: Any,
) -> pl.Trainer:
    torch._dynamo.reset()
    GRAPHS.clear()
    callbacks = kwargs.pop("callbacks", ())
    run = trainer(root, strategy, steps, callbacks, devices=devices, **kwargs)
    run.fit(model, data(), ckpt_path=ckpt_path)
    return run


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, gathered whole (a collective: every rank must call it)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def summary(model: GPTModule, trainer: pl.Trainer | None = None) -> dict[str, Any]:
    block = model.model.blocks[0]
    weight = block.mlp.fc.weight if hasattr(block.mlp, "fc") else next(block.parameters())
    tracker_report = region_report(model) if tracker_of(model) is not None else None
    result = {
        "losses": list(model.losses),
        "params": full_params(model),
        "block_is_dtensor": isinstance(weight, DTensor),
        "block_local_numel": weight.to_local().numel() if isinstance(weight, DTensor) else None,
        "block_full_numel": weight.numel(),
        "tie_is_one": model.model.lm_head.weight is model.model.wte.weight,
        "graphs": len(GRAPHS),
        "compiled": block._compiled_call_impl is not None,
    }
    if tracker_report is not None:
        result["rows"] = [(row.class_name, row.compiled_calls) for row in tracker_report.rows]
    if trainer is not None and isinstance(trainer.strategy, RegionalCompileFSDPStrategy):
        result["sharded_groups"] = list(trainer.strategy.sharded_groups)
    return result


def scenario_plain(out: Path) -> dict[str, Any]:
    model = make(UserShardedGPT)
    return summary(model, fit(model, plain(), out))


def scenario_user(out: Path) -> dict[str, Any]:
    model = make(UserShardedGPT)
    strategy = regional(data_parallel_size=2, tensor_parallel_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = summary(model, fit(model, strategy, out, callbacks=[TiedWeightsCheck()]))
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return result


def scenario_default_mesh(out: Path) -> dict[str, Any]:
    """Strategy defaults (data-parallel size 1 on one node) with the default FSDP2 mesh."""
    model = make(DefaultMeshGPT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(model, regional(), out, limit_val_batches=1, num_sanity_val_steps=0)
        trainer.validate(model, data(), verbose=False)  # setup() again: no second warning
    return {
        "losses": list(model.losses),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }


def scenario_auto(out: Path) -> dict[str, Any]:
    model = make()
    trainer = fit(model, regional(), out, callbacks=[TiedWeightsCheck()])
    result = summary(model, trainer)
    # validate() runs setup() again: nothing is sharded or compiled a second time
    trainer.limit_val_batches = 2
    trainer.validate(model, data(), verbose=False)
    result["groups_after_validate"] = list(trainer.strategy.sharded_groups)
    result["val_perplexity"] = float(trainer.callback_metrics["val_perplexity"])
    return result


def scenario_albert_plain(out: Path) -> dict[str, Any]:
    model = make(UserShardedGPT, unique_blocks=1)
    return summary(model, fit(model, plain(), out))


def scenario_albert_auto(out: Path) -> dict[str, Any]:
    model = make(unique_blocks=1)
    return summary(model, fit(model, regional(), out, callbacks=[TiedWeightsCheck()]))


def scenario_bf16_plain(out: Path) -> dict[str, Any]:
    model = make(UserShardedBF16GPT)
    return summary(model, fit(model, plain(), out, precision="bf16-mixed"))


def scenario_bf16_auto(out: Path) -> dict[str, Any]:
    model = make()
    strategy = regional(reshard_after_forward=False)
    return summary(model, fit(model, strategy, out, precision="bf16-mixed"))


def failing_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    raise RuntimeError("backend failed on purpose")


def scenario_per_rank_eager_fallback(out: Path) -> dict[str, Any]:
    """on_compile_error="eager", torch's own cache directory and the recompile watch."""
    model, seen = make(), SeenCacheDir()
    strategy = regional(
        backend=failing_backend,
        on_compile_error="eager",
        recompile_warn_threshold=1,
    )  # the compile cache: torch's own, here the user's TORCHINDUCTOR_CACHE_DIR
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(out / "users_cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, strategy, out, callbacks=[seen])
    if previous is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    result = summary(model)
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    result["cache_dir"] = seen.directory
    result["errors"] = [row.compile_error for row in region_report(model).rows]
    return result


def scenario_per_rank_recompiles(out: Path) -> dict[str, Any]:
    """A sanity check compiles the eval graph; training recompiles for train mode."""
    model = make()
    strategy = regional(recompile_warn_threshold=1, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, strategy, out, limit_val_batches=1, num_sanity_val_steps=1)
    result = {"warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}
    result["recompiles"] = sum(e.recompiles for e in region_report(model).recompiles)
    return result


def inductor_counts() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {
        "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
    }


def scenario_per_rank_artifacts(out: Path) -> dict[str, Any]:
    """Inductor: a checkpoint carries the artifacts; a resume into an empty cache starts
    warm on every rank."""
    every_2 = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2, save_top_k=-1)
    torch._dynamo.utils.counters.clear()
    cold_model = make(n_layer=2)
    cold = regional(backend="inductor", cache_dir=str(out / "cache_cold"))
    fit(cold_model, cold, out, steps=2, callbacks=[every_2], limit_train_batches=2)
    cold_counts = inductor_counts()
    torch._dynamo.utils.counters.clear()
    warm_model = make(n_layer=2)
    warm = regional(backend="inductor", cache_dir=str(out / f"cache_empty{rank()}"))
    at_step_2 = str(out / "ckpts" / "epoch=0-step=2.ckpt")
    fit(warm_model, warm, out, steps=4, ckpt_path=at_step_2, limit_train_batches=2)
    return {"cold": cold_counts, "warm": inductor_counts(), "losses": warm_model.losses}


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def scenario_tie_broken(out: Path) -> dict[str, Any]:
    model = make(UntiedBeforeShardingGPT)
    strategy = regional(data_parallel_size=2, tensor_parallel_size=1)
    try:
        fit(model, strategy, out, callbacks=[TiedWeightsCheck()])
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


def scenario_payoff_plain(out: Path) -> dict[str, Any]:
    model = make(UserShardedGPT)
    return summary(model, fit(model, plain(), out, steps=PAYOFF_STEPS))


def scenario_payoff(out: Path) -> dict[str, Any]:
    """The keep-or-revert decision under FSDP2: rank 0's compiled calls are slowed,
    rank 1 keeps compiled unless it is 101x slower; the ranks must still agree."""
    model = make(UserShardedGPT)
    strategy = regional(
        backend=SlowAotEager(only_rank=0), data_parallel_size=2, tensor_parallel_size=1
    )
    callbacks = [TiedWeightsCheck(), LenientRankOne()]
    result = summary(model, fit(model, strategy, out, steps=PAYOFF_STEPS, callbacks=callbacks))
    decision = strategy.payoff.decision
    result |= {"kept": decision.kept, "ms": (decision.compiled_ms, decision.eager_ms)}
    return result


def scenario_fsdp1(out: Path) -> dict[str, Any]:
    model = make(FSDP1GPT)
    strategy = regional(data_parallel_size=2, tensor_parallel_size=1)
    try:
        fit(model, strategy, out)
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


def torch_save_outcome(model: nn.Module) -> str:
    """What ``torch.save(model)`` of a trained FSDP2 model ends in: ``ok`` or the error."""
    try:
        torch.save(model, io.BytesIO())
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return "ok"


def scenario_devices1(out: Path) -> dict[str, Any]:
    model = make()
    trainer = fit(model, regional(), out, devices=1)
    return {**summary(model, trainer), "torch_save": torch_save_outcome(model)}


def scenario_devices1_plain(out: Path) -> dict[str, Any]:
    model = make(UserShardedGPT)
    result = summary(model, fit(model, plain(data_parallel_size=1), out, devices=1))
    return {**result, "torch_save": torch_save_outcome(model)}


def resumed(cls: type[GPTModule], strategy: Any, out: Path, distributed: bool) -> dict[str, Any]:
    """Losses of a 4-step run that saves at step 2 (an epoch's end), and of two resumes
    from step 2: from its ``ModelCheckpoint`` file, and from ``trainer.save_checkpoint``
    called after a 2-step ``fit``."""
    epoch = {"limit_train_batches": 2}
    every_2 = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2, save_top_k=-1)
    whole = make(cls)
    fit(whole, strategy(save_distributed_checkpoint=distributed), out, callbacks=[every_2], **epoch)
    at_step_2 = out / "ckpts" / "epoch=0-step=2.ckpt"
    resumed_model = make(cls)
    fit(
        resumed_model,
        strategy(save_distributed_checkpoint=distributed),
        out,
        ckpt_path=str(at_step_2),
        **epoch,
    )
    first = make(cls)
    after_fit = out / "after_fit.ckpt"
    fit(
        first, strategy(save_distributed_checkpoint=distributed), out, steps=2, **epoch
    ).save_checkpoint(after_fit)
    second = make(cls)
    fit(
        second,
        strategy(save_distributed_checkpoint=distributed),
        out,
        ckpt_path=str(after_fit),
        **epoch,
    )
    result = {
        "whole": whole.losses,
        "resumed": resumed_model.losses,
        "resumed_after_fit": second.losses,
        "params": full_params(resumed_model),
        "whole_params": full_params(whole),
        "is_dir": at_step_2.is_dir(),
    }
    if not distributed and torch.distributed.get_rank() == 0:
        checkpoint = torch.load(at_step_2, weights_only=True)
        result["keys"] = sorted(checkpoint["state_dict"])
        plain_model = make()
        plain_model.load_state_dict(checkpoint["state_dict"], strict=True)  # the plain model
        result["plain_keys"] = sorted(plain_model.state_dict())
    return result


SCENARIOS = {
    name[len("scenario_") :]: function
    for name, function in globals().items()
    if name.startswith("scenario_")
}
SCENARIOS |= {
    "resume_plain_sharded": partial(resumed, UserShardedGPT, plain, distributed=True),
    "resume_plain_full": partial(resumed, UserShardedGPT, plain, distributed=False),
    "resume_regional_sharded": partial(resumed, GPTModule, regional, distributed=True),
    "resume_regional_full": partial(resumed, GPTModule, regional, distributed=False),
}


def main(out: Path, names: list[str]) -> None:
    for name in names:
        result = SCENARIOS[name](out / name)
        torch.save(result, out / f"{name}_rank{rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
