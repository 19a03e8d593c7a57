"""What the strategy says about real model families, and whether it trains them right.

Each model is built from its own config (transformers, diffusers; no downloads), shrunk
to tiny widths at 12 layers, trained 3 steps through a real Trainer under plain Lightning
and under ``RegionalCompileStrategy(backend="aot_eager")``, each run in its own process.
Recorded per model: whether the losses equal plain Lightning's, the regions and their
variants, graphs, graph breaks inside regions, regions left eager or never called, and
every warning of lightning_regions, by category.

    python benchmarks/families.py                    # the named families
    python benchmarks/families.py --sweep causal-lm  # every *ForCausalLM architecture
    python benchmarks/families.py --sweep causal-lm --only llama,gpt2
    python benchmarks/families.py --sweep causal-lm --resume  # go on where one stopped

Writes ``families.{json,md}`` or ``causal_lm_sweep.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import save_results  # noqa: E402
from benchmarks.tiny_transformers import DEPTH, VOCAB, shrink  # noqa: E402

BATCH, LENGTH, STEPS = 2, 16, 3


def causal_lm(model_type: str) -> tuple[Any, str]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = shrink(CONFIG_MAPPING[model_type]())
    if getattr(config, "_experts_implementation", None) is None and model_type in MOE_TYPES:
        config._experts_implementation = "eager"  # what runs everywhere, fp32 on a CPU too
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return cls(config), "causal"


#: transformers MoE families whose default experts kernel needs bf16 on older torch/CPU.
MOE_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe"}


def named(name: str) -> tuple[Any, str]:
    """The named families: builders for the shapes the causal-LM sweep cannot reach."""
    import transformers

    t = transformers
    if name in ("gpt2", "llama", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "xlm"):
        model, kind = causal_lm(name)
        return model, kind
    if name == "mixtral_batched_mm":
        config = shrink(t.MixtralConfig())
        config._experts_implementation = "batched_mm"
        return t.MixtralForCausalLM(config), "causal"
    if name == "t5":
        config = shrink(t.T5Config(num_layers=DEPTH, num_decoder_layers=DEPTH, d_kv=16))
        config.decoder_start_token_id = 0
        return t.T5ForConditionalGeneration(config), "seq2seq"
    if name == "bart":
        return t.BartForConditionalGeneration(shrink(t.BartConfig())), "seq2seq"
    if name == "whisper":
        config = shrink(t.WhisperConfig(num_mel_bins=16, max_source_positions=8))
        return t.WhisperForConditionalGeneration(config), "speech"
    if name == "bert":
        return t.BertForMaskedLM(shrink(t.BertConfig())), "masked"
    if name == "modernbert":
        return t.ModernBertForMaskedLM(shrink(t.ModernBertConfig())), "masked"
    if name == "vit":
        config = shrink(t.ViTConfig(image_size=16, patch_size=4, num_labels=3))
        return t.ViTForImageClassification(config), "image"
    if name == "beit":
        config = shrink(t.BeitConfig(image_size=16, patch_size=4, num_labels=3))
        return t.BeitForImageClassification(config), "image"
    if name == "convnext":  # depths 3, 3, 9, 3
        config = t.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], num_labels=3)
        return t.ConvNextForImageClassification(config), "image32"
    if name == "resnet":  # ResNet-50's depths 3, 4, 6, 3
        config = t.ResNetConfig(embedding_size=8, hidden_sizes=[16, 32, 64, 128], num_labels=3)
        return t.ResNetForImageClassification(config), "image32"
    if name == "mobilenet_v2":
        config = t.MobileNetV2Config(depth_multiplier=0.25, image_size=32, num_labels=3)
        return t.MobileNetV2ForImageClassification(config), "image32"
    if name == "swin_v2":  # depths 2, 2, 6, 2
        config = t.Swinv2Config(
            image_size=32, patch_size=2, embed_dim=8, num_heads=[1, 2, 2, 4], window_size=2,
            num_labels=3,
        )  # fmt: skip
        return t.Swinv2ForImageClassification(config), "image32"
    if name == "deberta_v2":
        return t.DebertaV2ForMaskedLM(shrink(t.DebertaV2Config())), "masked"
    if name == "flux":
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=8,
            num_layers=DEPTH // 2,
            num_single_layers=DEPTH,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            axes_dims_rope=(4, 6, 6),
        )
        return model, "flux"
    if name == "dit":
        from diffusers import DiTTransformer2DModel

        model = DiTTransformer2DModel(
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            num_layers=DEPTH,
            sample_size=8,
            patch_size=2,
            num_embeds_ada_norm=10,
        )
        return model, "dit"
    raise ValueError(f"unknown family {name!r}")


FAMILIES = (
    "gpt2",
    "llama",
    "t5",
    "bart",
    "whisper",
    "bert",
    "modernbert",
    "mixtral",
    "mixtral_batched_mm",
    "qwen2_moe",
    "deepseek_v3",
    "gpt_oss",
    "vit",
    "beit",
    "convnext",
    "resnet",
    "mobilenet_v2",
    "swin_v2",
    "deberta_v2",
    "xlm",
    "flux",
    "dit",
)


def loss(model: Any, kind: str, generator: Any) -> Any:
    """One training loss of ``model`` on a random batch of its kind."""
    import torch

    def ids(low: int = 3) -> Any:
        return torch.randint(low, VOCAB, (BATCH, LENGTH), generator=generator)

    if kind in ("causal", "seq2seq", "masked"):
        tokens = ids()
        return model(input_ids=tokens, labels=tokens).loss
    if kind == "speech":
        features = torch.randn(BATCH, 16, 16, generator=generator)
        return model(input_features=features, labels=ids()).loss
    if kind in ("image", "image32"):
        side = 32 if kind == "image32" else 16
        pixels = torch.randn(BATCH, 3, side, side, generator=generator)
        return model(pixel_values=pixels, labels=torch.tensor([0, 2])).loss
    if kind == "flux":
        out = model(
            hidden_states=torch.randn(BATCH, 16, 8, generator=generator),
            encoder_hidden_states=torch.randn(BATCH, 8, 32, generator=generator),
            pooled_projections=torch.randn(BATCH, 16, generator=generator),
            timestep=torch.tensor([0.5, 0.3]),
            img_ids=torch.zeros(16, 3),
            txt_ids=torch.zeros(8, 3),
        )
        return out.sample.square().mean()
    if kind == "dit":
        out = model(
            torch.randn(BATCH, 4, 8, 8, generator=generator),
            timestep=torch.tensor([3, 7]),
            class_labels=torch.tensor([1, 4]),
        )
        return out.sample.square().mean()
    raise ValueError(kind)


def child(spec: str, steps: int = STEPS) -> dict[str, Any]:
    """Train one model both ways in this process, ``steps`` steps; the record as a dict."""
    import logging

    import lightning.pytorch as pl
    import torch

    from benchmarks.harness import quiet_trainer
    from lightning_regions import RegionalCompileStrategy, region_report

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    source, _, name = spec.partition(":")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model, self.kind = causal_lm(name) if source == "causal-lm" else named(name)
            for module in self.model.modules():  # compiled graphs draw dropout differently
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
            self.generator = torch.Generator().manual_seed(0)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            value = loss(self.model, self.kind, self.generator)
            self.losses.append(value.item())
            return value

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def fit(strategy: Any) -> tuple[Module, list[str], float]:
        module = Module()
        loader = torch.utils.data.DataLoader(range(BATCH * steps), batch_size=BATCH)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_trainer(strategy, steps=steps).fit(module, loader)
        ours = [
            f"{w.category.__name__}: {str(w.message)[:600]}"
            for w in caught
            if w.category.__module__.startswith("lightning_regions")
        ]
        return module, ours, time.perf_counter() - start

    record: dict[str, Any] = {"model": name, "source": source}

    def failed(status: str, error: Exception) -> dict[str, Any]:
        return {**record, "status": status, "error": f"{type(error).__name__}: {error}"[:300]}

    try:
        plain, _, _ = fit("auto")
    except Exception as error:
        return failed("plain fails", error)
    try:
        strategy = RegionalCompileStrategy(backend="aot_eager")
        ours, warned, seconds = fit(strategy)
    except Exception as error:
        return failed("ours fails", error)
    report = region_report(ours)
    pairs = zip(ours.losses, plain.losses, strict=True)
    differences = [abs(a - b) / max(abs(b), 1e-6) for a, b in pairs]
    by_category: dict[str, int] = {}
    for message in warned:
        category = message.split(":")[0]
        by_category[category] = by_category.get(category, 0) + 1
    return {
        **record,
        "status": "trained",
        "losses_equal": max(differences, default=0.0) <= 1e-5,
        "max_loss_difference": max(differences, default=0.0),
        "regions": len(report.rows),
        "classes": sorted({row.class_name for row in report.rows}),
        "variants": {v.class_name: len(v.variants) for v in report.variants},
        "graphs": report.graphs,
        "graph_breaks": report.graph_breaks,
        "split_classes": [entry.class_name for entry in report.breaks],
        "bounded": [entry.class_name for entry in report.per_instance if entry.bounded],
        "ran_eager": len(report.ran_eager),
        "never_called": len(report.never_called),
        "warnings": by_category,
        "warning_texts": warned,
        "seconds": round(seconds, 1),
        "steps": steps,
        # decided from step 12 (lightning_regions/gate/gate.py); "" before
        "gate": str(strategy.payoff.decision or "") if strategy.payoff else "",
    }


def run_one(spec: str, timeout: int, steps: int = STEPS) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", spec, "--steps", str(steps)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"model": spec.partition(":")[2], "status": f"timed out after {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": spec.partition(":")[2], "status": "build fails", "error": last[:300]}
    return json.loads(lines[-1])


def markdown(records: list[dict[str, Any]], title: str) -> str:
    trained = [r for r in records if r["status"] == "trained"]
    warned = [r for r in trained if r["warnings"]]
    lines = [
        f"# {title}",
        "",
        f"{len(records)} tried, {len(trained)} trained by both plain Lightning and ours; "
        f"losses equal (1e-5) in {sum(r['losses_equal'] for r in trained)}; a warning in "
        f"{len(warned)}: "
        + ", ".join(f"{r['model']} ({', '.join(r['warnings'])})" for r in warned),
        "",
        "| model | regions | variants | graphs | graph breaks | classes split | bounded | "
        "eager | not called | warnings | losses equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["status"] != "trained":
            lines.append(f"| {r['model']} | {r['status']}: {r.get('error', '')[:80]} |")
            continue
        variants = ", ".join(f"{k} {v}" for k, v in r["variants"].items()) or "-"
        warnings_seen = ", ".join(f"{k} x{v}" for k, v in r["warnings"].items()) or "none"
        lines.append(
            f"| {r['model']} | {r['regions']} ({', '.join(r['classes'])[:60]}) | {variants} | "
            f"{r['graphs']} | {r['graph_breaks']} | {', '.join(r['split_classes']) or '-'} | "
            f"{', '.join(r['bounded']) or '-'} | {r['ran_eager']} | {r['never_called']} | "
            f"{warnings_seen} | {'yes' if r['losses_equal'] else r['max_loss_difference']} |"
        )
    gated = [r for r in trained if r.get("gate")]
    if gated:
        lines += ["", "The keep-or-revert gate, on each model's steps under ours:", ""]
        lines += [f"- {r['model']}: {r['gate']}" for r in gated]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sweep", choices=["causal-lm"])
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument(
        "--steps",
        type=int,
        default=STEPS,
        help="12 or more: through the keep-or-revert gate where its turns agree (28: always)",
    )
    parser.add_argument("--resume", action="store_true", help="keep the records in --out")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.child:
        warnings.filterwarnings("ignore")
        print(json.dumps(child(args.child, args.steps)))
        return
    if args.sweep:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        names, source, stem = (
            sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
            "causal-lm",
            "causal_lm_sweep",
        )
        title = "Every transformers *ForCausalLM architecture at 12 layers"
    else:
        names, source, stem, title = list(FAMILIES), "named", "families", "Model families"
    if args.only:
        names = [name for name in names if name in args.only.split(",")]
    if args.steps != STEPS:
        stem, title = f"{stem}_{args.steps}_steps", f"{title}, {args.steps} steps"
    results = args.out / f"{stem}.json"
    done = json.loads(results.read_text()) if args.resume and results.exists() else []
    done = done["records"] if isinstance(done, dict) else done  # a finished or a cut sweep
    records = [record for record in done if record["model"] in names]
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        if any(record["model"] == name for record in records):
            continue
        record = run_one(f"{source}:{name}", args.timeout, args.steps)
        print(f"{name}: {record['status']} {record.get('warnings', '')}", flush=True)
        records.append(record)
        results.write_text(json.dumps(records, indent=1))  # a long sweep keeps what it has
    records.sort(key=lambda record: names.index(record["model"]))
    save_results(args.out, stem, "cpu", markdown(records, title), {"records": records})
    print(markdown(records, title))


if __name__ == "__main__":
    main()
