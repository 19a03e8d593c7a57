"""YAML configs through LightningCLI and the lightning-regions command."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml

from lightning_regions import (
    RegionalCompileDDPStrategy,
    RegionalCompileFSDPStrategy,
    RegionalCompileStrategy,
    TiedWeightsCheck,
)
from lightning_regions.cli import main
from lightning_regions.options import RegionalOptions

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "configs"


@pytest.fixture(autouse=True)
def in_repo_root(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)


def parse(*args: str):
    return main(list(args), run=False)


def test_strategy_name_in_yaml_selects_the_regional_strategy():
    cli = parse("--config", str(CONFIGS / "regional.yaml"))
    assert isinstance(cli.trainer.strategy, RegionalCompileStrategy)
    assert cli.trainer.strategy.compile_kwargs["backend"] == "inductor"
    assert any(isinstance(c, TiedWeightsCheck) for c in cli.trainer.callbacks)


def test_class_path_form_selects_the_ddp_strategy_with_ddp_arguments():
    cli = parse("--config", str(CONFIGS / "regional_ddp.yaml"))
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RegionalCompileDDPStrategy)
    assert strategy.process_group_backend == "gloo"
    assert cli.trainer.num_devices == 2


def test_fsdp_config_selects_the_fsdp2_strategy_with_its_arguments():
    cli = parse("--config", str(CONFIGS / "regional_fsdp.yaml"))
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RegionalCompileFSDPStrategy)
    assert strategy.process_group_backend == "gloo"
    assert strategy.reshard_after_forward is True
    assert strategy._save_distributed_checkpoint is False
    assert cli.trainer.num_devices == 2


def test_fsdp_strategy_name_resolves_in_yaml():
    cli = parse(
        "--config", str(CONFIGS / "regional.yaml"), "--trainer.strategy=regional_compile_fsdp"
    )
    assert isinstance(cli.trainer.strategy, RegionalCompileFSDPStrategy)


def test_nested_config_sets_the_granularity_and_a_bad_one_exits_naming_it(tmp_path, capsys):
    cli = parse("--config", str(CONFIGS / "nested.yaml"))
    assert isinstance(cli.trainer.strategy, RegionalCompileStrategy)
    assert cli.trainer.strategy.options.granularity == "nested"
    default = parse("--config", str(CONFIGS / "regional.yaml")).trainer.strategy
    assert default.options.granularity == "regions"
    config = yaml.safe_load((CONFIGS / "nested.yaml").read_text())
    config["trainer"]["strategy"]["init_args"]["granularity"] = "layers"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        parse("--config", str(path))
    assert "granularity" in capsys.readouterr().err


def test_callback_only_config_keeps_the_default_strategy():
    cli = parse("--config", str(CONFIGS / "tiecheck_only.yaml"))
    assert not isinstance(cli.trainer.strategy, RegionalCompileStrategy)
    assert any(isinstance(c, TiedWeightsCheck) for c in cli.trainer.callbacks)


def test_fit_through_the_cli_trains_with_compiled_regions(tmp_path):
    config = yaml.safe_load((CONFIGS / "regional.yaml").read_text())
    config["trainer"].update(
        strategy={
            "class_path": "lightning_regions.RegionalCompileStrategy",
            "init_args": {"backend": "eager"},
        },
        max_steps=2,
        val_check_interval=2,
        limit_val_batches=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
    )
    config["model"]["init_args"].update(n_layer=2, n_embd=16, block_size=16)
    config["data"]["init_args"].update(block_size=16, batch_size=4)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = main(["fit", "--config", str(path)])
    assert len(cli.model.losses) == 2
    assert cli.model.model.blocks[0]._compiled_call_impl is not None
    check = next(c for c in cli.trainer.callbacks if isinstance(c, TiedWeightsCheck))
    assert check.broken == []


def test_a_typo_in_init_args_exits_non_zero_with_jsonargparse_message(tmp_path, capsys):
    config = yaml.safe_load((CONFIGS / "regional_ddp.yaml").read_text())
    config["trainer"]["strategy"]["init_args"]["bakend"] = "eager"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        parse("--config", str(path))
    assert exit_info.value.code != 0
    assert "bakend" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "cls", "devices"),
    [
        ("regional_compile", RegionalCompileStrategy, 1),
        ("regional_compile_ddp", RegionalCompileDDPStrategy, 2),
        ("regional_compile_fsdp", RegionalCompileFSDPStrategy, 2),
    ],
)
def test_every_registered_name_builds_a_trainer_with_its_strategy(name, cls, devices):
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=devices, logger=False)
    assert type(trainer.strategy) is cls
    assert trainer.strategy.options == RegionalOptions()  # the registry's defaults


def test_every_registered_fabric_name_builds_its_strategy():
    from lightning.fabric import Fabric

    import lightning_regions.fabric as fabric

    for name, cls in [
        ("regional_compile", fabric.RegionalCompileStrategy),
        ("regional_compile_ddp", fabric.RegionalCompileDDPStrategy),
    ]:
        assert type(Fabric(strategy=name, accelerator="cpu", devices=1)._strategy) is cls


def test_console_script_is_installed_and_registers_names():
    command = shutil.which("lightning-regions") or str(
        Path(__import__("sys").executable).parent / "lightning-regions"
    )
    result = subprocess.run(
        [command, "fit", "--config", str(CONFIGS / "regional.yaml"), "--print_config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "regional_compile" in result.stdout


def test_console_script_fit_exits_zero(tmp_path):
    command = shutil.which("lightning-regions") or str(
        Path(__import__("sys").executable).parent / "lightning-regions"
    )
    overrides = [
        "--trainer.strategy.init_args.backend=eager",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--model.init_args.n_layer=2",
        "--model.init_args.n_embd=16",
        "--model.init_args.block_size=16",
        "--data.init_args.block_size=16",
    ]
    config = tmp_path / "regional.yaml"
    body = yaml.safe_load((CONFIGS / "regional.yaml").read_text())
    body["trainer"]["strategy"] = {
        "class_path": "lightning_regions.RegionalCompileStrategy",
        "init_args": {"backend": "eager"},
    }
    config.write_text(yaml.safe_dump(body))
    result = subprocess.run(
        [command, "fit", "--config", str(config), *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LightningCLI object" not in result.stderr


def test_albert_config_compiles_one_region_at_every_position(tmp_path):
    cli = parse("--config", str(CONFIGS / "albert.yaml"), f"--trainer.default_root_dir={tmp_path}")
    blocks = cli.model.model.blocks
    assert all(block is blocks[0] for block in blocks)
    from lightning_regions import find_regions

    (region,) = find_regions(cli.model).regions
    assert len(region.paths) == 8
