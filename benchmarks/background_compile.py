"""The first step at eager speed: ``compile_in_background=True`` against every other way of
compiling, on the depth-16 GPT whose classes the training script defines, cold.

Each run trains the tiny GPT (``examples/tiny_gpt.py``: width 256, 16 blocks, tied head,
batch 8 x 128 tokens, a smaller last batch each epoch) with Lightning's default sanity
check and validation every 10 steps, in a fresh process with a fresh, empty
``TORCHINDUCTOR_CACHE_DIR``, inductor on this machine's device. The model's classes are
defined in the training script (``__main__``), as in Lightning's examples; three rows move
them into a function and into a notebook run by a real Jupyter kernel. The ways:

- ``eager``: plain Lightning;
- ``torch.compile``: the GPT compiled whole (``model.compile()``);
- ``torch.compile async``: the same under torch's own background compile,
  ``TORCHINDUCTOR_FX_COMPILE_MODE=async+subprocess``; on torch 2.13 it fails with
  inductor's FX-graph and AOTAutograd caches on (``NotImplementedError:
  _AsyncOutputCode``), so these rows run with both caches off; its subprocess cannot
  unpickle a graph that names a class of the training script, so it runs once more with
  the classes in a package (``, package``);
- ``accelerate``: ``accelerate.utils.compile_regions``;
- ``lightning_regions``: ``RegionalCompileStrategy()``, the default mode, and ``...
  async``, the same under torch's async mode (caches off, as above; and with the
  classes in a package);
- ``background``: ``RegionalCompileStrategy(compile_in_background=True)``, with the
  classes in the script, in a function, or in a notebook.

Figures per run: the first step (from the start of ``fit``, the sanity check included),
the wall time to steps 1, 10 and 100, the longest step after the first, the switch stall
(the background step in which the regions compiled in place, less the median eager step),
the first validation after the switch (or, without one, after step 1) and the last, and
the CPU time of the job (the training process and every process under it, compile
workers and the background child included). Each run goes to at least step 100 (the
background ones to 10 steps after their switch). Rounds interleave the ways in a rotating
order; figures are medians over rounds (``protocol.py``); other programs' load is named.

With ``--rerun``, each way first trains once, untimed, on the same
``TORCHINDUCTOR_CACHE_DIR`` (a sweep's earlier trial, or yesterday's run), and the figures
are those of its second run: what a rerun costs once torch's caches hold the compile.

    python benchmarks/background_compile.py [--rounds 3] [--steps 100] [--rerun]

Writes ``background_compile.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import quiet_trainer, save_results  # noqa: E402
from benchmarks.protocol import CpuClock, OtherLoad, earliest_with_extra_cpu  # noqa: E402
from benchmarks.repeated_runs import warm_torchs_own_files  # noqa: E402

#: way: (strategy, whole-model compile, torch's async mode, where the classes are)
WAYS: dict[str, tuple[str, bool, bool, str]] = {
    "eager": ("auto", False, False, "script"),
    "torch.compile": ("auto", True, False, "script"),
    "torch.compile async": ("auto", True, True, "script"),
    "torch.compile async, package": ("auto", True, True, "package"),
    "accelerate": ("accelerate", False, False, "script"),
    "lightning_regions": ("regional", False, False, "script"),
    "lightning_regions, always compiled": ("always compiled", False, False, "script"),
    "lightning_regions async": ("regional", False, True, "script"),
    "lightning_regions async, package": ("regional", False, True, "package"),
    "background": ("background", False, False, "script"),
    "background, function": ("background", False, False, "function"),
    "background, notebook": ("background", False, False, "notebook"),
}
ASYNC_ENV = {
    "TORCHINDUCTOR_FX_COMPILE_MODE": "async+subprocess",
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
}
SIZE = {"block_size": 128, "n_layer": 16, "n_head": 4, "n_embd": 256}
BATCH = 8
MARKS = (1, 10, 100, 1000)
VALIDATE_EVERY = 10
AFTER_SWITCH = 10
TINY_GPT = ROOT / "examples" / "tiny_gpt.py"


def model_classes(where: str) -> tuple[type, type]:
    """``(GPTConfig, TinyGPT)`` defined as the user's code defines them: in the training
    script's ``__main__``, inside a function there, or in an importable package."""
    if where == "package":
        from examples.tiny_gpt import GPTConfig, TinyGPT

        return GPTConfig, TinyGPT
    source = TINY_GPT.read_text().replace("from __future__ import annotations\n", "")
    if where == "script":
        namespace = vars(sys.modules["__main__"])
        exec(compile(source, str(TINY_GPT), "exec"), namespace)
        return namespace["GPTConfig"], namespace["TinyGPT"]
    body = textwrap.indent(source, "    ")
    function = f"def define():\n{body}\n    return GPTConfig, TinyGPT\n"
    namespace = {"__name__": "__main__"}
    exec(compile(function, str(TINY_GPT), "exec"), namespace)
    return namespace["define"]()


