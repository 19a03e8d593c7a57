"""Beyond one machine: two simulated nodes of one process, each with a cold node-local
compile cache, training the depth-16 GPT (width 256, inductor on CPU, DDP over gloo).

The nodes are launched as on a cluster without a scheduler (``NODE_RANK``, loopback
``MASTER_ADDR``, one ``MASTER_PORT``, ``Trainer(num_nodes=2)``), each with its own empty
``TORCHINDUCTOR_CACHE_DIR``. Ways:

- ``torch.compile``: plain Lightning DDP with the GPT compiled whole;
- ``lightning_regions``: ``RegionalCompileDDPStrategy()``, every process compiles;
- ``one compile per job``: ``RegionalCompileDDPStrategy(compile_in_background=True)``:
  one child on global rank 0 compiles, the artifacts reach node 1 over the process group;
- ``one process, background``: the same on one node of one process, the reference for
  the job's CPU time;
- ``one node of two processes, background``: the same on one node of two processes
  (``devices=2``), where rank 1 shares the node with rank 0's child (rank 0's CPU is its
  process tree, rank 1's included);
- ``resume on fresh nodes``: the default mode resumed from a checkpoint (written by a
  4-step run) on two nodes with new, empty caches.

Per node: the first step (from the start of ``fit``), when compiled speed came (the end of
the first step that ran compiled regions: step 1 for the foreground ways), and the CPU
time of its process tree by then (its child and compile workers included); the job's CPU
time is the nodes' sum. Also each node's FX-graph cache hits and misses. Medians over
``--rounds``.

    python benchmarks/multi_node.py [--rounds 2] [--steps 12]

Writes ``multi_node.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import quiet_trainer, save_results  # noqa: E402

WAYS = (
    "torch.compile",
    "lightning_regions",
    "one compile per job",
    "one process, background",
    "one node of two processes, background",
    "resume on fresh nodes",
)
#: Simulated nodes and processes per node of each way (the others: 2 nodes of 1).
SHAPES = {"one process, background": (1, 1), "one node of two processes, background": (1, 2)}
SIZE = {"block_size": 128, "n_layer": 16, "n_head": 4, "n_embd": 256}
BATCH = 8
LAUNCH = ("LOCAL_RANK", "RANK", "GROUP_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_", "TORCHELASTIC")


def train(way: str, steps: int, out: Path, phase: str = "") -> None:
    """One process's run; writes its record to ``out/<phase>rank<i>.json``."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from benchmarks.protocol import CpuClock
    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileDDPStrategy, RegionalCompileStrategy
    from lightning_regions.compat import cache_counts

    nodes, devices = SHAPES.get(way, (2, 1))
    data = CharDataModule(block_size=SIZE["block_size"], batch_size=BATCH)
    module = GPTModule(vocab_size=data.vocab_size, **SIZE)
    strategy: Any
    if way == "torch.compile":
        module.model.compile()
        strategy = DDPStrategy(process_group_backend="gloo")
    elif way == "one process, background":
        strategy = RegionalCompileStrategy(compile_in_background=True)
    else:
        background = way in ("one compile per job", "one node of two processes, background")
        strategy = RegionalCompileDDPStrategy(
            process_group_backend="gloo", compile_in_background=background
        )

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.compiled: tuple[int, float, float, float] | None = None  # step, s, CPU s

        def on_fit_start(self, *args: object) -> None:
            self.start, self.cpu = time.perf_counter(), CpuClock()
            self.own_start = own_cpu_seconds()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            self.ends.append(time.perf_counter() - self.start)
            waiting = getattr(trainer.strategy, "background", None)
            step = len(self.ends)
            if waiting is None or (waiting.switched and step > waiting.steps_eager):
                if self.compiled is None:
                    tree, own = self.cpu.seconds(), own_cpu_seconds() - self.own_start
                    self.compiled = (step, self.ends[-1], tree, tree - own)
                if step >= max(steps, self.compiled[0] + 2):
                    trainer.should_stop = True

    clock = Clock()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)
    trainer = quiet_trainer(
        strategy,
        steps=100_000 if phase != "first" else 4,
        callbacks=[clock, checkpoints],
        devices=devices,
        num_nodes=nodes,
        enable_checkpointing=True,
        default_root_dir=out,
    )
    resume = str(out / "checkpoints" / "last.ckpt") if phase == "resumed" else None
    trainer.fit(module, data, ckpt_path=resume)
    step, at, cpu, children_cpu = clock.compiled or (0, 0.0, 0.0, 0.0)
    ends = [0.0, *clock.ends]  # ends[i]: the end of step i
    record = {
        "node": trainer.node_rank,
        "rank": trainer.global_rank,
        # the step whose optimizer step ended in the switch (the stall), background only
        "switch_step_s": ends[step - 1] - ends[step - 2] if step >= 2 else None,
        "first_step_s": clock.ends[0],
        "compiled_step": step,
        "compiled_s": at,
        "compiled_cpu_s": cpu,
        "children_cpu_s": children_cpu,  # the background child's and compile workers' part
        "cache": cache_counts(),
        "children": len(getattr(getattr(strategy, "background", None), "pids", [])),
        "threads": torch.get_num_threads(),
    }
    (out / f"{phase}rank{trainer.global_rank}.json").write_text(json.dumps(record))


