"""Published Hydra / Hydra++ / Medusa-1 heads: strict readers of their layouts (`read`) and the
heads stage's conversion of a `heads.dir` folder into the project's format, plus the export back
to the Hydra layout (`convert`)."""
