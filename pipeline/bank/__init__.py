"""The bank stage's library: `write` builds a TopologyBank (trees, buffers, figures, fitted policies,
oracle bound, plots) from the time, recalibrate and grow stages' outputs; `selection` says which
trees it keeps, `policies` fits the per-step policies by exact replay, and `dynamic` fits EntMTP-dyn."""
