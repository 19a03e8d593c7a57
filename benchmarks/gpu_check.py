"""Every GPU-only claim, checked in one command on a lent GPU: ``make gpu-check``.

Runs with the GPU machine's own ``python3`` and the package from this source tree
(``PYTHONPATH=.``), nothing to install or download (DeepSpeed, which that machine lacks,
can be carried: docs/testing.md). Six parts, each in its own process with its own
timeout and a fresh, empty ``TORCHINDUCTOR_CACHE_DIR``, so a slow or failing part loses
nothing of the others:

- ``cuda_tests``: everything in ``tests/test_cuda.py`` (``pytest -m cuda``; DeepSpeed's
  stages when it is importable), one verdict per test;
- ``cold_starts``: the tiny GPT's cold first step at depth 16 (width 512, batch 8x128,
  forward and backward): eager, whole-model ``torch.compile``, accelerate, ours, ours
  nested and torch's ``nested_compile_region`` by hand (``compile_time.py``);
- ``steady_steps``: the steady step of the same six at depth 16, and of ours after the
  keep-or-revert gate decided, interleaved rounds (``steady_step.py``, ``protocol.py``);
- ``cuda_graphs``: ``mode="reduce-overhead"`` (CUDA graphs), ours against whole-model
  ``torch.compile`` and against the default mode, with inductor's CUDA-graph skips;
- ``warm_resume``: a resume from checkpoint artifacts into an empty cache, against cold;
- ``background``: ``compile_in_background=True`` against eager and the default mode
  (first step, time to steps 10 and 100, the switch's stall, children per run;
  ``background_compile.py``);
- ``real_models``: transformers' GPT-2 small and a Llama-3.2-1B-shaped decoder from their
  configs (random weights, no download), bf16 autocast, a batch that makes the step
  GPU-bound, a plain AdamW loop: eager, ours (``compile_regions(inplace=True)``),
  whole-model ``torch.compile`` and accelerate; first step, steady step, time to steps 10
  and 100. Each finished run is kept if the part runs out of time.

The parts run in two lanes side by side, the machine's cores split between them (each
part's affinity, ``OMP_NUM_THREADS`` and inductor's compile threads): the timings
(cold starts, CUDA graphs, warm resume, steady steps) in one, the checks (the cuda tests,
then the background mode) in the other. The results name what ran beside what. Sizes and
timeouts keep the whole within 9 minutes of wall time on one H200 (docs/testing.md has
the estimate).

Writes ``gpu_check.{json,md}`` to ``--out`` (commit, date, GPU, torch, lanes) and prints
one verdict line per claim (``PASS``, ``FAIL``, ``SKIP`` or ``ERROR``). Without a GPU it
says so and exits with status 2. ``--device cpu`` runs every part small on the CPU
(``gpu_check_cpu.{json,md}``), to check the script itself before a GPU session.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
NO_GPU = 2
COLD_VARIANTS = ("eager", "whole", "accelerate", "regional_inplace", "nested", "torch_nested")
#: Each part's sizes on a GPU and, small, on a CPU (``--device cpu``).
SIZES = {
    "cuda": {"depth": 16, "width": 512, "graphs": (4, 256), "rounds": 30, "background": 16},
    "cpu": {"depth": 2, "width": 32, "graphs": (2, 32), "rounds": 5, "background": 2},
}
#: part: (lane, timeout in seconds on a GPU, on this project's 2-core CPU)
PARTS: dict[str, tuple[str, int, int]] = {
    "cold_starts": ("timings", 200, 240),
    "cuda_graphs": ("timings", 120, 150),
    "warm_resume": ("timings", 90, 120),
    "steady_steps": ("timings", 120, 150),
    "cuda_tests": ("checks", 200, 120),
    "background": ("checks", 120, 420),
    "real_models": ("checks", 220, 240),
}
#: The real models: transformers config, batch and sequence length on a GPU.
REAL_MODELS = {
    "gpt2_small": ("GPT2Config", {"n_layer": 12, "n_embd": 768, "n_head": 12}, 8, 1024),
    "llama_1b": (
        "LlamaConfig",
        {
            "num_hidden_layers": 16,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
        },
        4,
        1024,
    ),
}
#: The same, small, on a CPU (--device cpu).
SMALL_REAL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "num_hidden_layers": 2}
SMALL_REAL |= {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
SMALL_REAL |= {"num_key_value_heads": 2, "vocab_size": 64}
#: The ways, most telling first (a part cut by its timeout keeps the first): in a plain
#: loop, eager, ours (``compile_regions``), whole-model and accelerate, and ours with CUDA
#: graphs; under Lightning (``precision="bf16-mixed"``), eager, our strategy (which keeps
#: the regions compiled or reverts them on these steps) and its background mode.
REAL_WAYS = (
    "eager",
    "ours",
    "lightning_eager",
    "strategy",
    "whole",
    "background",
    "ours_cudagraphs",
    "accelerate",
)
#: The real models' steady step is timed from this step to the last: after the strategy's
#: latest keep-or-revert decision (step 54: its CUDA-graphs candidate's phase after the
#: compiled-vs-eager one, each timing all its windows; tests/test_gpu_check.py checks it
#: against ``lightning_regions.gate.gate``), so no way's steady step holds a gate's turns.
STEADY_FROM = 60
REAL_STEPS = (1, 10, STEADY_FROM, 100)
RESUME_MODEL = ["--n-layer", "4", "--n-embd", "256", "--block-size", "64"]


def gpu_or_exit() -> str:
    """The GPU's name, or a clear message and exit status 2 (no traceback)."""
    try:
        import torch
    except ImportError:
        print(
            f"gpu-check: no GPU check here: {sys.executable} cannot import torch. "
            "On the GPU machine run `make gpu-check` with its own python3."
        )
        sys.exit(NO_GPU)
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA GPU is present (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}). This check runs every GPU-only claim on a GPU; "
            "run `make gpu-check` on a machine with one, or `python benchmarks/gpu_check.py "
            "--device cpu` to check the script itself, small."
        )
        sys.exit(NO_GPU)
    return torch.cuda.get_device_name()


