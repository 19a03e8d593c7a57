"""Cold-start and steady-state cost of each way to compile the tiny GPT, side by side.

Every (variant, depth, repeat) runs in its own process with a fresh, empty
``TORCHINDUCTOR_CACHE_DIR``. A run takes one forward+backward step cold (compile
included), the protocol's warm-up steps, then 10 timed steps. Results are medians over repeats;
ratios are against whole-model ``torch.compile`` at the same depth, from the same run.
The steady-step column is each variant alone in its own process, not interleaved with
the others: a busy stretch of the machine lands on whichever ran then. Steady-step
ratios come from ``benchmarks/steady_step.py`` (the protocol of ``protocol.py``).

    python benchmarks/compile_time.py                      # depths 2 4 8 16, 3 repeats
    python benchmarks/compile_time.py --depths 4 --repeats 1 --variants whole regional_inplace
    python benchmarks/compile_time.py --device cuda              # on a GPU (triton kernels)
    python benchmarks/compile_time.py --backend aot_eager        # dynamo and AOT alone

Writes ``compile_time.json``, ``compile_time.md`` and ``compile_time.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import machine, save_results  # noqa: E402
from benchmarks.protocol import WARMUP_STEPS  # noqa: E402

VARIANTS = (
    "eager",
    "whole",
    "accelerate",
    "regional_out_of_place",
    "regional_inplace",
    "nested",
    "torch_nested",
)
TIMED_STEPS = 10
#: CUDA graphs (inductor's ``mode="reduce-overhead"``), whole-model and ours: run by
#: ``gpu_check.py``, not by this benchmark's default set.
CUDA_GRAPH_VARIANTS = ("whole_cudagraphs", "regional_cudagraphs")


def build(variant: str, depth: int, width: int, device: str = "cpu", backend: str = "inductor"):
    """The model for ``variant`` on ``device``, ready to be called; every compiled variant
    uses ``backend`` (``aot_eager`` times dynamo and AOT autograd without inductor), but
    the CUDA-graph ones, which are inductor's and refuse another."""
    import torch

    from examples.tiny_gpt import GPTConfig, TinyGPT
    from lightning_regions import compile_regions

    if variant in CUDA_GRAPH_VARIANTS and backend != "inductor":
        raise ValueError(
            f"{variant} runs inductor's mode='reduce-overhead' and cannot use backend "
            f"{backend!r}: run it with --backend inductor"
        )
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, block_size=128, n_layer=depth, n_head=4, n_embd=width)
    model = TinyGPT(config).to(device)
    if variant == "whole":
        return torch.compile(model, backend=backend)
    if variant == "whole_cudagraphs":
        return torch.compile(model, mode="reduce-overhead")
    if variant == "regional_cudagraphs":
        return compile_regions(model, inplace=True, mode="reduce-overhead")
    if variant == "accelerate":
        from accelerate.utils import compile_regions as accelerate_compile_regions

        del model._modules["layers"]  # accelerate drops the alias; keep forward working
        model.layers = list(model.blocks)
        return accelerate_compile_regions(model, backend=backend)
    if variant == "regional_out_of_place":
        return compile_regions(model, backend=backend)
    if variant == "regional_inplace":
        return compile_regions(model, inplace=True, backend=backend)
    if variant == "nested":
        return compile_regions(model, inplace=True, granularity="nested", backend=backend)
    if variant == "torch_nested":  # torch's decorator on the block class, by hand
        marked = torch_nested_block()
        for block in model.blocks:  # a subclass for this model: other models keep theirs
            block.__class__ = marked
        return torch.compile(model, backend=backend)
    return model


def torch_nested_block():
    """``GPTBlock`` with torch's ``nested_compile_region`` on its ``forward``, by hand."""
    import torch

    from examples.tiny_gpt import GPTBlock

    class TorchNestedBlock(GPTBlock):
        forward = torch.compiler.nested_compile_region(GPTBlock.forward)

    return TorchNestedBlock


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so wall-clock times measure it."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_once(model, idx):
    import torch.nn.functional as F

    logits = model(idx)  # through __call__: model.loss() would bypass torch.compile
    F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    return logits


