"""Which client serves which ``provider`` (RFC 0005): the one place that names them all.

Apart from ``agentd.intel.base`` so that the base of the providers does not import them; each is
imported when first built, so a daemon that uses only the scripted model never loads httpx's
providers.
"""

from __future__ import annotations

from agentd.config import Intelligence
from agentd.intel.base import Provider

__all__ = ["build_provider"]


def build_provider(intelligence: Intelligence) -> Provider:
    """A fresh client for ``intelligence`` (fresh endpoint health: used on start and every swap)."""
    if intelligence.provider == "scripted":
        from agentd.intel.scripted import ScriptedProvider

        return ScriptedProvider(intelligence)
    if intelligence.provider == "ollama":
        from agentd.intel.ollama import OllamaProvider

        return OllamaProvider(intelligence)
    if intelligence.provider == "openai":
        from agentd.intel.openai import OpenAIProvider

        return OpenAIProvider(intelligence)
    raise ValueError(f"unknown provider {intelligence.provider!r}")
