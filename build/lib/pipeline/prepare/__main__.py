"""`python -m pipeline.prepare ...`: see `pipeline.prepare.cli`."""

from pipeline.prepare.cli import main

main()