def train(
    way: str, classes: tuple[type, type], steps: int, device: str, size: dict | None = None
) -> dict[str, Any]:
    """One run in this process; what ``figures`` reads. ``size``: the GPT's, else ``SIZE``."""
    import lightning.pytorch as pl
    import torch

    from examples.lightning_gpt import CharDataModule, GPTModule
    from lightning_regions import RegionalCompileStrategy

    clock = CpuClock()
    kind, whole, _, _ = WAYS[way]
    config_class, model_class = classes
    size = size or SIZE
    data = CharDataModule(block_size=size["block_size"], batch_size=BATCH)
    module = GPTModule(vocab_size=data.vocab_size, **size)
    torch.manual_seed(0)
    module.model = model_class(config_class(data.vocab_size, **size))
    strategy: Any = "auto"
    if whole:
        module.model.compile()
    elif kind == "accelerate":
        from accelerate.utils import compile_regions

        gpt = module.model
        del gpt._modules["layers"]  # accelerate drops an alias: a plain list instead
        gpt.layers = list(gpt.blocks)
        module.model = compile_regions(gpt)
    elif kind == "regional":
        strategy = RegionalCompileStrategy()
    elif kind == "always compiled":
        strategy = RegionalCompileStrategy(keep_if_faster=False)
    elif kind == "background":
        strategy = RegionalCompileStrategy(compile_in_background=True)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.durations: list[float] = []
            self.validations: list[tuple[int, float]] = []  # (after step, seconds)
            self.decided_at: int | None = None  # the step whose end keep_if_faster decided

        def on_fit_start(self, *args: object) -> None:
            self.start = time.perf_counter()

        def on_train_batch_start(self, *args: object) -> None:
            self.began = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            now = time.perf_counter()
            self.ends.append(now - self.start)
            self.durations.append(now - self.began)
            payoff = getattr(trainer.strategy, "payoff", None)
            if self.decided_at is None and payoff is not None and payoff.decision is not None:
                self.decided_at = len(self.ends)
            background = getattr(trainer.strategy, "background", None)
            if len(self.ends) >= steps and (
                background is None
                or (background.switched and len(self.ends) >= background.steps_eager + 11)
            ):
                trainer.should_stop = True

        def on_validation_start(self, *args: object) -> None:
            self.validation_began = time.perf_counter()

        def on_validation_end(self, *args: object) -> None:
            seconds = time.perf_counter() - self.validation_began
            self.validations.append((len(self.ends), seconds))

    timer = Clock()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(
            strategy,
            steps=100_000,
            callbacks=[timer],
            device=device,
            max_epochs=-1,
            limit_val_batches=None,
            val_check_interval=VALIDATE_EVERY,
            check_val_every_n_epoch=None,
        ).fit(module, data)
    record: dict[str, Any] = {
        "ends": timer.ends,
        "durations": timer.durations,
        "validations": timer.validations,
        "losses": module.losses,
        "cpu_seconds": clock.seconds(),
        "warnings": sorted({w.category.__name__ for w in caught if "regions" in str(w.category)}),
    }
    payoff = getattr(strategy, "payoff", None)
    if payoff is not None and payoff.decision is not None:
        record["payoff"] = str(payoff.decision)
        record["payoff_step"] = timer.decided_at
    background = getattr(strategy, "background", None)
    if background is not None:
        record["steps_eager"] = background.steps_eager
        record["switched"] = background.switched
        record["children"] = len(background.children)
        record["child_seconds"] = background.child_seconds
    from lightning_regions.compat import cache_counts

    record["cache"] = cache_counts()
    return record


