"""What ``torch.set_num_threads`` leaves behind: MKL's dynamic thread adjustment off,
against on (MKL's default, kept by a process that never called it), on the tiny GPT's
eager training step.

The background mode lends its child a core by running training on fewer intra-op threads
until the switch, then gives them back. ``torch.set_num_threads`` also turns MKL's
dynamic thread adjustment off for the rest of the process (``mkl_set_dynamic(false)``,
pytorch#13868); ``threads.limit_intra_op_threads`` sets OpenMP's and MKL's counts for the
calling thread alone and leaves it as it was (``tests/test_background.py`` checks which
does what). This measures what the flag costs, in one process, so that this VM's drift
in speed (tens of seconds at a time) lands on both alike: turns of ``--turn`` eager steps
(forward, backward, AdamW) of the tiny GPT (``examples/tiny_gpt.py``, depth 16, width
16, batch 8 x 128 tokens: the background benchmark's ``--width 16`` model), the flag on
and off in turn (``MKL_Set_Dynamic``, which torch links into libtorch_cpu), ``--turns``
turns each; and the same for one attention call's forward and backward at the model's
shapes (``scaled_dot_product_attention``, 8 x 4 heads x 128 x 4). Figures: the median
step each way, and the median over adjacent pairs of turns of off / on.

    python benchmarks/mkl_dynamic.py [--turns 30] [--turn 10]

Writes ``mkl_dynamic.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import save_results  # noqa: E402


def in_turns(work: Callable[[], None], turns: int, turn: int) -> dict[str, list[float]]:
    """Milliseconds of each call of ``work``, MKL's dynamic adjustment on and off in
    turns of ``turn`` calls (each turn's first call not counted)."""

    from lightning_regions.background.threads import torch_cpu_library

    library = torch_cpu_library()
    assert library is not None  # main() checked for MKL
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(turns):
        for way in ("on", "off"):
            library.MKL_Set_Dynamic(ctypes.c_int(way == "on"))
            for call in range(turn + 1):
                start = time.perf_counter()
                work()
                if call:
                    times[way].append((time.perf_counter() - start) * 1000)
    library.MKL_Set_Dynamic(ctypes.c_int(1))
    return times


def summary(times: dict[str, list[float]], turn: int) -> dict[str, float]:
    pairs = [
        statistics.median(times["off"][i : i + turn]) / statistics.median(times["on"][i : i + turn])
        for i in range(0, len(times["on"]), turn)
    ]
    return {
        "on_ms": statistics.median(times["on"]),
        "off_ms": statistics.median(times["off"]),
        "off_over_on": statistics.median(pairs),
        "pairs_slower": sum(ratio > 1 for ratio in pairs) / len(pairs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--turn", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    import torch

    from examples.tiny_gpt import GPTConfig, TinyGPT

    if not torch.backends.mkl.is_available():
        raise SystemExit("this torch has no MKL: nothing to measure")
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(65, block_size=128, n_layer=16, n_head=4, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 65, (8, 128))

    def step() -> None:
        loss = model.loss(tokens, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    q, k, v = (torch.randn(8, 4, 128, 4, requires_grad=True) for _ in range(3))

    def attention() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    results = {
        "tiny GPT eager step": summary(in_turns(step, args.turns, args.turn), args.turn),
        "attention forward and backward": summary(
            in_turns(attention, args.turns, 10 * args.turn), 10 * args.turn
        ),
    }
    lines = [
        "| work | MKL dynamic on ms | off ms | off / on (median of paired turns) | "
        "pairs where off was slower |",
        "|---|---|---|---|---|",
    ]
    for work, figures in results.items():
        lines.append(
            f"| {work} | {figures['on_ms']:.2f} | {figures['off_ms']:.2f} | "
            f"{figures['off_over_on']:.2f}x | {figures['pairs_slower']:.0%} |"
        )
    markdown = (
        f"MKL's dynamic thread adjustment on (a process that never called "
        f"`torch.set_num_threads`) and off (one that did), in turns in one process, "
        f"{torch.get_num_threads()} intra-op threads, {args.turns} turns each way "
        f"({args.turn} GPT steps, {10 * args.turn} attention calls a turn).\n\n" + "\n".join(lines)
    )
    save_results(
        args.out,
        "mkl_dynamic",
        "cpu",
        markdown,
        {"results": results, **vars(args)} | {"out": str(args.out)},
    )
    print(markdown)


if __name__ == "__main__":
    main()
