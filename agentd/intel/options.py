"""Which provider options a provider can take: a pure check for config validation (RFC 0005 §3).

A provider refuses to be built (scripted) or to call (the HTTP providers) with an option of the
wrong type; validation finds it first, with the key, so a config that passes never gives a child
a provider it cannot build.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ["option_errors"]


def option_errors(provider: str, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, message)`` for every option ``provider`` cannot take; other keys pass through."""
    if provider == "scripted":
        from agentd.intel.scripted import ScriptedOptions

        errors: list[tuple[str, str]] = []
        for key in ScriptedOptions.__struct_fields__:
            if key in options:
                try:
                    msgspec.convert({key: options[key]}, ScriptedOptions)
                except msgspec.ValidationError as exc:
                    errors.append((key, str(exc).split(" - at ", 1)[0]))
        return errors
    # ollama, openai: agentd's own keys (stream, timeouts) are read by agentd; the rest go to the server.
    from agentd.intel.wire import AGENTD_OPTIONS, OptionError, call_options

    errors = []
    for key in sorted(AGENTD_OPTIONS):
        if key in options:
            try:
                call_options({key: options[key]})
            except OptionError as exc:
                errors.append((key, str(exc).removeprefix(f"options.{key}: ")))
    return errors