NOTEBOOK_CELLS = (
    "import json, os, sys\nsys.path.insert(0, os.environ['BENCH_ROOT'])",
    None,  # tiny_gpt.py's source: the classes, defined in the notebook
    "from benchmarks.background_compile import train\n"
    "record = train(os.environ['BENCH_WAY'], (GPTConfig, TinyGPT), "
    "int(os.environ['BENCH_STEPS']), os.environ['BENCH_DEVICE'])\n"
    "open(os.environ['BENCH_OUT'], 'w').write(json.dumps(record))",
)


def run_notebook(way: str, steps: int, device: str) -> dict[str, Any]:
    """``train`` from a notebook whose cells define the classes, through a real kernel."""
    import nbformat
    from nbclient import NotebookClient

    source = TINY_GPT.read_text().replace("from __future__ import annotations\n", "")
    cells = [nbformat.v4.new_code_cell(cell or source) for cell in NOTEBOOK_CELLS]
    notebook = nbformat.v4.new_notebook(cells=cells)
    with tempfile.TemporaryDirectory(prefix="background-bench-") as folder:
        out = Path(folder) / "record.json"
        env = dict(os.environ, BENCH_ROOT=str(ROOT), BENCH_WAY=way, BENCH_OUT=str(out))
        env |= {"BENCH_STEPS": str(steps), "BENCH_DEVICE": device}
        NotebookClient(notebook, timeout=3600, kernel_name="python3").execute(env=env)
        return json.loads(out.read_text())


