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


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_nodes(command: list[str], nodes: int = 2, timeout: float = 900) -> None:
    """Run ``command`` once per simulated node, as a cluster without a scheduler starts a
    Lightning job: ``NODE_RANK`` each, one ``MASTER_ADDR`` (loopback) and ``MASTER_PORT``.
    Raises ``RuntimeError`` with every node's last output when one fails."""
    import subprocess

    port = str(free_port())
    started = []
    for node in range(nodes):
        env = launch_env() | {"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = port
        started.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for process in started:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    if any(process.returncode for process in started):
        tails = "\n".join(f"--- node {i}:\n{text[-3000:]}" for i, text in enumerate(outputs))
        raise RuntimeError(f"a node failed:\n{tails}")