def gradients(model) -> dict:
    return {
        name.replace("_orig_mod.", ""): p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def cold_start_phases() -> dict:
    """Where this process's compile time went, from torch's own ``dynamo_timed`` metrics."""
    from torch._dynamo.utils import compilation_time_metrics

    def total(name: str) -> float:
        return sum(compilation_time_metrics.get(name, []))

    return {
        "dynamo_s": total("_compile.compile_inner") - total("OutputGraph.call_user_compiler"),
        "aot_s": total("create_aot_dispatcher_function")
        - total("compile_fx.<locals>.fw_compiler_base"),
        "inductor_forward_s": total("compile_fx.<locals>.fw_compiler_base"),
        "inductor_backward_s": total("compile_fx.<locals>.bw_compiler"),
        "cpp_kernels": len(compilation_time_metrics.get("compile_file", [])),
        **{f"metric:{name}": sum(times) for name, times in compilation_time_metrics.items()},
    }


class FullCollections:
    """Seconds spent in Python's full (generation 2) garbage collections while entered.

    A full collection of a process holding torch's compile state takes 0.1-0.4 s here,
    and the allocation pattern decides which of torch's timers it lands in: two variants
    doing the same work can differ by that much in one timer."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def run_child(
    variant: str, depth: int, width: int, device: str = "cpu", backend: str = "inductor"
) -> dict:
    import torch

    # inductor's compile entry and what it imports (about 1 s): ``torch.compile(model)``
    # with the default backend imports it at the call, in ``build``, untimed; a backend of
    # our own imports it at the first compile, inside the timed first step. Imported here,
    # it is out of every variant's first step alike.
    import torch._inductor.compile_fx

    model = build(variant, depth, width, device, backend)
    idx = torch.randint(0, 65, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)
    seconds = []
    full_collections = FullCollections()
    for step in range(1 + WARMUP_STEPS + TIMED_STEPS):
        synchronize(device)
        start = time.perf_counter()
        with full_collections if step == 0 else contextlib.nullcontext():
            logits = step_once(model, idx)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        if step == 0:  # the first step's result, to compare with eager below
            first_logits, first_grads = logits.detach().clone(), gradients(model)
    counters = torch._dynamo.utils.counters
    phases = cold_start_phases()
    gpu_mb = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else 0.0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reference = build("eager", depth, width, device)  # the same init: seed 0
    expected = step_once(reference, idx).detach()
    expected_grads = gradients(reference)
    return {
        "first_step_s": seconds[0],
        "steady_step_ms": 1000 * statistics.median(seconds[1 + WARMUP_STEPS :]),
        "graphs": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "peak_rss_mb": rss_mb,
        "peak_gpu_mb": gpu_mb,
        "output_error": (first_logits - expected).abs().max().item(),
        "gradient_error": max(
            (first_grads[name] - grad).abs().max().item() for name, grad in expected_grads.items()
        ),
        "full_gc_s": full_collections.seconds,
        **phases,
    }


def run_isolated(
    variant: str, depth: int, width: int, device: str = "cpu", backend: str = "inductor"
) -> dict:
    """One cold run in its own process; triton's cache lives under the fresh inductor one."""
    with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        command = [sys.executable, __file__, "--child", variant, "--depths", str(depth)]
        command += ["--width", str(width), "--device", device, "--backend", backend]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{variant} at depth {depth} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def vec_isa_probe_seconds() -> float:
    """Inductor's one-time CPU vector-ISA probe (test builds with g++), in a fresh cache.

    Every CPU cold start below pays it once, whatever the variant: its result is kept in
    the inductor cache directory, and each run gets a fresh one."""
    code = (
        "import time; from torch._inductor import cpu_vec_isa; start = time.perf_counter(); "
        "cpu_vec_isa.pick_vec_isa(); print(time.perf_counter() - start)"
    )
    with tempfile.TemporaryDirectory(prefix="inductor-probe-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
    return float(done.stdout.strip().splitlines()[-1])


def medians(runs: list[dict]) -> dict:
    keys = dict.fromkeys(key for run in runs for key in run)  # a metric some runs lack: 0
    return {key: statistics.median(run.get(key, 0.0) for run in runs) for key in keys}


def metric_table(summary: dict, variants: list[str], depths: list[int]) -> str:
    """Every timer of torch's ``dynamo_timed`` (seconds, summed over the process; nested
    timers include their children) where some variant spent 0.05 s or more."""
    rows = []
    for depth in depths:
        by_variant = summary[str(depth)]
        names = sorted({k for row in by_variant.values() for k in row if k.startswith("metric:")})
        for name in names:
            values = [by_variant[v].get(name, 0.0) for v in variants]
            if max(values) >= 0.05:
                rows.append([str(depth), f"`{name[7:]}`", *(f"{value:.2f}" for value in values)])
    return markdown(["depth", "torch timer", *variants], rows)


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def each_row(summary: dict, variants: list[str], depths: list[int]):
    """(depth, variant, medians, whole-model's medians at that depth or None)."""
    for depth in depths:
        whole = summary[str(depth)].get("whole")
        for variant in variants:
            yield depth, variant, summary[str(depth)][variant], whole


def table(summary: dict, variants: list[str], depths: list[int]) -> str:
    headers = ["depth", "variant", "first step (s)", "vs whole"]
    headers += ["steady step, own process (ms)", "vs whole"]
    headers += ["graphs", "peak RSS (MB)", "peak GPU (MB)"]
    headers += ["max output error", "max gradient error"]
    rows = []
    for depth, variant, row, whole in each_row(summary, variants, depths):
        first_ratio = f"{row['first_step_s'] / whole['first_step_s']:.2f}x" if whole else ""
        steady_ratio = f"{row['steady_step_ms'] / whole['steady_step_ms']:.2f}x" if whole else ""
        rows.append(
            [
                str(depth),
                variant,
                f"{row['first_step_s']:.1f}",
                first_ratio,
                f"{row['steady_step_ms']:.1f}",
                steady_ratio,
                f"{row['graphs']:.0f}",
                f"{row['peak_rss_mb']:.0f}",
                f"{row['peak_gpu_mb']:.0f}",
                f"{row['output_error']:.1e}",
                f"{row['gradient_error']:.1e}",
            ]
        )
    return markdown(headers, rows)


def phase_table(summary: dict, variants: list[str], depths: list[int], probe_s: float) -> str:
    """Where each compiled variant's cold first step goes (medians), and its ratio to
    whole-model compile once the shared vector-ISA probe is taken out of both."""
    headers = ["depth", "variant", "first step (s)", "dynamo (s)", "AOT (s)"]
    headers += ["inductor forward (s)", "inductor backward (s)", "C++ kernels"]
    headers += ["full GCs (s)", "vs whole, probe taken out"]
    rows = []
    for depth, variant, row, whole in each_row(summary, variants, depths):
        if variant == "eager" or "dynamo_s" not in row:
            continue
        ratio = ""
        if whole:
            ratio = f"{(row['first_step_s'] - probe_s) / (whole['first_step_s'] - probe_s):.2f}x"
        rows.append(
            [
                str(depth),
                variant,
                f"{row['first_step_s']:.1f}",
                f"{row['dynamo_s']:.2f}",
                f"{row['aot_s']:.2f}",
                f"{row['inductor_forward_s']:.1f}",
                f"{row['inductor_backward_s']:.1f}",
                f"{row['cpp_kernels']:.0f}",
                f"{row.get('full_gc_s', 0.0):.2f}",
                ratio,
            ]
        )
    return markdown(headers, rows)


def plot(summary: dict, variants: list[str], depths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for variant in variants:
        if variant == "eager":
            continue
        values = [summary[str(d)][variant]["first_step_s"] for d in depths]
        axis.plot(depths, values, marker="o", label=variant)
    axis.set_xlabel("depth (transformer blocks)")
    axis.set_ylabel("cold first step (s), median")
    axis.set_xticks(depths)
    axis.set_title("Tiny GPT, fresh inductor cache per run")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def add_run_arguments(parser: argparse.ArgumentParser, variants: tuple[str, ...]) -> None:
    """The options every side-by-side benchmark takes: repeats, variants, out, device."""
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(variants), choices=variants)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--child", choices=variants + CUDA_GRAPH_VARIANTS, help=argparse.SUPPRESS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--metrics", action="store_true", help="every torch timer, too")
    parser.add_argument(
        "--backend",
        default="inductor",
        choices=("inductor", "aot_eager"),
        help="aot_eager: dynamo and AOT autograd alone, no inductor",
    )
    add_run_arguments(parser, VARIANTS)
    args = parser.parse_args()
    if args.child:
        child = run_child(args.child, args.depths[0], args.width, args.device, args.backend)
        print(json.dumps(child))
        return

    runs: dict[str, dict[str, list[dict]]] = {
        str(d): {v: [] for v in args.variants} for d in args.depths
    }
    probes: list[float] = []
    for repeat in range(args.repeats):
        if args.device == "cpu" and args.backend == "inductor":
            probes.append(vec_isa_probe_seconds())
            print(f"repeat {repeat + 1} vector-ISA probe {probes[-1]:.1f} s", flush=True)
        for depth in args.depths:
            for variant in args.variants:  # interleaved, so drift hits every variant alike
                result = run_isolated(variant, depth, args.width, args.device, args.backend)
                runs[str(depth)][variant].append(result)
                print(f"repeat {repeat + 1} depth {depth:2d} {variant:22s} {result}", flush=True)
    summary = {d: {v: medians(r) for v, r in by_variant.items()} for d, by_variant in runs.items()}

    header = (
        f"Machine: {machine()}, device {args.device}, backend {args.backend}. Width {args.width}, "
        "batch 8x128 tokens, forward+backward. "
        f"Medians of {args.repeats} run(s), each in its own process with a fresh inductor cache."
    )
    markdown = f"{header}\n\n{table(summary, args.variants, args.depths)}\n"
    probe_s = statistics.median(probes) if probes else 0.0
    if probes:
        markdown += (
            f"\nInductor's one-time CPU vector-ISA probe: {probe_s:.1f} s (median of "
            f"{len(probes)}, each in a fresh cache). Every inductor cold start above pays it once; "
            "a machine whose inductor cache already holds it does not.\n"
        )
    markdown += f"\n{phase_table(summary, args.variants, args.depths, probe_s)}\n"
    data = {
        "machine": machine(),
        "backend": args.backend,
        "width": args.width,
        "vec_isa_probe_s": probes,
        "runs": runs,
        "medians": summary,
    }
    if args.metrics:
        markdown += (
            "\nWhere the compile time goes, by torch's own timers (medians, seconds):\n\n"
            f"{metric_table(summary, args.variants, args.depths)}\n"
        )
    stem = save_results(args.out, "compile_time", args.device, markdown, data)
    plot(summary, args.variants, args.depths, stem.with_suffix(".png"))
    print(markdown)


if __name__ == "__main__":
    main()