def own_cpu_seconds() -> float:
    """CPU seconds of this process alone (its threads, no children)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch(way: str, steps: int, out: Path, phase: str = "") -> list[dict]:
    """Start the way's node processes (each node with its own new cache), wait for them
    and return every process's record, by global rank."""
    nodes, devices = SHAPES.get(way, (2, 1))
    port = str(free_port())
    started = []
    for node in range(nodes):
        env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH)}
        env |= {"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env["TORCHINDUCTOR_CACHE_DIR"] = str(out / f"cache-{phase}-node{node}")
        command = [sys.executable, __file__, "--child", way, "--steps", str(steps)]
        command += ["--child-out", str(out), "--phase", phase]
        started.append(subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE))
    errors = [process.communicate()[1].decode()[-2000:] for process in started]
    if any(process.returncode for process in started):
        raise RuntimeError(f"{way} failed:\n" + "\n".join(errors))
    ranks = range(nodes * devices)
    return [json.loads((out / f"{phase}rank{r}.json").read_text()) for r in ranks]


def one_round(steps: int, ways: list[str]) -> dict[str, list[dict]]:
    runs = {}
    for way in ways:
        with tempfile.TemporaryDirectory(prefix="multi-node-") as folder:
            out = Path(folder)
            if way == "resume on fresh nodes":
                launch("lightning_regions", steps, out, "first")
                runs[way] = launch("lightning_regions", steps, out, "resumed")
            else:
                runs[way] = launch(way, steps, out)
        print(f"{way}: {runs[way]}", flush=True)
    return runs


