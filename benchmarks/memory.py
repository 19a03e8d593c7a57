"""Memory: what each way of compiling keeps, in a steady training step and at its peak.

Ways, each in a fresh process with a fresh compile cache, the depth-16 GPT of the
background benchmark through a real Trainer on the CPU:

- ``eager``, ``eager + AC`` (activation checkpointing: each block recomputed in backward);
- ``torch.compile``: the model compiled whole (``module.model.compile()``);
- ``accelerate``: ``accelerate.utils.compile_regions`` (the ``layers`` alias made a plain
  list first: accelerate drops it otherwise, as ``background_compile.py`` does);
- ``regional``, ``regional + AC``: ``RegionalCompileStrategy()``;
- ``background``: ``RegionalCompileStrategy(compile_in_background=True)``, measured after
  its switch.

Per way: the bytes saved for backward in one steady step (distinct storages that are not
parameters: the activations), the parameters' distinct storages and bytes (a copy of a
parameter would add one), whether the tied head is still the embedding's storage, and the
process's peak resident memory (``VmHWM``). Then the background child's own peak
(``Child.peak_rss_mb``) at width 1024 for two depths, against one
block's weights.

    python benchmarks/memory.py [--ways ...] [--child-depths 2 6] [--child-width 1024]

Writes ``memory.json`` and ``memory.md`` to ``--out`` (``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from harness import ChildFailed, in_child, quiet_trainer, save_results, to_parent  # noqa: E402

from lightning_regions.background.child import peak_rss_mb  # noqa: E402

SIZE = {"block_size": 128, "n_layer": 16, "n_head": 4, "n_embd": 256}
BATCH = 8
#: Steps before the measured one (compiles and the optimizer's state come first).
WARM_STEPS = 4
WAYS = ("eager", "eager + AC", "torch.compile", "accelerate", "regional", "regional + AC")
BACKGROUND = "background"
MIB = 2**20


def measure_way(way: str) -> dict[str, Any]:
    """One way, in this process: train ``WARM_STEPS`` steps (until the switch, for the
    background mode), then measure one step."""
    import lightning.pytorch as pl
    import torch

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileStrategy
    from lightning_regions.compat import cache_counts

    data = CharDataModule(block_size=SIZE["block_size"], batch_size=BATCH)
    module = GPTModule(
        vocab_size=data.vocab_size, **SIZE, gradient_checkpointing=way.endswith("+ AC")
    )
    strategy: Any = "auto"
    if way == "torch.compile":
        module.model.compile()
    elif way == "accelerate":
        from accelerate.utils import compile_regions

        gpt = module.model
        del gpt._modules["layers"]
        gpt.layers = list(gpt.blocks)
        module.model = compile_regions(gpt)
    elif way.startswith("regional"):
        strategy = RegionalCompileStrategy()
    elif way == BACKGROUND:
        strategy = RegionalCompileStrategy(compile_in_background=True)

    class Measure(pl.Callback):
        """Counts what one step saves for backward, from the first step that is steady:
        after ``WARM_STEPS``, and after the switch in the background mode."""

        def __init__(self) -> None:
            self.saved: dict[int, int] = {}  # storage pointer: bytes
            self.context: Any = None
            self.measured_at: int | None = None

        def steady(self, trainer: pl.Trainer) -> bool:
            background = getattr(trainer.strategy, "background", None)
            if background is not None and not background.switched:
                return False
            return trainer.global_step >= WARM_STEPS

        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            if self.measured_at is None and self.steady(trainer):
                parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}

                def pack(tensor: torch.Tensor) -> torch.Tensor:
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in parameters:
                        self.saved[storage.data_ptr()] = storage.nbytes()
                    return tensor

                self.context = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                self.context.__enter__()
                self.measured_at = trainer.global_step

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if self.context is not None:
                self.context.__exit__(None, None, None)
                self.context = None
                trainer.should_stop = True
            elif way == BACKGROUND and not self.steady(trainer):
                time.sleep(0.05)  # the eager steps leave the child its cores

    measure = Measure()
    trainer = quiet_trainer(strategy, callbacks=[measure])
    trainer.fit(module, data)
    gpt = module.model
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in gpt.parameters()
    }
    result: dict[str, Any] = {
        "way": way,
        "measured_step": measure.measured_at,
        "saved_mb": sum(measure.saved.values()) / MIB,
        "saved_storages": len(measure.saved),
        "parameter_storages": len(storages),
        "parameter_mb": sum(storages.values()) / MIB,
        "tie_one_storage": gpt.lm_head.weight.untyped_storage().data_ptr()
        == gpt.wte.weight.untyped_storage().data_ptr(),
        "peak_rss_mb": peak_rss_mb(),
        "cache_counts": cache_counts(),
    }
    background = getattr(trainer.strategy, "background", None)
    if background is not None:
        result["child_peak_rss_mb"] = max(
            (c.peak_rss_mb or 0.0 for c in background.children), default=None
        )
        result["switched"] = background.switched
    return result


def measure_child(depth: int, width: int) -> dict[str, Any]:
    """The background child's own peak at ``depth`` blocks of ``width``."""
    import lightning.pytorch as pl

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileStrategy

    data = CharDataModule(block_size=64, batch_size=4)
    module = GPTModule(
        vocab_size=data.vocab_size, block_size=64, n_layer=depth, n_head=8, n_embd=width
    )
    block_mb = sum(p.numel() * p.element_size() for p in module.model.blocks[0].parameters()) / MIB
    strategy = RegionalCompileStrategy(compile_in_background=True)

    class UntilTheSwitch(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            background = trainer.strategy.background
            if background is not None and background.switched:
                trainer.should_stop = True
            else:
                time.sleep(0.05)

    trainer = quiet_trainer(strategy, callbacks=[UntilTheSwitch()])
    trainer.fit(module, data)
    background = strategy.background
    assert background is not None
    return {
        "depth": depth,
        "width": width,
        "block_mb": block_mb,
        "child_peak_rss_mb": max((c.peak_rss_mb or 0.0 for c in background.children), default=None),
        "children": len(background.children),
        "rounds": sum(child.round for child in background.children),
        "training_peak_rss_mb": peak_rss_mb(),
    }


def ship_calls(depth: int, width: int, path: Path) -> None:
    """Write to ``path`` what the background compile ships for the GPT at ``depth``,
    ``width``: each region's structure and its one recorded training call."""
    import torch

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import find_regions
    from lightning_regions.background.shipment import pack
    from lightning_regions.background.switch import BackgroundCompile
    from lightning_regions.core.recipe import CompileRecipe
    from lightning_regions.options import RegionalOptions

    data = CharDataModule(block_size=64, batch_size=4)
    module = GPTModule(
        vocab_size=data.vocab_size, block_size=64, n_layer=depth, n_head=8, n_embd=width
    )
    plan = find_regions(module.model)
    recipe = CompileRecipe(RegionalOptions())
    background = BackgroundCompile(module.model, True, plan, recipe, 600, {})
    module.model(torch.randint(0, data.vocab_size, (4, 64)))  # the recorders see each call
    shipment = background.shipment()
    assert shipment is not None
    path.write_bytes(pack(shipment))
    background.stop()


def replay_per_call(path: Path) -> dict[str, Any]:
    """Compile and replay the shipment at ``path`` as the child does, in this process;
    its resident and peak memory after each call, in MiB."""
    import lightning_regions.background.child as child
    from lightning_regions.background.shipment import unpack

    def status(field: str) -> float:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) for line in lines if line.startswith(field)) / 1024

    after: list[dict[str, float]] = []
    replay = child.replay

    def replay_and_measure(region: Any, call: Any) -> None:
        replay(region, call)
        after.append({"rss": status("VmRSS:"), "peak": status("VmHWM:")})

    child.replay = replay_and_measure  # this benchmark's own probe around our function
    start = status("VmRSS:")
    child.compile_shipment(unpack(path.read_bytes()))
    return {"start_mb": start, "after_calls": after, "peak_mb": status("VmHWM:")}


