"""agentd: run LLM agent conversations for many clients and hot-swap the model under them."""

__version__ = "0.1.0"