def table(rounds: list[dict[str, list[dict]]]) -> str:
    def median(way: str, rank: int, key: str) -> float:
        return statistics.median(r[way][rank][key] for r in rounds)

    def job_cpu(way: str, key: str = "compiled_cpu_s") -> float:
        return statistics.median(sum(n.get(key, 0.0) for n in r[way]) for r in rounds)

    def stall(way: str, rank: int) -> str:
        seconds = [r[way][rank].get("switch_step_s") for r in rounds]
        known = [s for s in seconds if s is not None]
        return f"{statistics.median(known):.1f}" if known else "-"

    lines = [
        "| way | node (rank) | first step s | compiled speed from step (s) | switch step s "
        "| CPU s by then | of it, child processes' | FX-graph hits / misses | children |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ways = [way for way in WAYS if way in rounds[0]]
    for way in ways:
        for rank, record in enumerate(rounds[0][way]):
            lines.append(
                f"| {way} | {record.get('node', rank)} ({rank}) | "
                f"{median(way, rank, 'first_step_s'):.1f} | "
                f"{median(way, rank, 'compiled_step'):.0f} "
                f"({median(way, rank, 'compiled_s'):.1f}) | {stall(way, rank)} | "
                f"{median(way, rank, 'compiled_cpu_s'):.0f} | "
                f"{median(way, rank, 'children_cpu_s'):.0f} | "
                f"{_hits(rounds, way, rank)} | {median(way, rank, 'children'):.0f} |"
            )
    if "one node of two processes, background" in ways:
        lines += [
            "",
            "One node of two processes: rank 0's CPU is its process tree, which holds rank 1 "
            "(Lightning starts it) and the child; rank 1's is its own.",
        ]
    if not {"one compile per job", "one process, background"} <= set(ways):
        return "\n".join(lines) + "\n"
    single, job = job_cpu("one process, background"), job_cpu("one compile per job")
    work = {
        way: job_cpu(way, "children_cpu_s")
        for way in ("one compile per job", "one process, background")
    }
    own = {way: job_cpu(way) - work[way] for way in work}
    node_1_own = statistics.median(
        r["one compile per job"][1]["compiled_cpu_s"]
        - r["one compile per job"][1]["children_cpu_s"]
        for r in rounds
    )
    lines += [
        "",
        f"- the job's CPU time to compiled speed, one compile per job: {job:.0f} s, against "
        f"{single:.0f} s for one process: {job / single:.2f}x",
        f"- of it, the compile work (the child processes': the background child, compile "
        f"workers, g++): {work['one compile per job']:.0f} s against "
        f"{work['one process, background']:.0f} s for one process: "
        f"{work['one compile per job'] / work['one process, background']:.2f}x",
        f"- of it, the training processes' own (their eager steps until the switch, on every "
        f"node, and loading the compiled regions): {own['one compile per job']:.0f} s "
        f"against {own['one process, background']:.0f} s for one process",
        f"- node 1's own CPU alone (eager steps until the switch, and loading): "
        f"{node_1_own:.0f} s, {node_1_own / single:.2f}x "
        "the one-process run's whole: while every node trains eager until the switch, the "
        "job's CPU is about the one-process run's plus that at best, however cheap the compile",
        f"- every process compiling (lightning_regions): {job_cpu('lightning_regions'):.0f} s; "
        f"whole-model torch.compile: {job_cpu('torch.compile'):.0f} s",
    ]
    return "\n".join(lines) + "\n"


def _hits(rounds: list[dict[str, list[dict]]], way: str, node: int) -> str:
    hits = statistics.median(r[way][node]["cache"]["fx_graph_hits"] for r in rounds)
    misses = statistics.median(r[way][node]["cache"]["fx_graph_misses"] for r in rounds)
    return f"{hits:.0f} / {misses:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="", help=argparse.SUPPRESS)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--name", default="multi_node", help="results file name")
    args = parser.parse_args()
    if args.child:
        train(args.child, args.steps, args.child_out, args.phase)
        return
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rounds = [one_round(args.steps, args.ways) for _ in range(args.rounds)]
    ways = "" if args.ways == list(WAYS) else " --ways " + " ".join(f"'{w}'" for w in args.ways)
    ways += "" if args.name == "multi_node" else f" --name {args.name}"
    markdown = (
        f"Depth-16 GPT (width 256, batch {BATCH} x 128 tokens), simulated nodes on one "
        f"machine (DDP over gloo, inductor on CPU), each node with a new, empty node-local "
        f"TORCHINDUCTOR_CACHE_DIR; medians of {args.rounds} round(s). Run "
        f"{started} on {os.uname().machine}, {os.cpu_count()} cores (all processes share "
        f"them), torch {__import__('torch').__version__}. Command: `python "
        f"benchmarks/multi_node.py --rounds {args.rounds}{ways}`.\n\n" + table(rounds)
    )
    save_results(args.out, args.name, "cpu", markdown, {"size": SIZE, "rounds": rounds})
    print(markdown)


if __name__ == "__main__":
    main()
