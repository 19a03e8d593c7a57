"""``regional_strategy``: any Lightning or Fabric strategy class with the regions, and
the FSDP1 and DeepSpeed strategies' refusals where Lightning refuses (a CPU here)."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import data, gpt, trainer
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_regions.fabric as regional_fabric
from examples.fabric_gpt import train
from lightning_regions import (
    RegionalCompileDDPStrategy,
    RegionalCompileDeepSpeedStrategy,
    RegionalCompileFSDP1Strategy,
    RegionalCompileFSDPStrategy,
    RegionalCompileMixin,
    RegionalCompileStrategy,
    TiedWeightsCheck,
    region_report,
    regional_strategy,
)


@pytest.mark.parametrize(
    ("lightning", "ours"),
    [
        (SingleDeviceStrategy, RegionalCompileStrategy),
        (DDPStrategy, RegionalCompileDDPStrategy),
        (ModelParallelStrategy, RegionalCompileFSDPStrategy),
        (FSDPStrategy, RegionalCompileFSDP1Strategy),
        (DeepSpeedStrategy, RegionalCompileDeepSpeedStrategy),
        (FabricDDPStrategy, regional_fabric.RegionalCompileDDPStrategy),
        (FabricSingleDeviceStrategy, regional_fabric.RegionalCompileStrategy),
        (RegionalCompileDDPStrategy, RegionalCompileDDPStrategy),
    ],
)
def test_a_class_we_have_a_strategy_for_gives_that_strategy(lightning, ours):
    assert regional_strategy(lightning) is ours


@pytest.fixture
def process_group_destroyed_after():
    """A one-device DDP fit initialises torch's default process group in this process and
    Lightning leaves it there: destroy it, so that a later test file on this worker (the
    FSDP2 tests) can make its own."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.usefixtures("process_group_destroyed_after", "lightning_may_set_omp_num_threads")
def test_a_ddp_subclass_defined_in_a_function_trains_compiled_and_equal_to_itself(tmp_path):
    class ClusterDDP(DDPStrategy):  # a cluster's own DDP, with an argument of its own
        def __init__(self, *, site: str = "here", **kwargs) -> None:
            super().__init__(**kwargs)
            self.site = site
            self.setups = 0

        def setup_environment(self) -> None:
            self.setups += 1
            super().setup_environment()

    Regional = regional_strategy(ClusterDDP)
    assert Regional is regional_strategy(ClusterDDP)  # one class per base
    assert Regional.__name__ == "RegionalClusterDDP"
    assert Regional.__mro__[1:3] == (RegionalCompileDDPStrategy, RegionalCompileMixin)
    assert Regional.wraps_in_ddp  # a DDP subclass keeps each region one graph under DDP
    parameters = inspect.signature(Regional).parameters
    assert {"backend", "compile_in_background", "process_group_backend"} <= set(parameters)
    strategy = Regional(backend="aot_eager", site="there", process_group_backend="gloo")
    assert isinstance(strategy, ClusterDDP) and strategy.site == "there"

    compiled, plain = gpt(), gpt()
    plain.load_state_dict(compiled.state_dict())
    check = TiedWeightsCheck()
    trainer(tmp_path, strategy, callbacks=[check]).fit(compiled, data())
    own = ClusterDDP(process_group_backend="gloo")
    trainer(tmp_path, own).fit(plain, data())
    assert strategy.setups == own.setups == 1  # its own hooks still run
    assert compiled.losses == pytest.approx(plain.losses, rel=1e-5)
    assert check.broken == []
    report = region_report(compiled)
    assert len(report.rows) == 2 and not report.never_ran_compiled
    for (name, p), (_, q) in zip(
        compiled.named_parameters(), plain.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_a_strategy_of_another_engine_gets_the_plain_mixin(tmp_path):
    class MySingleDevice(SingleDeviceStrategy):
        pass

    Regional = regional_strategy(MySingleDevice)
    assert Regional.__mro__[1] is RegionalCompileMixin
    compiled, plain = gpt(), gpt()
    plain.load_state_dict(compiled.state_dict())
    trainer(tmp_path, Regional(device="cpu", backend="aot_eager")).fit(compiled, data())
    trainer(tmp_path, MySingleDevice(device="cpu")).fit(plain, data())
    assert compiled.losses == pytest.approx(plain.losses, rel=1e-5)
    assert not region_report(compiled).never_ran_compiled


def test_a_fabric_strategy_subclass_compiles_in_a_fabric_loop():
    class MyFabricStrategy(FabricSingleDeviceStrategy):
        pass

    Regional = regional_strategy(MyFabricStrategy)
    assert Regional.__mro__[1] is regional_fabric.RegionalCompileStrategy
    strategy = Regional(device=torch.device("cpu"), backend="aot_eager")
    model, losses = train(Fabric(accelerator="cpu", devices=1, strategy=strategy), steps=3)
    _, plain_losses = train(Fabric(accelerator="cpu", devices=1), steps=3)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert not region_report(model.module).never_ran_compiled


@pytest.mark.parametrize(
    ("base", "message"),
    [
        (DDPStrategy(), "the class, not an instance"),
        (torch.nn.Module, "pass a strategy class"),
        (FabricDeepSpeedStrategy, "sets up the module and its optimizers together"),
    ],
)
def test_what_is_not_a_strategy_class_we_can_compose_raises_naming_it(base, message):
    with pytest.raises(TypeError, match=message):
        regional_strategy(base)


# --- FSDP1 and DeepSpeed: GPU-only, refused on a CPU as Lightning refuses ---------------


def refusal(strategy, **kwargs) -> str:
    import lightning.pytorch as pl

    with pytest.raises(Exception) as raised:  # any type: we compare Lightning's own
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, **kwargs)
    return f"{type(raised.value).__name__}: {raised.value}"


