"""The README's quickstart, as written: each block marked ``<!-- quickstart... -->`` runs
pasted into a fresh file in a fresh folder, and the support table agrees with
``setup.cfg``."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_regions import RegionalCompileStrategy, TiedWeightsCheck

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def snippet(marker: str) -> str:
    found = re.search(rf"<!-- {marker} -->\n```\w+\n(.*?)\n```", README, re.DOTALL)
    assert found, f"no block marked {marker} in README.md"
    return found.group(1)


def run_pasted(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(code + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not our checkout
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )


@pytest.mark.inductor  # the quickstart uses the default backend, inductor
def test_the_quickstart_trains_a_users_own_model_as_written(tmp_path):
    done = run_pasted(tmp_path, snippet("quickstart"))
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "regional compile: 12 region(s)" in output
    assert "0 region(s) called without a compiled call" in output
    assert "tie check passed" in output


def test_the_fabric_quickstart_runs_as_written(tmp_path):
    done = run_pasted(tmp_path, snippet("quickstart-fabric"))
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_yaml_quickstart_builds_the_strategy_and_the_tie_check(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text(snippet("quickstart-yaml") + "\n")
    assert yaml.safe_load(config.read_text())["trainer"]["strategy"]
    cli = LightningCLI(
        BoringModel, args=["--config", str(config), "--trainer.accelerator=cpu"], run=False
    )
    assert isinstance(cli.trainer.strategy, RegionalCompileStrategy)
    assert cli.trainer.strategy.options.backend == "inductor"
    assert any(isinstance(c, TiedWeightsCheck) for c in cli.trainer.callbacks)


def test_the_support_table_agrees_with_setup_cfg():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    python = setup["options"]["python_requires"].strip()
    assert python == ">=3.11" and "| Python | 3.11+" in README
    requires = setup["options"]["install_requires"].replace(" ", "")
    for name in ("torch", "lightning"):
        declared = re.search(rf"^{name}([<>=!][^\n]*)$", requires, re.MULTILINE).group(1)
        assert f"`{name}{declared}`" in README, name
    ruff = (ROOT / "ruff.toml").read_text()
    assert 'target-version = "py311"' in ruff


def test_the_support_table_names_the_versions_ci_runs():
    pins = dict(re.findall(r"^(\w+)==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M))
    ci = (ROOT / ".ci" / "run").read_text()
    rows = {line.split("|")[1].strip(): line for line in README.splitlines() if line[:2] == "| "}
    expected = {
        "torch": [pins["torch"], *re.findall(r"\bTORCH=(\S+)", ci)],
        "Lightning": [pins["lightning"], *re.findall(r"\bLIGHTNING=(\S+)", ci)],
        "transformers": re.findall(r"\bTRANSFORMERS=(\S+)", ci),
    }
    for name, versions in expected.items():
        assert versions and all(version in rows[name] for version in versions), name


def test_the_options_table_is_made_from_options_py():
    from lightning_regions.options import options_table

    table = re.search(r"<!-- options -->\n(.*?)\n<!-- /options -->", README, re.DOTALL)
    assert table, "no <!-- options --> block in README.md"
    assert table.group(1) == options_table(), (
        "README.md's options table differs from options.py: paste the output of "
        "`python -c 'from lightning_regions.options import options_table; "
        "print(options_table())'` between its options markers"
    )


def test_the_benchmark_readme_names_every_script_make_bench_runs():
    bench_target = (ROOT / "Makefile").read_text().split("\nbench:")[1].split("\n\n")[0]
    scripts = set(re.findall(r"benchmarks/(\w+\.py)", bench_target))
    listing = next(
        line
        for line in (ROOT / "benchmarks" / "README.md").read_text().splitlines()
        if line.startswith("The scripts `make bench` runs")
    )
    assert len(scripts) > 5, scripts
    assert [s for s in sorted(scripts) if f"`{s}`" not in listing] == []
