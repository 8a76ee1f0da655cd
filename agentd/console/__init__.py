"""The operator console (RFC 0000 §12): HTML pages served by the daemon at ``/console/`` on its TCP
listener, over the API's own operations and views.

``build_console`` makes the app that ``agentd.api.build_app`` mounts. Its parts: ``auth`` (the
login cookie and CSRF tokens, keyed by the API token), ``pages`` (paging, navigation, the
Jinja2 templates), ``routes`` (the pages and forms), ``templates/`` and ``static/`` (the CSS and
the one script; package data, nothing from elsewhere).
"""

from __future__ import annotations

from agentd.console.routes import build_console

__all__ = ["build_console"]
