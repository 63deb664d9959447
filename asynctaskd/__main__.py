"""`python -m asynctaskd` runs the CLI."""

from .cli import main

raise SystemExit(main())
