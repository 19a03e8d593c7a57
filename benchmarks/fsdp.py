"""FSDP2 with 2 processes: first step and steady step of each way to compile, side by side.

Variants, each a Lightning ``Trainer`` run under ``torchrun --nproc_per_node=2``:

- ``eager``: plain ``ModelParallelStrategy``; ``configure_model()`` shards each block,
  then the model (Lightning's documented recipe);
- ``whole``: the same, then ``self.model.compile()`` after ``fully_shard``: whole-model
  compile as Lightning's docs apply it under FSDP2. FSDP2's hooks are dynamo-disabled,
  so the block calls in ``TinyGPT.forward``'s loop break the graph, dynamo skips that
  frame, and only the blocks' own ``forward`` frames compile (see README);
- ``whole_one_group``: ``fully_shard`` on the model only (one FSDP group, no per-block
  groups), then ``self.model.compile()``: the whole forward in one graph;
- ``regional``: ``RegionalCompileFSDPStrategy`` without ``configure_model()``: it shards
  by the region plan, then compiles the regions (its default order);
- ``regional_compile_first``: the same, compiling the regions before sharding.

Every run gets a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` shared by its two ranks.
"First step" is the time from ``fit`` start to the end of the first training step on
rank 0 (compile included); "steady step" the median of the second half of the steps.

    python benchmarks/fsdp.py                      # depth 8, 3 repeats, every variant
    python benchmarks/fsdp.py --repeats 1 --variants regional whole

Writes ``fsdp.json``, ``fsdp.md`` and ``fsdp.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import save_results  # noqa: E402

VARIANTS = ("eager", "whole", "whole_one_group", "regional", "regional_compile_first")
STEPS = 16  # default; --steps


def run_worker(variant: str, depth: int, width: int, steps: int, result_path: Path) -> None:
    """One rank of one run (under torchrun)."""
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.utils.data import DataLoader

    from benchmarks.harness import quiet_trainer
    from examples.lightning_gpt import CharChunks, CharDataModule, GPTModule, StepTimer
    from lightning_regions import RegionalCompileFSDPStrategy

    class ShardedGPT(GPTModule):
        compile_whole = False
        shard_blocks = True

        def configure_model(self) -> None:
            if isinstance(self.model, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks if self.shard_blocks else ():
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            if self.compile_whole:
                self.model.compile()

    class FullBatches(CharDataModule):
        """Whole batches only: a short last batch would recompile mid-measurement."""

        def _loader(self, tokens: torch.Tensor) -> DataLoader:
            return DataLoader(CharChunks(tokens, self.block_size), self.batch_size, drop_last=True)

    data = FullBatches(block_size=128, batch_size=8)
    config = {"vocab_size": data.vocab_size, "block_size": 128, "n_layer": depth}
    config |= {"n_head": 4, "n_embd": width}
    if variant.startswith("regional"):
        model = GPTModule(**config)
        strategy = RegionalCompileFSDPStrategy(process_group_backend="gloo")
        strategy.compile_before_shard = variant == "regional_compile_first"
    else:
        model = ShardedGPT(**config)
        model.compile_whole = variant.startswith("whole")
        model.shard_blocks = variant != "whole_one_group"
        strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
        )
    timer = StepTimer()
    trainer = quiet_trainer(strategy, steps=steps, callbacks=[timer], devices=2)
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        counters = torch._dynamo.utils.counters
        result = {
            "first_step_s": timer.time_to_first_step_seconds,
            "steady_step_ms": timer.steady_step_ms,
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "losses": model.losses,
        }
        result_path.write_text(json.dumps(result))


def run_isolated(variant: str, depth: int, width: int, steps: int) -> dict:
    """One cold 2-process run with its own empty inductor cache."""
    with tempfile.TemporaryDirectory(prefix="fsdp-cold-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "MASTER_"))}
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node=2", __file__, "--worker", variant, "--result", str(result)]
        command += ["--depth", str(depth), "--width", str(width), "--steps", str(steps)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
        return json.loads(result.read_text())


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def table(runs: dict[str, list[dict]]) -> str:
    whole = runs.get("whole")
    lines = [
        "| variant | first step (s) | vs whole | steady step (ms) | vs whole | graphs | "
        "graph breaks |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, results in runs.items():
        first, steady = median_of(results, "first_step_s"), median_of(results, "steady_step_ms")
        first_ratio = f"{first / median_of(whole, 'first_step_s'):.2f}x" if whole else ""
        steady_ratio = f"{steady / median_of(whole, 'steady_step_ms'):.2f}x" if whole else ""
        lines.append(
            f"| {variant} | {first:.1f} | {first_ratio} | {steady:.1f} | {steady_ratio} | "
            f"{median_of(results, 'graphs'):.0f} | {median_of(results, 'graph_breaks'):.0f} |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(runs)
    figure, (first_axis, steady_axis) = plt.subplots(1, 2, figsize=(9, 3.8))
    first_axis.bar(variants, [median_of(runs[v], "first_step_s") for v in variants])
    first_axis.set_ylabel("cold first step (s), median")
    steady_axis.bar(variants, [median_of(runs[v], "steady_step_ms") for v in variants])
    steady_axis.set_ylabel("steady step (ms), median")
    for axis in (first_axis, steady_axis):
        axis.set_xticks(range(len(variants)), variants, rotation=25, ha="right")
        axis.grid(axis="y", alpha=0.3)
    figure.suptitle("Tiny GPT under FSDP2, 2 processes, fresh inductor cache per run")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args.depth, args.width, args.steps, args.result)
        return

    runs: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    for repeat in range(args.repeats):
        for variant in args.variants:  # interleaved, so drift hits every variant alike
            result = run_isolated(variant, args.depth, args.width, args.steps)
            runs[variant].append(result)
            shown = {k: v for k, v in result.items() if k != "losses"}
            print(f"repeat {repeat + 1} {variant:24s} {shown}", flush=True)
    header = (
        f"Depth {args.depth}, width {args.width}, batch 8x128 tokens per rank, 2 processes "
        f"over gloo, {args.steps} steps. Medians of {args.repeats} run(s), each with a fresh "
        "inductor cache.\n\n"
    )
    save_results(args.out, "fsdp", "cpu", header + table(runs), {"runs": runs})
    plot(runs, args.out / "fsdp.png")
    print(header + table(runs))


if __name__ == "__main__":
    main()
