"""What the HTTP API serves (``Service``): the daemon's operations, as the routes call them.

The daemon's composition root gives the supervisor (``agentd.supervisor.core.Supervisor``); the
native routes (``agentd.api``) and the OpenAI-compatible ones (``agentd.door``) call it alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from anyio.streams.memory import MemoryObjectReceiveStream

from agentd.config import Config
from agentd.messages import Message
from agentd.supervisor.idempotency import Claim, Replay
from agentd.views import (
    Accepted,
    ApprovalView,
    MessageResult,
    ParkedTurn,
    PostMessage,
    ReloadResult,
    ReloadView,
    SessionSummary,
    SessionView,
    StatusView,
    UsageReport,
)

__all__ = ["Claim", "Replay", "Service"]


class Service(Protocol):
    """What the API serves: the daemon's operations."""

    @property
    def config(self) -> Config:
        """The running config (the message size limit, the assistants)."""

    def ready(self) -> list[str]:
        """Reasons the daemon is not ready (empty = ready)."""

    async def status(self) -> StatusView: ...
    async def reload(self) -> ReloadResult: ...
    async def metrics_text(self) -> bytes: ...
    async def create_session(
        self,
        assistant_name: str | None,
        *,
        session_id: str | None = None,
        resumed: bool = False,
        seeded: Sequence[Message] = (),
        opener: bool = True,
    ) -> SessionView: ...
    async def list_sessions(
        self, *, limit: int = 100, after: str | None = None, state: str | None = None, assistant: str | None = None
    ) -> list[SessionSummary]: ...
    async def reloads(self, limit: int = 100) -> list[ReloadView]: ...
    async def get_session(self, session_id: str) -> SessionView: ...
    async def session_of_turn(self, turn_id: str) -> str: ...
    async def send_message(
        self,
        session_id: str,
        body: PostMessage,
        *,
        turn_id: str | None = None,
        resumed: bool = False,
        trace: Mapping[str, str] | None = None,
    ) -> MessageResult | Accepted: ...
    async def usage(
        self, group_by: str, *, since: float | None, until: float | None, limit: int, after: str | None = None
    ) -> UsageReport: ...
    async def subscribe(self, session_id: str) -> MemoryObjectReceiveStream[tuple[str, dict[str, Any]]]: ...
    def unsubscribed(self, session_id: str) -> None: ...
    async def cancel(self, session_id: str) -> str: ...
    async def close_session(self, session_id: str) -> SessionSummary: ...
    async def list_approvals(
        self, *, status: str | None = None, session: str | None = None, limit: int = 100, after: str | None = None
    ) -> list[ApprovalView]: ...
    async def get_approval(self, approval_id: str) -> ApprovalView: ...
    async def decide_approval(
        self, approval_id: str, decision: str, reason: str | None, arguments: object | None
    ) -> ApprovalView: ...
    async def parked_turn(self, session_id: str, turn_id: str, first_seq: int) -> ParkedTurn | None: ...
    async def claim_key(self, scope: str, key: str, fingerprint: str) -> Claim | Replay: ...
    async def answer_key(self, claim: Claim, status: int, answer: bytes, headers: dict[str, str]) -> None: ...
    async def release_key(self, claim: Claim) -> None: ...
