"""One module per pipeline stage, in `pipeline.graph.STAGE_ORDER`.

Each module names what its output depends on (`READS`: config fields; upstream stages through
their `output` functions) and builds it with library modules of `pipeline/`. `output(cfg)` returns
the stage's folder, building it (and anything upstream) only when it is missing or stale.
"""