def test_fsdp1_on_a_cpu_is_refused_at_the_trainer_in_lightnings_words():
    # Lightning names the accelerator flag ('cpu'); we see the accelerator it made.
    lightning = refusal("fsdp").replace("`fsdp`", "`regional_compile_fsdp1`")
    for ours in ("regional_compile_fsdp1", RegionalCompileFSDP1Strategy(backend="eager")):
        said = refusal(ours)
        assert said.replace("=CPUAccelerator()`", "='cpu'`") == lightning
        assert said.startswith("ValueError: The strategy `regional_compile_fsdp1` requires a GPU")


@pytest.mark.usefixtures("lightning_may_set_omp_num_threads")
def test_deepspeed_is_refused_as_lightning_refuses_it():
    try:
        import deepspeed  # noqa: F401
    except ImportError:  # Lightning refuses in the constructor
        with pytest.raises(MisconfigurationException) as lightning:
            DeepSpeedStrategy()
        with pytest.raises(MisconfigurationException) as ours:
            RegionalCompileDeepSpeedStrategy(stage=3)
        assert str(ours.value) == str(lightning.value)
        assert refusal("regional_compile_deepspeed_stage_3") == refusal("deepspeed_stage_3")
    else:  # installed: Lightning refuses a CPU when fit sets the strategy up, so do we
        lightning = fit_refusal("deepspeed")
        assert lightning.startswith("RuntimeError: The DeepSpeed strategy is only supported on")
        assert fit_refusal("regional_compile_deepspeed_stage_3") == lightning
        assert fit_refusal(RegionalCompileDeepSpeedStrategy(stage=3)) == lightning


def fit_refusal(strategy) -> str:
    from helpers import data, gpt
    from helpers import trainer as make_trainer

    with pytest.raises(Exception) as raised:  # any type: we compare Lightning's own
        make_trainer(None, strategy, 1).fit(gpt(), data())
    return f"{type(raised.value).__name__}: {raised.value}"


@pytest.mark.parametrize("cls", [RegionalCompileFSDP1Strategy, RegionalCompileDeepSpeedStrategy])
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"compile_in_background": True}, "compile_in_background"),
        ({"granularity": "nested"}, "nested"),
    ],
)
def test_fsdp1_and_deepspeed_refuse_what_they_cannot_take_naming_it(cls, option, message):
    with pytest.raises(ValueError, match=message):
        cls(**option)


def test_fsdp1_refuses_flat_parameters():
    with pytest.raises(ValueError, match="use_orig_params=False"):
        RegionalCompileFSDP1Strategy(use_orig_params=False)
    assert RegionalCompileFSDP1Strategy().kwargs["use_orig_params"] is True
