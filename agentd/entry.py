"""The first code the ``agentd`` command runs (``python -m agentd`` and the console script): it
records early signals (``agentd.early_signals``) before it imports the CLI, which takes a while.
"""

from __future__ import annotations

from agentd import early_signals

__all__ = ["main"]


def main() -> int:
    """The console script ``agentd``."""
    early_signals.install()
    from agentd.cli import main as cli_main

    return cli_main()
