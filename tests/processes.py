"""The environment for tests that start their own distributed processes."""

from __future__ import annotations

import os

#: Variables that tell a process it was launched as one rank of a group. A child that
#: inherits them joins that group instead of starting its own, and waits for peers.
LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "MASTER_",
    "TORCHELASTIC",
)


def launch_env() -> dict[str, str]:
    """This process's environment without any rank or rendezvous variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
