"""``python -m tierfs.cli``: the ``tierfs`` command."""

from . import main

raise SystemExit(main())
