"""``python -m agentd`` is the ``agentd`` command."""

from agentd.entry import main

raise SystemExit(main())