# --- the parts, each run in its own process (--part) ---------------------------------------


def cuda_tests(device: str, size: dict) -> dict:
    """``pytest -m cuda tests/test_cuda.py``: each test's outcome, from its JUnit report."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-tests-") as folder:
        report = Path(folder) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-q"]
        command += ["-p", "no:cacheprovider", f"--junitxml={report}"]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if not report.exists():
            return {"error": (done.stdout + done.stderr)[-800:]}
        tests = {}
        for case in ElementTree.parse(report).iter("testcase"):
            outcome, detail = "passed", ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    outcome = "skipped" if kind == "skipped" else "failed"
                    detail = (found.get("message") or "")[:300]
            tests[case.get("name", "?")] = {"outcome": outcome, "detail": detail}
    return {"tests": tests, "tail": done.stdout[-600:]}


def cold_starts(device: str, size: dict) -> dict:
    from compile_time import run_isolated

    return {v: run_isolated(v, size["depth"], size["width"], device) for v in COLD_VARIANTS}


def steady_steps(device: str, size: dict) -> dict:
    from steady_step import VARIANTS, run_isolated

    settings = argparse.Namespace(
        width=size["width"], rounds=size["rounds"], steps=3, device=device, variants=VARIANTS
    )
    return run_isolated(size["depth"], 1, settings)


def cuda_graphs(device: str, size: dict) -> dict:
    from compile_time import run_isolated

    depth, width = size["graphs"]
    variants = ("regional_inplace", "regional_cudagraphs", "whole", "whole_cudagraphs")
    return {v: run_isolated(v, depth, width, device) for v in variants}


def warm_resume(device: str, size: dict) -> dict:
    from warm_start import accelerator, start

    with tempfile.TemporaryDirectory(prefix="gpu-check-warm-") as tmp:
        root, model = Path(tmp), [*RESUME_MODEL, "--accelerator", accelerator(device)]
        cold = start(model, root / "a", root / "cache", 2, None)
        artifacts = start(model, root / "b", root / "empty", 3, root / "a" / "last.ckpt")
    return {"cold": cold, "checkpoint_artifacts": artifacts}


def background(device: str, size: dict) -> dict:
    from background_compile import SIZE, figures, run_fresh

    gpt = SIZE | {"n_layer": size["background"], "n_embd": 256 if device == "cuda" else 32}
    out = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-background-") as tmp:
        for way in ("eager", "lightning_regions", "background"):
            record = run_fresh(way, 100, device, os.path.join(tmp, way), gpt)
            out[way] = {**figures(record), "children": record.get("children")}
            out[way] |= {"error": record["error"]} if "error" in record else {}
    return out


def real_models(device: str, size: dict, out: Path | None = None) -> dict:
    """Each (model, way) in its own process, fresh caches; kept in ``out`` as it goes."""
    results: dict[str, dict] = {}
    for way in REAL_WAYS:
        for model in REAL_MODELS:
            with tempfile.TemporaryDirectory(prefix="gpu-check-real-") as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
                command = [sys.executable, __file__, "--real", model, way, "--device", device]
                done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                figures = {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
            else:
                figures = json.loads(done.stdout.strip().splitlines()[-1])
            results.setdefault(model, {})[way] = figures
            if out is not None:
                out.write_text(json.dumps({**results, "partial": True}))
    return results


def real_run(model: str, way: str, device: str) -> dict:
    """One (model, way): build, then train ``REAL_STEPS[-1]`` steps in bf16 autocast, with a
    synchronize only at the steps ``REAL_STEPS`` names."""
    import torch
    import transformers

    from lightning_regions import compile_regions
    from lightning_regions.core.kv_cache import disable_kv_cache_unless_asked

    config_name, config, batch, length = REAL_MODELS[model]
    if device != "cuda":
        names = getattr(transformers, config_name)().to_dict()
        config = {k: v for k, v in SMALL_REAL.items() if k in names} | {"vocab_size": 64}
        batch, length = 2, 16
    torch.manual_seed(0)
    built = getattr(transformers, config_name)(**config)
    net = transformers.AutoModelForCausalLM.from_config(built).to(device).train()
    ids = torch.randint(
        0, built.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0)
    )
    if way in ("lightning_eager", "strategy", "background"):
        return lightning_run(net, ids, way, device)
    if way == "whole":
        net = torch.compile(net)
    elif way == "accelerate":
        from accelerate.utils import compile_regions as accelerate_compile_regions

        net = accelerate_compile_regions(net)
    elif way in ("ours", "ours_cudagraphs"):
        disable_kv_cache_unless_asked(net)  # as the strategies do
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
        mode = "reduce-overhead" if way == "ours_cudagraphs" else None
        compile_regions(net, inplace=True, mode=mode)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ids = ids.to(device)
    marks = {}
    start = time.perf_counter()
    for step in range(1, REAL_STEPS[-1] + 1):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step in REAL_STEPS:
            if device == "cuda":
                torch.cuda.synchronize()
            marks[step] = time.perf_counter() - start
    return {**real_figures(marks), "loss": loss.item()}


def real_figures(marks: dict[int, float]) -> dict[str, Any]:
    """First step, steps 10 and 100, the steady step (steps ``STEADY_FROM``-100) and
    step 1,000 projected from it, from the seconds at the ends of the steps ``REAL_STEPS``
    names."""
    steady = (marks[100] - marks[STEADY_FROM]) / (100 - STEADY_FROM)
    return {
        "first_step_s": marks[1],
        "step_10_s": marks[10],
        "step_100_s": marks[100],
        "steady_step_ms": 1000 * steady,
        "step_1000_projected_s": marks[100] + 900 * steady,
        "marks": marks,
    }


def lightning_run(net: Any, ids: Any, way: str, device: str) -> dict:
    """``REAL_STEPS[-1]`` steps of ``net`` under a Trainer in ``bf16-mixed``: plain, our
    strategy, or its background mode; timed as ``real_run`` times its loop."""
    import lightning.pytorch as pl
    import torch
    from harness import quiet_trainer

    from lightning_regions import RegionalCompileStrategy

    class CausalLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Marks(pl.Callback):
        def __init__(self) -> None:
            self.marks: dict[int, float] = {}

        def on_fit_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step in REAL_STEPS:
                if device == "cuda":
                    torch.cuda.synchronize()
                self.marks[trainer.global_step] = time.perf_counter() - self.start

    strategy: Any = "auto"
    if way != "lightning_eager":
        strategy = RegionalCompileStrategy(compile_in_background=way == "background")
    marks = Marks()
    trainer = quiet_trainer(
        strategy, steps=REAL_STEPS[-1], callbacks=[marks], device=device, precision="bf16-mixed"
    )
    batches = torch.utils.data.DataLoader([ids] * REAL_STEPS[-1], batch_size=None)
    trainer.fit(CausalLM(), batches)
    figures: dict[str, Any] = dict(real_figures(marks.marks))
    payoff = getattr(strategy, "payoff", None)
    if payoff is not None and payoff.decision is not None:
        figures["decision"] = str(payoff.decision)
    background = getattr(strategy, "background", None)
    if background is not None:
        figures["children"] = len(background.children)
        figures["switch_step"] = background.steps_eager + 1 if background.switched else None
    return figures


RUNNERS = {
    "cuda_tests": cuda_tests,
    "cold_starts": cold_starts,
    "steady_steps": steady_steps,
    "cuda_graphs": cuda_graphs,
    "warm_resume": warm_resume,
    "background": background,
    "real_models": real_models,
}


def run_part(name: str, device: str, cores: list[int], out: Path) -> None:
    """In the part's own process: its share of the cores, then its figures to ``out``."""
    os.sched_setaffinity(0, cores)
    try:
        if name == "real_models":  # keeps what finished in out as it goes
            result = real_models(device, SIZES[device], out)
        else:
            result = RUNNERS[name](device, SIZES[device])
    except Exception as error:  # a broken part is a result too: ERROR, with its cause
        result = {"error": f"{type(error).__name__}: {str(error)[-800:]}"}
    out.write_text(json.dumps(result))


