"""What the tests share: one Trainer builder, the tiny GPT and its data, transformers
decoders at depth with their LightningModule, and a stack of synthetic blocks trained
under the strategy and plain Lightning. Test modules import from here (and from
``models``), never from each other."""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from examples.lightning_gpt import CharDataModule, GPTModule
from lightning_regions import PerInstanceRecompileWarning, RegionalCompileStrategy
from lightning_regions.background import threads as intra_op
from lightning_regions.gate import gate as payoff

# --- one Trainer ------------------------------------------------------------------------


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """The calling thread's intra-op work (ATen, MKL) on one thread, as the library limits
    it (``intra_op.limit_intra_op_threads``): ``torch.set_num_threads`` would also turn
    MKL's dynamic adjustment off for the worker's later tests, whose small matmuls would
    then wait for a second core beside the other busy worker."""
    before = intra_op.limit_intra_op_threads(1)
    try:
        yield
    finally:
        intra_op.restore_intra_op_threads(before)


def trainer(
    root, strategy="auto", steps=4, callbacks=(), validate: bool = False, **kwargs
) -> pl.Trainer:
    """A CPU Trainer on one device, quiet, under ``root``; ``validate``: one validation
    batch a epoch and one sanity batch (else none); ``kwargs`` override the rest."""
    options = {
        "strategy": strategy,
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": steps,
        "limit_val_batches": 1 if validate else 0,
        "logger": False,
        "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        "callbacks": list(callbacks),
    }
    if validate:
        options |= {"num_sanity_val_steps": 1, "check_val_every_n_epoch": 1}
    return pl.Trainer(**{**options, **kwargs})


# --- a failing backend, a slow one, a cache probe ---------------------------------------


class SlowToCompile:
    """torch's ``aot_eager``, ``seconds`` slower each time dynamo calls it to compile a
    graph (its compiled calls run at full speed): a compile long enough to watch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, gm, example_inputs):
        time.sleep(self.seconds)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class FailsOnLayerNorm:
    """A backend that cannot lower layer_norm: it fails for the block classes that use it
    (``Block``, ``GPTBlock``) and compiles the others."""

    def __call__(self, gm, example_inputs):
        if any("layer_norm" in str(node.target) for node in gm.graph.nodes):
            raise NotImplementedError("no lowering for layer_norm")
        return gm.forward


def rows_of(args) -> int:
    """The rows of a compiled call's inputs that are not parameters."""
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.dim()]
    return sum(a.shape[0] for a in inputs if not isinstance(a, nn.Parameter))


class SlowAotEager:
    """torch's ``aot_eager`` (or ``backend``), each compiled call made ``seconds`` slower
    (on global rank ``only_rank`` alone, when given): compiled loses against eager.
    ``per_row``: ``seconds`` for each row of the call's inputs that are not parameters, so
    a compiled step is slower by a factor, whatever its batch's size."""

    def __init__(
        self,
        only_rank: int | None = None,
        backend: str = "aot_eager",
        seconds: float = 0.03,
        per_row: bool = False,
    ) -> None:
        self.only_rank = only_rank
        self.backend = backend
        self.seconds = seconds
        self.per_row = per_row

    def __call__(self, gm, example_inputs):
        compiled = torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        if self.only_rank is not None and torch.distributed.get_rank() != self.only_rank:
            return compiled

        def slower(*args):
            time.sleep(self.seconds * (rows_of(args) if self.per_row else 1))
            return compiled(*args)

        return slower


#: The optimizer step whose end brings the keep-or-revert decision at the latest (every
#: window timed; gate/gate.py: ``MAX_WINDOWS``), and the same with one candidate (CUDA
#: graphs) timed after it.
GATE_DECIDED_BY = 1 + payoff.SETTLE + 2 * payoff.WINDOW * payoff.MAX_WINDOWS
GATE_DECIDED_BY_WITH_A_CANDIDATE = (
    GATE_DECIDED_BY + payoff.CANDIDATE_SETTLE + 2 * payoff.WINDOW * payoff.MAX_WINDOWS
)
#: Steps of a run whose keep-or-revert decision is tested: it comes at step 11 where the
#: turns agree, at ``GATE_DECIDED_BY`` at the latest.
PAYOFF_STEPS = GATE_DECIDED_BY + 2


class LenientRankOne(pl.Callback):
    """Global rank 1 keeps compiled unless it is 101 times slower than eager: the ranks'
    steps go in lockstep, so they measure alike, and only such a rule parts them. The
    rule is put back when the fit ends (scenarios share a process)."""

    def on_train_start(self, trainer, module) -> None:
        from lightning_regions.gate import gate as payoff

        self.edge = payoff.EDGE
        if trainer.global_rank == 1:
            payoff.EDGE = -100.0

    def teardown(self, trainer, module, stage) -> None:
        from lightning_regions.gate import gate as payoff

        payoff.EDGE = getattr(self, "edge", payoff.EDGE)


