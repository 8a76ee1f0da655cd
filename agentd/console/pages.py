"""What the console's pages show, apart from HTTP: paging, the navigation, and the templates.

The templates (``templates/``, Jinja2 with autoescape on) render the API's own views
(``agentd.views``): nothing here re-reads the store or re-derives what an operation answers.
Large lists — a transcript, a session's turns — are cut into pages (``paginate``) and only one
page is rendered.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar

import jinja2
import msgspec

from agentd.errors import BadInput
from agentd.views import ApprovalView, UsageView, iso

__all__ = [
    "APPROVALS_PAGE",
    "NAV",
    "RECENT_DECIDED",
    "SESSION_PAGE",
    "SESSION_STATES",
    "TRANSCRIPT_PAGE",
    "TURNS_PAGE",
    "TURN_COLUMNS",
    "NavItem",
    "Paged",
    "cost_text",
    "edited_arguments",
    "environment",
    "newest_decided",
    "page_number",
    "paginate",
    "pretty_json",
]

T = TypeVar("T")

#: Sessions per page of the sessions list; transcript entries and turns per page of a session.
SESSION_PAGE = 50
TRANSCRIPT_PAGE = 50
TURNS_PAGE = 20
#: The states the sessions list filters by (the store's, ``GET /v1/sessions?state=``).
SESSION_STATES = ("idle", "running", "failed", "closed")
#: Pending approvals per page of the approvals page; how many decided ones it shows, newest first.
APPROVALS_PAGE = 50
RECENT_DECIDED = 20


#: The columns of a session's turns table: (name, heading). ``templates/session.html`` renders a
#: ``td.col-<name>`` for each; ``static/console.js`` fills a live row's cells by name.
TURN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("turn", "turn"),
    ("status", "status"),
    ("models", "models"),
    ("steps", "steps"),
    ("restarts", "restarts"),
    ("input_tokens", "input tokens"),
    ("output_tokens", "output tokens"),
    ("cost", "cost"),
    ("started", "started"),
    ("ended", "ended"),
    ("discarded", "discarded runs"),
    ("error", "error"),
)


class NavItem(msgspec.Struct, frozen=True):
    """A page in the console's navigation: its key (the template's ``active``), path and label."""

    key: str
    path: str
    label: str


#: The navigation, in order. A new page (e.g. approvals) is a route in ``routes.py``, a template,
#: and an item here.
NAV: tuple[NavItem, ...] = (
    NavItem("overview", "/console/", "Overview"),
    NavItem("sessions", "/console/sessions", "Sessions"),
    NavItem("approvals", "/console/approvals", "Approvals"),
    NavItem("reloads", "/console/reloads", "Reloads"),
)


class Paged(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    """One page of a list: its items, its number (1-based), how many pages, and where it starts."""

    items: list[T]
    number: int
    count: int
    first_index: int  # the 0-based index of the page's first item in the whole list
    total: int

    @property
    def previous(self) -> int | None:
        return self.number - 1 if self.number > 1 else None

    @property
    def next(self) -> int | None:
        return self.number + 1 if self.number < self.count else None


def paginate(items: Sequence[T], number: int | None, size: int) -> Paged[T]:
    """Page ``number`` (1-based; None or past the end: the last page, where the newest items are)
    of ``items`` in pages of ``size``."""
    count = max(1, -(-len(items) // size))
    chosen = count if number is None or number > count else max(1, number)
    start = (chosen - 1) * size
    return Paged(
        items=list(items[start : start + size]), number=chosen, count=count, first_index=start, total=len(items)
    )


def page_number(text: str | None) -> int | None:
    """A ``?page=`` value: a positive whole number, else None (the default page)."""
    if text is None or not text.isascii() or not text.isdigit() or int(text) < 1:
        return None
    return int(text)


def pretty_json(value: Any) -> str:
    """``value`` as indented JSON (tool call arguments), for a ``<pre>``."""
    return json.dumps(msgspec.to_builtins(value), indent=2, ensure_ascii=False, sort_keys=True)


def cost_text(usage: UsageView) -> str:
    """A usage's cost as shown: ``amount currency``; ``unpriced`` when model calls were made but a
    part has no price (RFC 0011: null, never 0); ``—`` when no model call was made."""
    if usage.cost is not None:
        return f"{usage.cost.amount} {usage.cost.currency}"
    return "unpriced" if usage.requests else "—"


def edited_arguments(text: str | None, original: dict[str, Any]) -> Any | None:
    """The arguments an approval form's textarea asks for: None when left empty or unchanged (the
    call runs as the model asked), else the parsed JSON (the operation checks it against the
    tool's schema). Text that is not JSON is refused here, naming where it broke."""
    if text is None or not text.strip():
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"the edited arguments are not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            code="bad_arguments",
        ) from None
    return None if parsed == original else parsed


def newest_decided(approvals: Iterable[ApprovalView], count: int) -> list[ApprovalView]:
    """The newest ``count`` decided approvals of ``approvals`` (given oldest first), newest first."""
    kept: deque[ApprovalView] = deque(maxlen=count)
    kept.extend(a for a in approvals if a.status != "pending")
    return list(reversed(kept))


def environment() -> jinja2.Environment:
    """The templates, from the package (``agentd/console/templates``), autoescaped."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("agentd.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a name a template misspells is an error, not an empty cell
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["pretty_json"] = pretty_json
    env.filters["iso"] = iso
    env.filters["cost"] = cost_text
    env.globals["NAV"] = NAV
    env.globals["turn_columns"] = TURN_COLUMNS
    return env