# --- the lanes ----------------------------------------------------------------------------


def run_lanes(device: str) -> dict[str, dict]:
    """Every part in its lane, both lanes side by side; each part's result and times."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    shares = {"timings": cores[:half], "checks": cores[half:] or cores[:half]}
    results: dict[str, dict] = {}
    started = time.perf_counter()

    def lane(which: str) -> None:
        for name, (lane_name, gpu_timeout, cpu_timeout) in PARTS.items():
            if lane_name != which:
                continue
            timeout = gpu_timeout if device == "cuda" else cpu_timeout
            share = shares[which]
            begin = time.perf_counter() - started
            with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as folder:
                out = Path(folder) / "result.json"
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(folder) / "cache"))
                env |= {"OMP_NUM_THREADS": str(len(share))}
                env |= {"TORCHINDUCTOR_COMPILE_THREADS": str(len(share))}
                command = [sys.executable, __file__, "--part", name, "--device", device]
                command += ["--cores", ",".join(map(str, share)), "--part-out", str(out)]
                try:
                    subprocess.run(command, cwd=ROOT, env=env, timeout=timeout, check=False)
                    result = json.loads(out.read_text()) if out.exists() else {"error": "no result"}
                except subprocess.TimeoutExpired:
                    kept = json.loads(out.read_text()) if out.exists() else {}
                    result = {**kept, "error": f"timed out after {timeout} s"}
            end = time.perf_counter() - started
            results[name] = {"result": result, "lane": which, "start_s": begin, "end_s": end}
            print(f"[{end:6.1f} s] {name} ({which}, {end - begin:.0f} s)", flush=True)

    threads = [threading.Thread(target=lane, args=(which,)) for which in ("timings", "checks")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for part in results.values():  # what ran beside what
        part["beside"] = [
            other
            for other, them in results.items()
            if them["lane"] != part["lane"]
            and them["start_s"] < part["end_s"]
            and part["start_s"] < them["end_s"]
        ]
    return results


# --- verdicts -----------------------------------------------------------------------------


def verdict(ok: bool | None, claim: str, figures: str) -> str:
    word = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
    return f"{word} {claim}: {figures}"


def verdicts(parts: dict[str, dict]) -> list[str]:
    """One line per claim, from each part's result."""
    lines = []
    for name, part in parts.items():
        result = part["result"]
        if "error" in result:
            lines.append(f"ERROR {name}: {result['error'][-300:]}")
            if not result.get("partial"):
                continue
        lines += CLAIMS[name](result)
    return lines