class SeenCacheDir(pl.Callback):
    """The inductor cache directory in effect when training starts."""

    directory: str | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def is_running(pid: int) -> bool:
    """Whether process ``pid`` still exists (a child that should have ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class WaitForTheSwitch(pl.Callback):
    """Slow the eager steps of ``compile_in_background=True`` down until the regions
    switched, so the switch comes within a short run on a loaded machine; record every
    child's pid, and torch's cache counters (``counts``) over the first compiled step
    ("training"), the first validation after the switch ("validation") and everything
    after the switch ("after_switch"); with ``after``, stop that many steps after it."""

    def __init__(self, seconds: float = 0.1, after: int | None = None) -> None:
        self.seconds = seconds
        self.after = after
        self.pids: list[int] = []
        self.counts: dict[str, dict[str, int]] = {}  # "training", "validation": since switch
        self.switch_step: int | None = None
        self._before: dict[str, int] = {}
        #: torch's intra-op threads at the end of steps "before the switch" (the job's
        #: child compiled) and "after" it
        self.threads: dict[str, set[int]] = {"before the switch": set(), "after": set()}
        #: the child's environment, read while it compiled
        self.child_environment: dict[str, str] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        from lightning_regions.compat import cache_counts

        background = trainer.strategy.background
        if background is None:
            return
        self.pids = list(dict.fromkeys([*self.pids, *(child.pid for child in background.children)]))
        when = "after" if background.switched else "before the switch"
        self.threads[when].add(torch.get_num_threads())
        if not background.switched:
            process = background.process
            environ = b""
            if process is not None and not self.child_environment and process.poll() is None:
                # empty while exec sets up the new process's stack: read at a later step
                environ = Path(f"/proc/{process.pid}/environ").read_bytes()
            if environ:
                variables = (v.decode().partition("=") for v in environ.split(b"\0") if v)
                self.child_environment = {name: value for name, _, value in variables}
            time.sleep(self.seconds)
            return
        if self.switch_step is None:  # switched in this step's optimizer step
            self.switch_step = trainer.global_step
        elif "training" not in self.counts:  # the first compiled step
            self.counts["training"] = _since(background.counts_at_switch, cache_counts())
        if self.after is not None and trainer.global_step >= self.switch_step + self.after:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, *args: object) -> None:
        from lightning_regions.compat import cache_counts

        background = trainer.strategy.background
        if self.switch_step is not None and background is not None:
            self.counts["after_switch"] = _since(background.counts_at_switch, cache_counts())

    def on_validation_start(self, trainer: pl.Trainer, *args: object) -> None:
        from lightning_regions.compat import cache_counts

        self._before = cache_counts()

    def on_validation_end(self, trainer: pl.Trainer, *args: object) -> None:
        from lightning_regions.compat import cache_counts

        if self.switch_step is not None and "validation" not in self.counts:
            self.counts["validation"] = _since(self._before, cache_counts())


def _since(before: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    return {name: now[name] - before.get(name, 0) for name in now}


# --- what the loggers wrote --------------------------------------------------------------

#: The prefix of the compile's figures in the loggers (``strategies/figures.py``).
FIGURES = "regional_compile/"


def csv_figures(folder) -> dict[str, list[float]]:
    """Each of the compile's figures in the CSVLogger files under ``folder``, with every
    value it was logged with (one per row that holds it)."""
    import csv

    figures: dict[str, list[float]] = {}
    for path in Path(folder).rglob("metrics.csv"):
        with path.open() as rows:
            for row in csv.DictReader(rows):
                for name, value in row.items():
                    if name.startswith(FIGURES) and value:
                        figures.setdefault(name, []).append(float(value))
    return figures


def tensorboard_figures(folder) -> dict[str, list[float]]:
    """The same from the TensorBoard event files under ``folder`` (read with tensorboardX's
    protobuf classes: each record a length, its checksum, the event, its checksum)."""
    import struct

    from tensorboardX.proto import event_pb2

    figures: dict[str, list[float]] = {}
    for path in Path(folder).rglob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                if value.tag.startswith(FIGURES):
                    figures.setdefault(value.tag, []).append(value.simple_value)
    return figures


# --- a terminal -------------------------------------------------------------------------


class Terminal:
    """A pseudo-terminal of 40 rows by 200 columns standing in for ``sys.stdout`` (as a
    user's shell gives a run), with everything written to it, and when, read back."""

    def __init__(self) -> None:
        import fcntl
        import pty
        import struct
        import termios

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
        self.stream = open(slave, "w", buffering=1, closefd=True)
        self.chunks: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.chunks.append((time.perf_counter(), chunk.decode(errors="replace")))

    @property
    def text(self) -> str:
        return "".join(chunk for _, chunk in self.chunks)

    def close(self) -> None:
        self.stream.flush()
        time.sleep(0.2)  # what was written reaches the reader
        self.stream.close()
        os.close(self.master)


@contextlib.contextmanager
def terminal() -> Iterator[Terminal]:
    """``sys.stdout`` a pseudo-terminal (``Terminal``) inside the block."""
    import sys

    term, stdout = Terminal(), sys.stdout
    sys.stdout = term.stream
    try:
        yield term
    finally:
        sys.stdout = stdout
        term.close()


# --- the tiny GPT -----------------------------------------------------------------------

SMALL = {"block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 16, "unique_blocks": 2}


def data() -> CharDataModule:
    return CharDataModule(block_size=16, batch_size=4)


def gpt(**overrides) -> GPTModule:
    return GPTModule(vocab_size=data().vocab_size, **{**SMALL, **overrides})


# --- transformers decoders at depth ------------------------------------------------------

VOCAB = 64


def gpt2() -> nn.Module:
    import transformers  # here: the 2-process scripts import this module on every rank

    from benchmarks.tiny_transformers import tiny

    # 12 layers, a real depth: the recompile limit (8) hides below 9 layers
    config = tiny(
        transformers.GPT2Config,
        width=32,
        heads=2,
        vocab=VOCAB,
        positions=32,
        bos_token_id=0,
        eos_token_id=0,
        n_inner=None,  # GPT-2's own: 4 x the width
    )
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    import transformers

    from benchmarks.tiny_transformers import tiny

    config = tiny(transformers.LlamaConfig, width=32, heads=2, vocab=VOCAB, positions=32)
    return transformers.LlamaForCausalLM(config)


class CausalLM(pl.LightningModule):
    """A transformers decoder trained as its docs show."""

    def __init__(self, build) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = build()
        self.losses: list[float] = []
        self.cache_in_validation: list[bool] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        output = self.model(input_ids=batch)
        self.cache_in_validation.append(output.past_key_values is not None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def token_batches() -> torch.utils.data.DataLoader:
    """16 sequences of 16 token ids below ``VOCAB``, 4 a batch, the same every call."""
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        torch.randint(0, VOCAB, (16, 16), generator=generator), batch_size=4
    )


# --- synthetic blocks, trained both ways --------------------------------------------------


class LayerIndexBlock(nn.Module):
    """A block whose forward reads its own int layer index."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.layer_idx = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x) / (self.layer_idx + 1)


class BlockStack(pl.LightningModule):
    """Blocks behind a ``width`` x ``width`` embedding (None: none), trained by SGD at
    ``lr`` on their squared output, each step's loss kept; ``residual``: each block's
    output is added to its input."""

    def __init__(
        self,
        blocks: list[nn.Module],
        width: int | None = 8,
        residual: bool = False,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width) if width is not None else nn.Identity()
        self.blocks = nn.ModuleList(blocks)
        self.residual, self.sgd_lr = residual, lr
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch)
        for block in self.blocks:
            x = x + block(x) if self.residual else block(x)
        loss = x.pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.sgd_lr)


def vectors() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.randn(16, 8, generator=torch.Generator()), 4)


def seeded_stack(blocks) -> BlockStack:
    torch.manual_seed(0)
    return BlockStack(blocks())


def fit_stack(root, blocks, **strategy_kwargs) -> tuple[BlockStack, list[str]]:
    """Train ``blocks()`` 3 steps under the strategy (aot_eager) and plain Lightning;
    assert equal losses; return ours and the per-instance warnings it gave."""
    model, plain = seeded_stack(blocks), seeded_stack(blocks)
    strategy = RegionalCompileStrategy(backend="aot_eager", **strategy_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(root, strategy, 3).fit(model, vectors())
    trainer(root, "auto", 3).fit(plain, vectors())
    assert model.losses == pytest.approx(plain.losses, rel=1e-5)
    per_instance = [
        str(w.message) for w in caught if issubclass(w.category, PerInstanceRecompileWarning)
    ]
    return model, per_instance


# --- the keep-or-revert gate's clock, read as tests read it ---------------------------


def ms_of(clock: Any) -> list[float]:
    return [step.ms for step in clock.records()]


def elements_of(clock: Any) -> list[int | None]:
    return [step.elements for step in clock.records()]


def left_out_of(clock: Any, reason: str) -> list[bool]:
    return [step.left_out == reason for step in clock.records()]


def assert_matches_eager(model: nn.Module, compiled: nn.Module, x: torch.Tensor) -> None:
    """Outputs, input gradients and parameter gradients equal an eager copy's."""
    eager = copy.deepcopy(model)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = eager(x_eager), compiled(x_compiled)
    torch.testing.assert_close(actual, expected)
    expected.sum().backward()
    actual.sum().backward()
    torch.testing.assert_close(x_compiled.grad, x_eager.grad)
    for (name, p), (_, q) in zip(
        compiled.named_parameters(), eager.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
