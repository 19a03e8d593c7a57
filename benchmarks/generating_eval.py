"""Evaluation that generates: a ``validation_step`` that calls ``generate()``, then
``trainer.predict``, under each way of compiling a transformers decoder.

transformers' GPT-2 and Llama from configs (12 layers, width 64), 4 training steps at
length 32, a ``validation_step`` that generates 8 greedy tokens for 2 prompts, the
validation sanity check on (Lightning's default) or off, then ``trainer.predict``:

- ``eager``: plain Lightning;
- ``whole``: plain Lightning, the decoder compiled whole (``model.compile()``);
- ``accelerate``: ``accelerate.utils.compile_regions`` on the decoder;
- ``regions`` and ``nested``: ``RegionalCompileStrategy(granularity=...)``.

Block calls that ran eager are counted per phase by a forward pre-hook on the first child
of every decoder layer that counts only outside compiled code
(``torch.compiler.is_compiling()``: a layer's compiled graph inlines it, traced, and a
layer run eager calls it as Python), so the count is the same for every variant and
independent of our report. Graphs are dynamo's
``unique_graphs``. Tokens and predict logits are compared with the eager run's.

    python benchmarks/generating_eval.py [--backend aot_eager] [--models gpt2 llama]
        [--sanity 1 0] [--variants ...]

Each (model, variant, sanity) runs in its own process with a fresh
``TORCHINDUCTOR_CACHE_DIR``. Writes ``generating_eval.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import quiet_trainer, save_results  # noqa: E402

VARIANTS = ("eager", "whole", "accelerate", "regions", "nested")
MODELS = ("gpt2", "llama")
VOCAB, LENGTH, WIDTH, LAYERS, NEW_TOKENS = 64, 32, 64, 12, 8


def build(name: str) -> Any:
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=LAYERS, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=64,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def decoder_layers(model: Any) -> list[Any]:
    inner = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return list(inner)


class EagerCalls:
    """Block calls that ran as Python, outside compiled code, by phase."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.counts: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def __call__(self, module: Any, args: Any) -> None:
        import torch

        if not torch.compiler.is_compiling():
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1


def run(model_name: str, variant: str, sanity: bool, backend: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from lightning_regions import RegionalCompileStrategy

    torch.manual_seed(0)
    model = build(model_name)
    counter = EagerCalls()
    for layer in decoder_layers(model):
        next(layer.children()).register_forward_pre_hook(counter)
    prompts = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    generated: list[list[int]] = []
    seconds = {"validation": 0.0}

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.losses: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            start = time.perf_counter()
            out = self.model.generate(
                prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            seconds["validation"] += time.perf_counter() - start
            generated.append(out[:, prompts.shape[1] :].tolist())

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch).logits

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Phases(pl.Callback):
        def on_sanity_check_start(self, *args: Any) -> None:
            counter.phase = "sanity"

        def on_train_batch_start(self, *args: Any) -> None:
            counter.phase = "training"

        def on_validation_start(self, trainer: Any, *args: Any) -> None:
            if not trainer.sanity_checking:
                counter.phase = "validation"

        def on_predict_start(self, *args: Any) -> None:
            counter.phase = "predict"

    module = Module()
    strategy: Any = "auto"
    if variant == "whole":
        model.compile(backend=backend)
    elif variant == "accelerate":
        from accelerate.utils import compile_regions

        module.model = compile_regions(model, backend=backend)
    elif variant in ("regions", "nested"):
        strategy = RegionalCompileStrategy(backend=backend, granularity=variant)
    data = torch.randint(0, VOCAB, (8, LENGTH), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = quiet_trainer(
        strategy,
        steps=4,
        callbacks=[Phases()],
        limit_val_batches=1,
        num_sanity_val_steps=1 if sanity else 0,
        val_check_interval=2,
    )
    error = None
    try:
        trainer.fit(module, loader, loader)
        logits = trainer.predict(module, torch.utils.data.DataLoader(data[:2], batch_size=2))
    except Exception as caught:  # a variant that fails reports it in one line
        error = f"{type(caught).__name__}: {str(caught).strip().splitlines()[0][:160]}"
        logits = None
    counters = torch._dynamo.utils.counters
    return {
        "error": error,
        "graphs": counters["stats"]["unique_graphs"],
        "eager_calls": counter.counts,
        "generated": generated,
        "losses": module.losses,
        "predict_logits": logits[0].tolist() if logits else None,
        "validation_s": seconds["validation"],
    }


def in_fresh_process(model: str, variant: str, sanity: bool, backend: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="generating-eval-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        command = [sys.executable, __file__, "--child", f"{model},{variant},{int(sanity)}"]
        done = subprocess.run(
            [*command, "--backend", backend], cwd=ROOT, env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            return {"error": f"process failed: {done.stderr.strip().splitlines()[-1][:160]}"}
        return json.loads(done.stdout.strip().splitlines()[-1])


def close(a: Any, b: Any) -> bool:
    import torch

    if a is None or b is None:
        return False
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)


def table(results: dict[str, dict], backend: str) -> str:
    lines = [
        "| model | sanity check | variant | graphs | eager block calls: sanity / training / "
        "validation / predict | tokens equal eager | predict logits equal eager | validation "
        "with generate() (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, result in results.items():
        model, variant, sanity = key.split(",")
        reference = results[f"{model},eager,{sanity}"]
        if result.get("error"):
            lines.append(f"| {model} | {sanity} | {variant} | failed: {result['error']} |||||")
            continue
        calls = " / ".join(
            str(result["eager_calls"].get(phase, 0))
            for phase in ("sanity", "training", "validation", "predict")
        )
        same = result["generated"] == reference["generated"]
        lines.append(
            f"| {model} | {'on' if sanity == '1' else 'off'} | {variant} | {result['graphs']} "
            f"| {calls} | {'yes' if same else 'NO'} "
            f"| {'yes' if close(result['predict_logits'], reference['predict_logits']) else 'NO'} "
            f"| {result['validation_s']:.2f} |"
        )
    return f"backend {backend}\n\n" + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--sanity", nargs="+", type=int, default=[1, 0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, variant, sanity = args.child.split(",")
        print(json.dumps(run(model, variant, sanity == "1", args.backend)))
        return
    variants = ["eager", *[v for v in args.variants if v != "eager"]]
    results = {
        f"{model},{variant},{sanity}": in_fresh_process(model, variant, bool(sanity), args.backend)
        for model in args.models
        for sanity in args.sanity
        for variant in variants
    }
    markdown = table(results, args.backend)
    save_results(args.out, f"generating_eval_{args.backend}", "cpu", markdown, results)
    print(markdown)


if __name__ == "__main__":
    main()