def cuda_test_claims(result: dict) -> list[str]:
    lines = []
    for test, record in result["tests"].items():
        ok = {"passed": True, "failed": False}.get(record["outcome"])
        lines.append(verdict(ok, f"cuda test {test}", record["outcome"] + " " + record["detail"]))
    return lines or [verdict(False, "cuda tests", "none collected: " + result["tail"])]


def cold_start_claims(rows: dict) -> list[str]:
    ours, whole, nested = rows["regional_inplace"], rows["whole"], rows["nested"]
    by_hand, accelerate = rows["torch_nested"], rows["accelerate"]
    ratio = ours["first_step_s"] / whole["first_step_s"]
    nested_ratio = nested["first_step_s"] / by_hand["first_step_s"]
    errors = max(rows[v]["gradient_error"] for v in ("regional_inplace", "nested"))
    return [
        verdict(
            ratio < 1,
            "regional first step sooner than whole-model torch.compile's",
            f"{ours['first_step_s']:.1f} s vs {whole['first_step_s']:.1f} s ({ratio:.2f}x); "
            f"accelerate {accelerate['first_step_s']:.1f} s",
        ),
        verdict(
            nested_ratio <= 1.05,
            "nested first step within 1.05x torch's nested_compile_region by hand",
            f"{nested['first_step_s']:.1f} s vs {by_hand['first_step_s']:.1f} s "
            f"({nested_ratio:.2f}x); dynamo {nested['dynamo_s']:.2f} vs "
            f"{by_hand['dynamo_s']:.2f} s, AOT {nested['aot_s']:.2f} vs {by_hand['aot_s']:.2f} s, "
            f"full GCs {nested['full_gc_s']:.2f} vs {by_hand['full_gc_s']:.2f} s",
        ),
        verdict(
            errors < 1e-2,
            "regional and nested first-step gradients equal eager's",
            f"largest error {errors:.1e} (torch's nested by hand: "
            f"{by_hand['gradient_error']:.1e}, whole-model: {whole['gradient_error']:.1e})",
        ),
    ]


