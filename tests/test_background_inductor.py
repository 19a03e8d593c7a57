"""The point of ``compile_in_background=True``, on the real inductor backend: the model
classes people write (in the training script, in a function, in a notebook cell) ship to
the child, and the switch finds the training and the validation graphs in torch's caches
(no FX-graph or AOTAutograd miss, over a variable last batch too), the first validation
after it compiles nothing, no child is left running, no warning, and the losses equal the
default mode's. Each run has a fresh ``TORCHINDUCTOR_CACHE_DIR``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "background_script.py"
NOTEBOOK = TESTS / "notebooks" / "background_compile.ipynb"

pytestmark = pytest.mark.inductor


def fresh_cache_env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))


def assert_switched_warm(result: dict) -> None:
    assert result["steps_eager"] >= 1 and result["switch_step"] == result["steps_eager"]
    counts = result["counts"]
    for phase in ("training", "after_switch"):  # from the switch on: every graph a hit
        misses = counts[phase]["fx_graph_misses"] + counts[phase]["aot_autograd_misses"]
        assert misses == 0, (phase, counts[phase])
    # the switch step loads training's forward and backward and the evaluation forward
    # (warmed at the switch), so the first validation after it compiles nothing
    assert counts["training"]["fx_graph_hits"] >= 3, counts["training"]
    assert not any(counts["validation"].values()), counts["validation"]
    # one child: a round for the first step's calls, one more for the variable last batch's
    assert len(result["pids"]) == 1 and result["rounds"] == 2, (result["pids"], result["rounds"])
    assert result["running"] == []
    ours = [w for w in result["warnings"] if w.startswith("lightning_regions")]
    assert result["messages"] == [] and ours == [], result["warnings"]
    assert result["losses"] == pytest.approx(result["default_losses"], rel=1e-4)


@pytest.mark.parametrize("where", ["script", "function"])
def test_classes_of_the_training_script_ship_and_switch_warm(tmp_path, where):
    out = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), str(out)]
    command += ["--in-function"] if where == "function" else []
    subprocess.run(command, check=True, env=fresh_cache_env(tmp_path), timeout=600)
    assert_switched_warm(json.loads(out.read_text()))


def test_classes_of_a_notebook_ship_and_switch_warm(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    out = tmp_path / "result.json"
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env = fresh_cache_env(tmp_path) | {"NOTEBOOK_TESTS": str(TESTS), "NOTEBOOK_OUT": str(out)}
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute(env=env)  # a real Jupyter kernel, with the notebook's own __main__
    assert_switched_warm(json.loads(out.read_text()))
