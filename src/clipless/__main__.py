"""``python -m clipless``: the ``clipless`` command (:mod:`clipless.cli`)."""

from clipless.cli import main

raise SystemExit(main())
