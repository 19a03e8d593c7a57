"""DeepSpeed ZeRO stages 1-3 on CPU processes over gloo (``DS_ACCELERATOR=cpu``), driven
through ``deepspeed.initialize`` as Lightning's ``DeepSpeedStrategy`` drives it; ours
prepares and compiles the model in ``RegionalCompileDeepSpeedStrategy``'s own wrap hook
first. Lightning itself refuses DeepSpeed without CUDA, so no Trainer runs here.

Usage: python tests/deepspeed_run.py OUT_DIR BACKEND:STAGE [BACKEND:STAGE ...]
Each rank writes OUT_DIR/rank<r>.pt: plain DeepSpeed's run of each stage named, and ours
with each backend named, by (backend, stage), plain's backend None: losses and gathered
parameters, and ours' compile records (the frames dynamo compiled, the files of the code
traced into each graph, the region report's counts). ``gate:STAGE`` and
``gate-plain:STAGE``: the keep-or-revert gate through its decision, and plain DeepSpeed
over the same steps (``train``). Both ranks run one pair of processes, which sets
DeepSpeed up once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORLD = 2
STEPS = 4
#: The runs of the keep-or-revert gate under ZeRO-3 (ours) and of plain DeepSpeed beside it.
GATE, GATE_PLAIN = "gate", "gate-plain"
GATES = (GATE, GATE_PLAIN)


class RecordingBackend:
    """``backend`` (torch's, by name), recording the source files of the code traced into
    each graph it is given (every node's ``stack_trace``)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.traced_files: set[str] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        for node in gm.graph.nodes:
            for line in (node.meta.get("stack_trace") or "").splitlines():
                if line.strip().startswith('File "'):
                    self.traced_files.add(line.strip().split('"')[1])
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


def model_and_batches(rank: int, steps: int):
    from examples.lightning_gpt import CharDataModule, GPTModule

    data = CharDataModule(block_size=16, batch_size=4)
    module = GPTModule(vocab_size=data.vocab_size, block_size=16, n_layer=4, n_head=2, n_embd=16)
    batches = list(data.train_dataloader())[rank : WORLD * steps : WORLD]  # this rank's share
    return module, batches


def train(stage: int, backend: str | None, rank: int) -> dict:
    """``STEPS`` steps of ZeRO stage ``stage``: plain DeepSpeed when ``backend`` is None,
    else the regions compiled by our strategy's wrap hook with ``backend``, the report
    made after the first step. ``GATE`` (``PAYOFF_STEPS`` steps): the keep-or-revert gate
    at every step, aot_eager's compiled calls slowed on rank 0 alone and rank 1 lenient,
    so the ranks would decide apart unless they agree; ``GATE_PLAIN``: plain DeepSpeed
    over the same steps."""
    import deepspeed
    from helpers import PAYOFF_STEPS, SlowAotEager
    from lightning.fabric.plugins.environments import LightningEnvironment
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    from lightning_regions import RegionalCompileDeepSpeedStrategy, region_report
    from lightning_regions.gate import gate as payoff

    torch._dynamo.reset()
    clear_compilation_metrics()
    gate = backend == GATE
    module, batches = model_and_batches(rank, PAYOFF_STEPS if backend in GATES else STEPS)
    backend = None if backend == GATE_PLAIN else backend
    compiler = SlowAotEager(only_rank=0) if gate else RecordingBackend(backend or "eager")
    strategy = RegionalCompileDeepSpeedStrategy(stage=stage, backend=compiler)
    # what Lightning's accelerator connector gives the strategy: its devices, its ranks
    strategy.parallel_devices = [torch.device("cpu")] * WORLD
    strategy.cluster_environment = LightningEnvironment()
    strategy.set_world_ranks()
    edge = payoff.EDGE
    if gate and rank == 1:
        payoff.EDGE = -100.0  # keeps compiled unless 101 times slower: only agreeing reverts
    config = {
        **strategy.config,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
    }
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every one
    if backend is not None:
        strategy.connect(module)
        strategy._setup_model(module)  # the wrap hook Lightning calls before initialize
    # SGD: a parameter's difference from plain's is its gradients' (AdamW's normalised
    # step would blow a float's noise in a near-zero gradient up to a whole step)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    losses = []
    for step, (idx, targets) in enumerate(batches):
        logits = engine(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (step == 0 or gate) and backend is not None:
            strategy.at_step_boundary(module)  # what its optimizer_step does
    payoff.EDGE = edge
    parameters = list(module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=stage == 3):
        state = {name: p.detach().clone() for name, p in module.named_parameters()}
    result = {
        "losses": losses,
        "params": state,
        "tied": module.model.lm_head.weight is module.model.wte.weight,
        "frames": [(m.co_name, m.co_filename) for m in get_compilation_metrics()],
        "recompile_limit_hits": [
            m.co_name
            for m in get_compilation_metrics()
            if "recompile limit" in (m.fail_reason or "")
        ],
    }
    if gate:
        decision = strategy.payoff.decision
        result["decision"] = None if decision is None else decision.chosen
        result["said"] = str(decision)
        result["forwards_compiled"] = ["forward" in vars(b) for b in module.model.blocks]
        result["keys"] = list(module.state_dict())
        strategy.leave_parts()
    elif backend is not None:
        report = region_report(module)
        result["traced_files"] = sorted(strategy.options.compile_kwargs["backend"].traced_files)
        result["graphs"] = sum(row.graphs for row in report.rows)
        result["regions"] = len(report.rows)
        result["never_ran_compiled"] = len(report.never_ran_compiled)
        result["leaves"] = [getattr(b, "_z3_leaf", False) for b in module.model.blocks]
        strategy.leave_parts()
    engine.destroy()
    return result


def worker(rank: int, port: int, runs: list[tuple[str, int]], out: Path) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
    os.environ |= {"WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank)}
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    # DeepSpeed builds a shared-memory all-reduce op with g++ on its first CPU run (about
    # 40 s here); gloo does the work without it
    deepspeed.ops.__compatible_ops__ = {}
    deepspeed.utils.logging.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    stages = sorted({stage for backend, stage in runs if backend not in GATES})
    results = {(None, stage): train(stage, None, rank) for stage in stages}
    results |= {(backend, stage): train(stage, backend, rank) for backend, stage in runs}
    torch.save(results, out / f"rank{rank}.pt")


def main(out: Path, runs: list[tuple[str, int]]) -> None:
    from processes import free_port

    mp.spawn(worker, args=(free_port(), runs, out), nprocs=WORLD)


if __name__ == "__main__":
    specs = [spec.split(":") for spec in sys.argv[2:]]
    main(Path(sys.argv[1]), [(backend, int(stage)) for backend, stage in specs])
