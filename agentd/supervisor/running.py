"""What the daemon runs now: the config generation, its swap policy, and whether it is draining.

One object, read by everything that needs the running config (the turn runner, the reload, the
API's operations, replica membership) and changed by two only: a reload (``agentd.supervisor.reload``)
applies a new generation, a drain sets ``draining``. It also says what a child is given: its
environment, its ``Spawn`` and the ``SwapIntel`` of the running generation.
"""

from __future__ import annotations

import os
from pathlib import Path

from agentd.config import (
    Config,
    ConfigError,
    PolicyChoice,
    effective_intelligence,
    intelligence_map,
    quickstart_config,
)
from agentd.environment import child_environment, mcp_secrets, passed_through
from agentd.obs import Metrics
from agentd.otel import telemetry_environment
from agentd.protocol import ChildEnv, Spawn, SwapIntel
from agentd.supervisor.options import DaemonOptions

__all__ = ["Running", "load_daemon_config"]


def load_daemon_config(path: Path | None) -> Config:
    """The config file, or the built-in quickstart when no file is given. Raises ConfigError.

    Start-up and every reload validate the file exactly as ``agentd check-config`` does
    (``validate_config_file``: schema, tools resolved as a child resolves them, the wire), so a
    config that passes is applied whole and one that fails changes nothing. Bounded: the read
    times out, and the tool check by the new config's ``spawn_timeout``.
    """
    if path is None:
        return quickstart_config()
    from agentd.validate import validate_config_file

    # Children get our environment without the API token; the tool check gets the same.
    config, issues = validate_config_file(path, environ=os.environ)
    if config is None:
        raise ConfigError(issues, str(path))
    return config


class Running:
    """The running config generation (numbered from 1), its policy, the metrics, and the drain flag."""

    def __init__(self, options: DaemonOptions, config: Config, policy: PolicyChoice) -> None:
        self.options = options
        self.config = config
        self.policy = policy
        self.generation = 1
        self.draining = False
        self.metrics = Metrics()
        self.metrics.generation.set(1)

    def apply(self, config: Config, policy: PolicyChoice) -> None:
        """Run ``config`` under ``policy`` from now on: the next generation."""
        self.config, self.policy = config, policy
        self.generation += 1
        self.metrics.generation.set(self.generation)

    def child_env(self) -> dict[str, str]:
        """The environment a child starts with: an allowlist, never the daemon's whole environment."""
        env = child_environment(os.environ, self.config)
        env["AGENTD_LOG_LEVEL"] = self.options.log_level
        return env

    def spawn_frame(self, child_id: str) -> Spawn:
        """The Spawn for a new child: always the newest generation."""
        return Spawn(
            child_id=child_id,
            generation=self.generation,
            policy=self.policy.policy,
            config=self.config,
            secrets=ChildEnv(values=mcp_secrets(os.environ, self.config)),
            telemetry=ChildEnv(values=telemetry) if (telemetry := telemetry_environment(os.environ)) else None,
        )

    def swap_frame(self) -> SwapIntel:
        """The SwapIntel describing the running generation (its whole config included)."""
        return SwapIntel(
            generation=self.generation,
            policy=self.policy.policy,
            intelligence=intelligence_map(self.config),
            limits=self.config.limits,
            config=self.config,
            env=ChildEnv(values=passed_through(os.environ, self.config)),
            secrets=ChildEnv(values=mcp_secrets(os.environ, self.config)),
        )

    def model_of(self, assistant: str, fallback: str) -> str:
        """The running generation's model for ``assistant`` (``fallback`` if the config no longer has it)."""
        try:
            return effective_intelligence(self.config, assistant).model
        except KeyError:
            return fallback