def steady_claims(result: dict) -> list[str]:
    ms = result["ms"]
    best = min(ms["eager"], ms["whole"])
    ratio = ms["regional_inplace"] / best
    gated = ms["gated"] / min(ms["eager"], ms["regional_inplace"])
    return [
        verdict(
            ratio <= 1.02,
            "regional steady step within 1.02x the faster of eager and whole-model",
            ", ".join(f"{v} {t:.2f} ms" for v, t in ms.items()) + f"; ours {ratio:.2f}x",
        ),
        verdict(
            gated <= 1.02,
            "after keep_if_faster decided, within 1.02x the faster of eager and ours",
            f'decided "{result.get("decision")}"; {ms["gated"]:.2f} ms, {gated:.2f}x',
        ),
    ]


def cuda_graph_claims(rows: dict) -> list[str]:
    ours, default = rows["regional_cudagraphs"], rows["regional_inplace"]
    whole = rows["whole_cudagraphs"]
    ratio = ours["steady_step_ms"] / default["steady_step_ms"]
    return [
        verdict(
            ratio <= 0.6,
            "regional CUDA graphs' steady step at most 0.6x the default mode's",
            f"{ours['steady_step_ms']:.2f} ms vs {default['steady_step_ms']:.2f} ms "
            f"({ratio:.2f}x); whole-model CUDA graphs {whole['steady_step_ms']:.2f} ms, "
            f"peak GPU ours {ours['peak_gpu_mb']:.0f} MB, whole {whole['peak_gpu_mb']:.0f} MB",
        ),
        verdict(
            ours["cudagraph_skips"] == 0,
            "no region's CUDA graph skipped by inductor",
            f"cudagraph_skips {ours['cudagraph_skips']} (whole-model {whole['cudagraph_skips']})",
        ),
    ]


