"""The OpenAI-compatible door (RFC 0010): the official OpenAI SDKs as agentd clients.

Routes under ``/v1/models``, ``/v1/chat/completions``, ``/v1/responses`` and
``/v1/conversations`` speak OpenAI's shapes over agentd's own operations: the sessions behind
them are ordinary sessions, the turns ordinary turns. ``shapes`` holds the bodies, ``outcome``
the pure mapping of turns to OpenAI's objects (the status table of RFC 0010 §3), ``errors`` the
error shape, and ``chat``, ``responses``, ``conversations``, ``models`` the handlers that
``agentd.api``'s route table serves.
"""
