from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))  # examples/ as a package

import process_state

settings.register_profile("default", max_examples=200, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

#: The files that take longest (``pytest --durations=0``, 2 workers on 2 cores), started
#: first by ``make test``'s two workers so that they finish together rather than one of
#: them running a long file alone at the end. Only the order changes, never a result; a
#: file not named here runs after these, in pytest's order.
LONGEST_FILES_FIRST = (
    "test_restarts.py",
    "test_ray.py",
    "test_deepspeed.py",
    "test_multi_node.py",
    "test_background_inductor.py",
    "test_nested.py",
    "test_payoff.py",
    "test_fsdp.py",
    "test_diagnosis.py",
    "test_generation.py",
    "test_block_variants.py",
    "test_ddp.py",
    "test_tensor_parallel.py",
    "test_warm_start.py",
    "test_dynamo_passthrough.py",
    "test_demo_table.py",
    "test_fabric.py",
    "test_background.py",
    "test_artifact_security.py",
    "test_readme.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


@pytest.fixture(autouse=True, scope="session")
def own_config_and_cache_home(tmp_path_factory):
    """The artifact signing key, the cache home and torch's compile cache (the strategies'
    default) of the test session live in temporary folders: the suite neither reads a
    warm cache of an earlier session nor leaves one."""
    homes = {
        "XDG_CONFIG_HOME": "config",
        "XDG_CACHE_HOME": "cache",
        "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    }
    previous = {name: os.environ.get(name) for name in homes}
    for name, folder in homes.items():
        os.environ[name] = str(tmp_path_factory.mktemp(folder))
    os.environ.pop("LIGHTNING_REGIONS_ARTIFACT_KEY", None)
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty dynamo caches, so graph counts are its own.

    ``gc.collect()`` ends the observation windows of the last test's dropped models
    (a model and its tracker form a cycle), so that graph wrappers come off the call
    path as they would in a process that trains one model.
    """
    gc.collect()
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def leaves_the_process_as_it_found_it(request):
    """Fail a test that leaves a process-wide mode, flag, hook or setting changed
    (``process_state``): the later tests of its worker would run differently. Its value
    is put back where it can be, so only the test that left it fails."""
    before = process_state.process_state()
    yield
    left = process_state.changes(before, process_state.process_state())
    if left:  # models the test dropped put a setting back when collected (Fabric's)
        gc.collect()  # only then: a full collection takes about 0.2 s in a worker
        left = process_state.changes(before, process_state.process_state())
    if left:
        process_state.restore(before)
        pytest.fail(f"{request.node.nodeid} left the process changed: {'; '.join(left)}")


@pytest.fixture
def lightning_may_set_omp_num_threads():
    """For a test that sets a Lightning distributed strategy up in its own process:
    Lightning sets ``OMP_NUM_THREADS`` there where it is unset, with
    ``torch.set_num_threads`` (``fabric.utilities.distributed._set_num_threads_if_needed``,
    kept for the user's whole job). That call turns MKL's dynamic adjustment off, and ATen
    may repeat it later (``process_state.put_back_threads``), so the flag may not stay put
    back for the worker's later tests: here the variable is set to the present count for
    the test (Lightning then sets nothing) and ends with it. Nothing is put back after it:
    where Lightning changed the count or the flag after all, ``leaves_the_process_as_it_
    found_it`` fails the test."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    yield
    if previous is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = previous


class CountingBackend:
    """A ``torch.compile`` backend that counts graphs and runs them eagerly."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


@pytest.fixture
def counting_backend() -> CountingBackend:
    return CountingBackend()
