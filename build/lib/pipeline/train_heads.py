"""`python -m pipeline.train_heads hydra medusa [overrides]`: train several kinds of heads in a row.

Each name is a file of `conf/heads/`; the config is composed exactly as for
`python -m pipeline stage=heads heads=<name> [overrides]` (same schema, defaults and overrides,
e.g. `heads.train.max_steps=200 force=true`), and the stage prepares the training splits first.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

import pipeline.schema  # noqa: F401 - registers the typed config schemas with hydra
from pipeline.graph import run
from pipeline.paths import CONF_DIR


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    names = [a for a in args if "=" not in a and not a.startswith("-")]
    overrides = [a for a in args if "=" in a]
    if "--force" in args:  # the flag of earlier versions
        overrides.append("force=true")
    if not names:
        raise SystemExit(f"usage: python -m pipeline.train_heads NAME [NAME ...] [key=value ...]; "
                         f"NAME is a file of {CONF_DIR / 'heads'}")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    for name in names:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["stage=heads", f"heads={name}", *overrides], return_hydra_config=True)
            cfg.hydra.runtime.cwd = os.getcwd()  # what hydra.main sets; the default paths hang off it
            HydraConfig.instance().set_config(cfg)
            with open_dict(cfg):  # the job sees the config without hydra's own node, as under hydra.main
                del cfg["hydra"]
            print(Path(run(cfg)))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
