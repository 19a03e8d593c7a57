"""Record the step times that tests/test_protocol.py checks the statistic on.

    python tests/data/record_step_times.py quiet    # on a quiet machine
    python tests/data/record_step_times.py loaded   # with a second process compiling beside

The demo's tiny GPT (examples/demo_table.DEMO_SIZE) under whole-model torch.compile,
2 intra-op threads, 64 steps through a real Trainer, fresh inductor cache; the first
step (compile) is left out. Writes (merges) tests/data/step_times.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def main(condition: str) -> None:
    import lightning.pytorch as pl
    import torch

    from examples.demo_table import DEMO_SIZE
    from examples.lightning_gpt import CharDataModule, GPTModule, StepTimer

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    torch.set_num_threads(2)
    data = CharDataModule(block_size=DEMO_SIZE["block_size"], batch_size=DEMO_SIZE["batch_size"])
    sizes = {k: v for k, v in DEMO_SIZE.items() if k != "batch_size"}
    module = GPTModule(vocab_size=data.vocab_size, **sizes)
    module.model.compile()
    timer = StepTimer()
    pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=65,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    ).fit(module, data)
    path = Path(__file__).parent / "step_times.json"
    recorded = json.loads(path.read_text()) if path.exists() else {}
    recorded[condition] = [round(seconds, 5) for seconds in timer.seconds[1:]]
    path.write_text(json.dumps(recorded, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
