"""The tiny GPT in a Lightning Fabric loop, with regional compile and the tie check.

    python examples/fabric_gpt.py                                   # one CPU device
    python examples/fabric_gpt.py --strategy regional_compile_ddp --devices 2
    python examples/fabric_gpt.py --strategy ddp --devices 2        # plain Fabric DDP

With ``--out DIR`` each rank writes ``DIR/<strategy>_rank<r>.json``: its losses, whether
the tie held, and how many regions ran compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning_regions.fabric
from examples.lightning_gpt import CharDataModule
from examples.tiny_gpt import GPTConfig, TinyGPT
from lightning_regions import TieCheck, region_report
from lightning_regions.core.compile import tracker_of

SMALL = {"block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 16, "unique_blocks": 2}


def train(fabric: Fabric, steps: int, move_to_device: bool = True) -> tuple[TinyGPT, list]:
    """Train the GPT for ``steps`` steps; the tie check verifies after the first one."""
    data = CharDataModule(block_size=SMALL["block_size"], batch_size=4)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=data.vocab_size, **SMALL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ties = TieCheck(model)  # before fabric.setup: what the model is
    model, optimizer = fabric.setup(model, optimizer, move_to_device=move_to_device)
    loader = fabric.setup_dataloaders(data.train_dataloader(), use_distributed_sampler=False)
    losses = []
    for step, (idx, targets) in enumerate(loader):
        if step == steps:
            break
        logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            ties.verify(model, optimizer)  # raises TiedWeightsError naming broken groups
        losses.append(loss.item())
    return model, losses


#: Seconds the GIL is left free after the exit barrier, for gloo's worker threads.
GLOO_DRAIN_S = 0.5


def release_gloo_before_exit(fabric: Fabric) -> None:
    """torch's shutdown, which Fabric leaves to the script for gloo (it registers it at
    exit for nccl only), after a barrier. On torch 2.13 and later (not 2.11) each backward
    stashes a Python object in the thread state that DDP's gradient all-reduces capture;
    a gloo worker thread that frees the last one needs the GIL, and deleting the DDP
    model destroys the process group holding the GIL while it joins those threads: the
    exit then hangs or aborts ("terminate called without an active exception"). The
    barrier waits without the GIL, so the workers free them first; but the barrier's own
    work holds the last all-reduce, and a worker may free it just after the barrier
    returns: a sleep leaves it the GIL (``docs/usage.md``)."""
    fabric.barrier()
    time.sleep(GLOO_DRAIN_S)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="regional_compile")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    strategy = args.strategy
    if strategy.startswith("regional_compile"):
        cls = lightning_regions.fabric.RegionalCompileStrategy
        if strategy.endswith("ddp"):
            cls = lightning_regions.fabric.RegionalCompileDDPStrategy
            strategy = cls(backend=args.backend, process_group_backend="gloo")
        else:
            strategy = cls(backend=args.backend)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    model, losses = train(fabric, args.steps)
    gpt = model.module if hasattr(model, "module") else model
    compiled = 0
    if tracker_of(gpt) is not None:
        compiled = sum(row.compiled_calls > 0 for row in region_report(gpt).rows)
    result = {
        "losses": losses,
        "tie_kept": gpt.lm_head.weight is gpt.wte.weight,
        "regions_compiled": compiled,
    }
    if args.out:
        out = Path(args.out) / f"{args.strategy}_rank{fabric.global_rank}.json"
        out.write_text(json.dumps(result))
    fabric.print(json.dumps(result))
    if torch.distributed.is_initialized():
        release_gloo_before_exit(fabric)


if __name__ == "__main__":
    main()