def warm_claims(result: dict) -> list[str]:
    cold, warm = result["cold"], result["checkpoint_artifacts"]
    ratio = warm["first_step_s"] / cold["first_step_s"]
    return [
        verdict(
            ratio < 0.5 and warm["fxgraph_miss"] == 0,
            "a resume from checkpoint artifacts starts warm",
            f"first step {warm['first_step_s']:.1f} s vs cold {cold['first_step_s']:.1f} s "
            f"({ratio:.2f}x), FX graph misses {warm['fxgraph_miss']}",
        )
    ]


def background_claims(ways: dict) -> list[str]:
    eager, ours = ways["eager"], ways["background"]
    if "step_10" not in ours or "step_10" not in eager:
        return [verdict(False, "background mode ran", json.dumps(ways)[:300])]
    limit = 1.5 * eager["step_10"] + 1
    return [
        verdict(
            ours["step_10"] <= limit,
            "background step 10 within 1.5x eager's + 1 s",
            f"{ours['step_10']:.1f} s vs limit {limit:.1f} s (eager {eager['step_10']:.1f} s, "
            f"default mode {ways['lightning_regions'].get('step_10', float('nan')):.1f} s)",
        ),
        verdict(
            ours.get("children") == 1 and "stall" in ours,
            "background switched, with one child",
            f"children {ours.get('children')}, switch at step {ours.get('switch_step')}, "
            f"stall {ours.get('stall', float('nan')):.2f} s",
        ),
    ]


def real_model_claims(models: dict) -> list[str]:
    lines = []
    for model, ways in models.items():
        if not isinstance(ways, dict):
            continue
        ours, eager, whole = ways.get("ours", {}), ways.get("eager", {}), ways.get("whole", {})
        if "steady_step_ms" not in ours or "steady_step_ms" not in eager:
            lines.append(verdict(False, f"{model} in bf16 ran", json.dumps(ways)[:300]))
            continue
        ratio = ours["steady_step_ms"] / eager["steady_step_ms"]
        figures = ", ".join(
            f"{way} {row['first_step_s']:.1f} s first, {row['steady_step_ms']:.1f} ms steady, "
            f"step 100 at {row['step_100_s']:.1f} s, step 1000 (projected) at "
            f"{row['step_1000_projected_s']:.0f} s"
            + (f" ({row['decision']})" if "decision" in row else "")
            for way, row in ways.items()
            if "steady_step_ms" in row
        )
        lines.append(
            verdict(
                ratio <= 1.0,
                f"{model} in bf16: ours' steady step no slower than eager's",
                f"{ratio:.2f}x; {figures}",
            )
        )
        strategy, plain = ways.get("strategy", {}), ways.get("lightning_eager", {})
        if "steady_step_ms" in strategy and "steady_step_ms" in plain:
            paid = strategy["steady_step_ms"] / plain["steady_step_ms"]
            lines.append(
                verdict(
                    paid <= 1.02,
                    f"{model} in bf16 under Lightning: the strategy no slower than eager",
                    f"{paid:.2f}x ({strategy.get('decision', 'no decision')})",
                )
            )
        if "first_step_s" in whole:
            lines.append(
                verdict(
                    ours["first_step_s"] < whole["first_step_s"],
                    f"{model} in bf16: ours' first step sooner than whole-model's",
                    f"{ours['first_step_s']:.1f} s vs {whole['first_step_s']:.1f} s",
                )
            )
    return lines


CLAIMS = {
    "cuda_tests": cuda_test_claims,
    "cold_starts": cold_start_claims,
    "steady_steps": steady_claims,
    "cuda_graphs": cuda_graph_claims,
    "warm_resume": warm_claims,
    "background": background_claims,
    "real_models": real_model_claims,
}


# --- provenance and files -----------------------------------------------------------------


