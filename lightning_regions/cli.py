"""The ``lightning-regions`` command: LightningCLI with the regional strategies registered.

Importing this package registers ``"regional_compile"`` and ``"regional_compile_ddp"``,
so a config can say ``trainer.strategy: regional_compile`` or give the class path.
Like ``python -m``, the current directory is importable, so configs can name the
model and data classes of the project the command runs in.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Run LightningCLI in subclass mode: the config names the model and data classes.

    With ``run=False`` the config is parsed and instantiated, and no subcommand runs.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def command() -> None:
    """The console script: run, and exit 0 on success (``main`` returns the CLI object,
    which ``sys.exit`` would print and turn into status 1)."""
    main()


if __name__ == "__main__":
    command()