def measure_per_call(depth: int, width: int, fixed_threshold: bool) -> dict[str, Any]:
    """``replay_per_call`` in a fresh process, with glibc's default ``malloc`` or the
    fixed threshold the background child runs with (``background.CHILD_MALLOC``)."""
    from lightning_regions.background.switch import CHILD_MALLOC

    with tempfile.TemporaryDirectory(prefix="memory-calls-") as folder:
        path = Path(folder) / "shipment.pkl"
        ship_calls(depth, width, path)
        env = {k: v for k, v in os.environ.items() if k not in CHILD_MALLOC}
        env |= CHILD_MALLOC if fixed_threshold else {}
        env |= {"TORCHINDUCTOR_CACHE_DIR": str(Path(folder) / "cache")}
        command = [sys.executable, __file__, "--replay", str(path)]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:300] if done.stderr else "?"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"depth": depth, "width": width, "fixed_threshold": fixed_threshold, **result}


def in_fresh_process(arguments: list[str]) -> dict[str, Any]:
    """Run this script on ``arguments`` in a new process with a new, empty compile cache."""
    try:
        return in_child(__file__, *arguments, fresh_cache=True)
    except ChildFailed as failed:  # a row of its own: what the child's last line said
        return {"error": str(failed).strip().splitlines()[-1][:300]}


