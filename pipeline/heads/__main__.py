"""`python -m pipeline.heads hydra medusa [overrides]`: train several kinds of heads in a row.

Each name is a file of `conf/heads/`; the config is composed exactly as for
`python -m pipeline stage=heads heads=<name> [overrides]` (same schema, defaults and overrides,
e.g. `heads.train.max_steps=200 force=true`), and the stage prepares the training splits first.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from pipeline.graph import compose_cfg, run
from pipeline.paths import CONF_DIR


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    names = [a for a in args if "=" not in a and not a.startswith("-")]
    overrides = [a for a in args if "=" in a]
    flags = [a for a in args if a.startswith("-")]
    if flags:
        raise SystemExit(f"unknown option(s) {' '.join(flags)}: settings are key=value overrides (e.g. force=true)")
    if not names:
        raise SystemExit(f"usage: python -m pipeline.heads NAME [NAME ...] [key=value ...]; "
                         f"NAME is a file of {CONF_DIR / 'heads'}")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    for name in names:
        print(Path(run(compose_cfg(["stage=heads", f"heads={name}", *overrides]))))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
