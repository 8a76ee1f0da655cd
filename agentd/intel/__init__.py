"""Intelligence providers: the clients that call a model. See ``build_provider``."""

from agentd.intel.base import Completion, CompletionRequest, IntelError, Provider
from agentd.intel.providers import build_provider

__all__ = ["Completion", "CompletionRequest", "IntelError", "Provider", "build_provider"]
