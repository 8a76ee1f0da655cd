"""What the console's pages show, apart from HTTP: paging, the navigation, and the templates.

The templates (``templates/``, Jinja2 with autoescape on) render the API's own views
(``agentd.views``): nothing here re-reads the store or re-derives what an operation answers.
Large lists — a transcript, a session's turns — are cut into pages (``paginate``) and only one
page is rendered.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import jinja2
import msgspec

from agentd.views import iso

__all__ = [
    "NAV",
    "SESSION_PAGE",
    "SESSION_STATES",
    "TRANSCRIPT_PAGE",
    "TURNS_PAGE",
    "TURN_COLUMNS",
    "NavItem",
    "Paged",
    "environment",
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
    env.globals["NAV"] = NAV
    env.globals["turn_columns"] = TURN_COLUMNS
    return env