def provenance(device: str, machine: str) -> dict[str, Any]:
    import torch
    from harness import commit

    return {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": machine,
        "torch": torch.__version__,
        "cores": len(os.sched_getaffinity(0)),
        "command": "make gpu-check" if device == "cuda" else f"{Path(__file__).name} --device cpu",
    }


def real_models_of(parts: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """The real-model part's rows: model: way: figures (ways that failed: their error)."""
    result = parts.get("real_models", {}).get("result", {})
    return {
        model: {way: row for way, row in ways.items() if isinstance(row, dict)}
        for model, ways in result.items()
        if isinstance(ways, dict)
    }


def plot_real_models(parts: dict[str, dict], path: Path) -> None:
    """Time to step N of each real model's ways (log scales): the steps measured, and
    step 1,000 projected from the steady step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = real_models_of(parts)
    if not models:
        return
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for axis, (model, ways) in zip(axes[0], models.items(), strict=True):
        for way, row in ways.items():
            marks = {int(step): seconds for step, seconds in row.get("marks", {}).items()}
            if "step_1000_projected_s" in row:
                marks[1000] = row["step_1000_projected_s"]
            if marks:
                steps = sorted(marks)
                axis.plot(steps, [marks[n] for n in steps], marker="o", label=way)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("step N (1,000: projected from the steady step)")
        axis.set_ylabel("seconds to the end of step N")
        axis.set_title(f"{model}, bf16")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def markdown(about: dict, parts: dict[str, dict], lines: list[str]) -> str:
    head = (
        f"GPU check at commit {about['commit']}, {about['date']}, on {about['device']}, torch "
        f"{about['torch']}, {about['cores']} cores split between two lanes; "
        f"`{about['command']}`, {about['seconds']:.0f} s in all."
    )
    rows = ["| part | lane | seconds | ran beside |", "|---|---|---|---|"]
    for name, part in parts.items():
        seconds = part["end_s"] - part["start_s"]
        rows.append(f"| {name} | {part['lane']} | {seconds:.0f} | {', '.join(part['beside'])} |")
    body = [head, "", *rows, "", *(f"- {line}" for line in lines), *real_table(parts)]
    return "\n".join(body) + "\n"


def real_table(parts: dict[str, dict]) -> list[str]:
    """The real models' figures, a row per way (the plot beside it: ``*_real.png``)."""
    models = real_models_of(parts)
    lines = [
        "",
        "| model | way | first step s | to step 10 s | to step 100 s | to step 1000 s "
        "(projected) | steady step ms | decision |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, ways in models.items():
        for way, row in ways.items():
            if "steady_step_ms" not in row:
                lines.append(f"| {model} | {way} | {row.get('error', 'no figures')} | | | | | |")
                continue
            lines.append(
                f"| {model} | {way} | {row['first_step_s']:.1f} | {row['step_10_s']:.1f} | "
                f"{row['step_100_s']:.1f} | {row['step_1000_projected_s']:.0f} | "
                f"{row['steady_step_ms']:.1f} | {row.get('decision', '')} |"
            )
    return lines if models else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--part", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--cores", help=argparse.SUPPRESS)
    parser.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--real", nargs=2, metavar=("MODEL", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.real:
        print(json.dumps(real_run(*args.real, args.device)))
        return
    if args.part:
        run_part(args.part, args.device, [int(c) for c in args.cores.split(",")], args.part_out)
        return
    machine = gpu_or_exit() if args.device == "cuda" else "CPU (script check, small)"
    started = time.perf_counter()
    about = provenance(args.device, machine)
    parts = run_lanes(args.device)
    about["seconds"] = time.perf_counter() - started
    lines = verdicts(parts)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "gpu_check" if args.device == "cuda" else "gpu_check_cpu"
    (args.out / f"{name}.json").write_text(json.dumps({**about, "parts": parts}, indent=1))
    (args.out / f"{name}.md").write_text(markdown(about, parts, lines))
    plot_real_models(parts, args.out / f"{name}_real.png")
    print("\n".join(f"gpu-check: {line}" for line in lines))
    print(f"gpu-check took {about['seconds']:.0f} s; results in {args.out / name}.md")


if __name__ == "__main__":
    main()