def per_call_lines(calls: list[dict[str, Any]]) -> list[str]:
    """The per-call table: what grows per region in the child, by ``malloc`` setting."""
    if not calls:
        return []
    lines = [
        "",
        "What grows per region: the same shipment (one training call per region) compiled "
        "and replayed as the child does, in a fresh process, resident memory after each "
        "call (MiB); glibc's default `malloc` against the fixed `mmap` threshold the child "
        "runs with (`background.CHILD_MALLOC`):",
        "",
        "| depth | malloc | after each call (MiB) | peak (MiB) |",
        "|---|---|---|---|",
    ]
    for run in calls:
        if "error" in run:
            lines.append(f"| ? | failed: {run['error']} | | |")
            continue
        each = ", ".join(f"{call['rss']:.0f}" for call in run["after_calls"])
        how = "fixed 1 MiB threshold" if run["fixed_threshold"] else "glibc default"
        lines.append(f"| {run['depth']} | {how} | {each} | {run['peak_mb']:.0f} |")
    return lines


def markdown(
    rows: list[dict[str, Any]],
    children: list[dict[str, Any]],
    header: str,
    calls: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> str:
    lines = [
        "# Memory: what each way keeps in a steady step, and the background child's peak",
        "",
        header,
        "",
        "| way | saved for backward (MiB, activations) | vs eager | parameter storages | "
        "parameter MiB | tie one storage | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    eager = next((r for r in rows if r.get("way") == "eager" and "saved_mb" in r), None)
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['way']} | failed: {row['error']} | | | | | |")
            continue
        versus = f"{row['saved_mb'] / eager['saved_mb']:.4f}x" if eager else ""
        lines.append(
            f"| {row['way']} | {row['saved_mb']:.1f} | {versus} | {row['parameter_storages']} | "
            f"{row['parameter_mb']:.1f} | {row['tie_one_storage']} | {row['peak_rss_mb']:.0f} |"
        )
    lines += [
        "",
        "The background child's own peak (its `VmHWM`), width "
        f"{children[0]['width'] if children else '?'}, through the Trainer until the switch:",
        "",
        "| depth | one block's weights (MiB) | child's own peak (MiB) | children (rounds) | "
        "training process's peak (MiB) |",
        "|---|---|---|---|---|",
    ]
    for child in children:
        if "error" in child:
            lines.append(f"| ? | failed: {child['error']} | | | |")
            continue
        lines.append(
            f"| {child['depth']} | {child['block_mb']:.1f} | {child['child_peak_rss_mb']:.0f} | "
            f"{child['children']} ({child.get('rounds', '?')}) | "
            f"{child['training_peak_rss_mb']:.0f} |"
        )
    good = [c for c in children if "error" not in c]
    if len(good) >= 2:
        growth = good[-1]["child_peak_rss_mb"] - good[0]["child_peak_rss_mb"]
        verdict = "within" if growth <= good[0]["block_mb"] else "MORE than"
        lines += [
            "",
            f"From depth {good[0]['depth']} to {good[-1]['depth']} the child's peak grows by "
            f"{growth:+.0f} MiB: {verdict} one block's weights ({good[0]['block_mb']:.0f} MiB).",
        ]
    lines += per_call_lines(list(calls))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ways", nargs="+", default=[*WAYS, BACKGROUND])
    parser.add_argument("--child-depths", type=int, nargs="+", default=[2, 6])
    parser.add_argument("--child-width", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--way", help=argparse.SUPPRESS)  # one way, in a fresh process
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one child depth
    parser.add_argument("--replay", type=Path, help=argparse.SUPPRESS)  # per call, here
    args = parser.parse_args()
    if args.replay:
        print(json.dumps(replay_per_call(args.replay)))
        return
    if args.way:
        print(json.dumps(measure_way(args.way)))
        return
    if args.child:
        to_parent(measure_child(args.child, args.child_width))
        return

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for way in args.ways:
        row = {"way": way, **in_fresh_process(["--way", way])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    children = []
    for depth in args.child_depths:
        child = in_fresh_process(["--child", str(depth), "--child-width", str(args.child_width)])
        print(json.dumps(child), flush=True)
        children.append(child)
    calls = []
    for depth in args.child_depths:
        for fixed in (False, True):
            calls.append(measure_per_call(depth, args.child_width, fixed))
            print(json.dumps({k: v for k, v in calls[-1].items() if k != "after_calls"}))
    header = (
        f"Measured {started} on {os.uname().machine}, {os.cpu_count()} cores, torch "
        f"{version('torch')}, inductor on CPU, one process per way with an empty compile "
        f"cache; the GPT of `background_compile.py` ({SIZE}, batch {BATCH}), one step "
        f"measured after {WARM_STEPS} (after the switch in the background way). Command: "
        f"`python benchmarks/memory.py {' '.join(sys.argv[1:])}`."
    )
    data = {"started": started, "size": SIZE, "ways": rows, "children": children, "calls": calls}
    save_results(args.out, "memory", "cpu", markdown(rows, children, header, calls), data)


if __name__ == "__main__":
    main()