def run_fresh(
    way: str, steps: int, device: str, cache: str, size: dict | None = None
) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    if WAYS[way][2]:
        env |= ASYNC_ENV
    command = [sys.executable, __file__, "--child", way, "--steps", str(steps)]
    size = size or SIZE
    command += ["--depth", str(size["n_layer"]), "--width", str(size["n_embd"])]
    done = subprocess.run(
        [*command, "--device", device], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def figures(record: dict[str, Any]) -> dict[str, float]:
    """The figures of one run (see the module docstring)."""
    if "error" in record:
        return {}
    ends, durations = record["ends"], record["durations"]
    out = {f"step_{n}": ends[n - 1] for n in MARKS if len(ends) >= n}
    out["cpu"] = record["cpu_seconds"]
    out["wall"] = ends[-1]
    out["longest_later"] = max(durations[1:])
    # steps 1..k ran eager; step k's optimizer step ended in the switch (the regions
    # compiled in place, warm); step k + 1 is the first compiled one
    switched = record.get("steps_eager")
    if switched is not None and len(durations) > switched:
        eager = statistics.median(durations[1 : switched - 1]) if switched > 2 else durations[0]
        out["stall"] = durations[switched - 1] - eager
        out["switch_step"] = float(switched + 1)
        out["longest_after_switch"] = max(durations[switched:], default=0.0)
    after = switched or 1
    later = [seconds for step, seconds in record["validations"] if step > after]
    if later:
        out["first_validation"] = later[0]
        out["last_validation"] = later[-1]
    return out


def table(rounds: list[dict[str, dict]], ways: list[str]) -> str:
    def median(way: str, key: str) -> float | None:
        values = [figures(r[way]).get(key) for r in rounds if way in r]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def cell(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| way | first step s | to step 10 s | to step 100 s | to step 1000 s | "
        "longest later step s | switch stall s | first compiled step | "
        "1st validation after switch / last s | CPU s of the job |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for way in ways:
        errors = [r[way]["error"] for r in rounds if "error" in r.get(way, {})]
        if errors:
            lines.append(f"| {way} | failed: {errors[0][:120]} | | | | | | | | |")
            continue
        validation = f"{cell(median(way, 'first_validation'), 2)} / "
        validation += cell(median(way, "last_validation"), 2)
        lines.append(
            f"| {way} | {cell(median(way, 'step_1'))} | {cell(median(way, 'step_10'))} | "
            f"{cell(median(way, 'step_100'))} | {cell(median(way, 'step_1000'))} | "
            f"{cell(median(way, 'longest_later'))} | "
            f"{cell(median(way, 'stall'))} | {cell(median(way, 'switch_step'), 0)} | "
            f"{validation} | {cell(median(way, 'cpu'), 0)} |"
        )
    lines += ["", *verdicts(rounds, ways, median)]
    return "\n".join(lines) + "\n"


def verdicts(rounds: list[dict[str, dict]], ways: list[str], median: Any) -> list[str]:
    """The issue's Done-when checks, and for which N each way reaches step N first."""
    out = []
    eager, default = median("eager", "step_1"), median("lightning_regions", "step_1")
    warm = max(
        (median(way, "last_validation") or 0.0 for way in ("lightning_regions", "eager")),
        default=0.0,
    )
    for way in [w for w in ways if w.startswith("background")]:
        first, longest = median(way, "step_1"), median(way, "longest_later")
        validation = median(way, "first_validation")
        if None in (eager, default, first, longest, validation):
            continue
        checks = [
            ("first step", first, 1.5 * eager + 1, "1.5 x eager's + 1 s"),
            ("longest step after the first", longest, 0.25 * default, "0.25 x the default's first"),
            ("first validation after the switch", validation, 1.5 * warm, "1.5 x a warm one"),
        ]
        for name, value, limit, rule in checks:
            verdict = "met" if value <= limit else "NOT met"
            out.append(f"- {way}: {name} {value:.2f} s against {rule} = {limit:.2f} s: {verdict}")
        warned = sorted({w for r in rounds for w in r[way].get("warnings", [])})
        children = sorted({r[way].get("children") for r in rounds})
        out.append(f"- {way}: warnings of ours: {warned or 'none'}; children per run: {children}")
    best_1000 = [median(w, "step_1000") for w in ("eager", "lightning_regions")]
    for way in [w for w in ways if w.startswith("background")]:
        ten, eager_ten, thousand = median(way, "step_10"), median("eager", "step_10"), None
        if ten is not None and eager_ten is not None:
            limit = 1.5 * eager_ten + 1
            verdict = "met" if ten <= limit else "NOT met"
            out.append(
                f"- {way}: step 10 at {ten:.1f} s against 1.5 x eager's + 1 s = {limit:.1f} s: "
                f"{verdict}"
            )
        thousand = median(way, "step_1000")
        if thousand is not None and None not in best_1000:
            limit = 1.05 * min(best_1000)
            verdict = "met" if thousand <= limit else "NOT met"
            out.append(
                f"- {way}: step 1000 at {thousand:.1f} s against 1.05 x the best of eager and "
                f"the default mode = {limit:.1f} s: {verdict}"
            )
    for way in [w for w in ways if w != "eager"]:
        out += compile_cost(way, median, os.cpu_count() or 1)
    for way in ways:
        decisions = sorted({r[way].get("payoff", "") for r in rounds if way in r} - {""})
        if decisions:
            out.append(f"- {way}: keep_if_faster decided: {' | '.join(decisions)}")
    for n in MARKS:
        reached = {w: median(w, f"step_{n}") for w in ways}
        known = {w: v for w, v in reached.items() if v is not None}
        if known:
            best = min(known, key=lambda w: known[w])
            out.append(f"- step {n} is reached first by {best} ({known[best]:.1f} s)")
    return out


def compile_cost(way: str, median: Any, cores: int) -> list[str]:
    """What ``way``'s job spent beyond eager's in CPU time (its compile, mostly), and the
    earliest any way spending that could reach step 1000 on ``cores`` cores
    (``protocol.earliest_with_extra_cpu``)."""
    eager_cpu, eager_wall, eager_1000 = (median("eager", k) for k in ("cpu", "wall", "step_1000"))
    cpu, thousand = median(way, "cpu"), median(way, "step_1000")
    if None in (eager_cpu, eager_wall, eager_1000, cpu, thousand):
        return []
    extra = cpu - eager_cpu
    bound = earliest_with_extra_cpu(eager_cpu, eager_wall, eager_1000, extra, cores)
    return [
        f"- {way}: the job's CPU time beyond eager's {extra:.0f} s; eager kept "
        f"{eager_cpu / eager_wall:.2f} of {cores} cores busy, so no way spending that reaches "
        f"step 1000 before {bound:.1f} s ({bound / eager_1000:.2f} x eager's): this way "
        f"{thousand / bound:.2f} x that bound"
    ]


def plot(rounds: list[dict[str, dict]], ways: list[str], path: Path, title: str) -> None:
    """Time to step N against N, log scales, one line per way (the first round's run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for way in ways:
        ends = rounds[0].get(way, {}).get("ends")
        if ends:
            axis.plot(range(1, len(ends) + 1), ends, label=way)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("step N")
    axis.set_ylabel("seconds from the start of fit to the end of step N")
    axis.set_title(title)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--depth", type=int, default=SIZE["n_layer"])
    parser.add_argument("--width", type=int, default=SIZE["n_embd"])
    parser.add_argument("--name", default="background_compile", help="results file name")
    parser.add_argument(
        "--rerun", action="store_true", help="time each way's second run on its cache"
    )
    parser.add_argument("--child", choices=list(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = SIZE | {"n_layer": args.depth, "n_embd": args.width}
    if args.child:
        where = WAYS[args.child][3]
        if where == "notebook":
            record = run_notebook(args.child, args.steps, args.device)
        else:
            record = train(args.child, model_classes(where), args.steps, args.device, size)
        print(json.dumps(record))
        return

    warm_torchs_own_files()
    load = OtherLoad()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        order = args.ways[index % len(args.ways) :] + args.ways[: index % len(args.ways)]
        runs = {}
        with tempfile.TemporaryDirectory(prefix="background-bench-") as tmp:
            for way in order:
                cache = os.path.join(tmp, f"cache-{way.replace(' ', '_')}")
                if args.rerun:
                    earlier = run_fresh(way, args.steps, args.device, cache, size)
                    print(f"round {index + 1}: {way}, earlier run: {figures(earlier)}")
                runs[way] = run_fresh(way, args.steps, args.device, cache, size)
                print(f"round {index + 1}: {way}: {figures(runs[way])}", flush=True)
        rounds.append(runs)
    busy = load.cores()
    shape = f"depth {args.depth}, width {args.width}"
    starts = (
        "reruns: each way's second run in a fresh process, its first run's "
        "TORCHINDUCTOR_CACHE_DIR kept"
        if args.rerun
        else "cold starts: each run in a fresh process with a fresh TORCHINDUCTOR_CACHE_DIR"
    )
    markdown = (
        f"Tiny GPT ({shape}, tied head, batch {BATCH} x 128 tokens), classes in the training "
        f"script, inductor on {args.device}, {starts}, Lightning's sanity check, validation every "
        f"{VALIDATE_EVERY} steps, at least {args.steps} steps; medians of {args.rounds} "
        f"interleaved round(s), started {started}; other programs used "
        f"{busy if busy is None else round(busy, 2)} cores on average. Time to step N: "
        f"`{args.name}.png`.\n\n" + table(rounds, args.ways)
    )
    stem = save_results(args.out, args.name, args.device, markdown, {"rounds": rounds})
    plot(rounds, args.ways, stem.with_suffix(".png"), f"Time to step N, {shape}, {args.device}")
    print(markdown)


if __name__ == "__main__":
    main()
