"""The bank stage's library: `build` writes a TopologyBank (trees, buffers, figures, fitted
policies, oracle bound, plots) from the time, recalibrate and grow stages' outputs; `selection`
says which trees it keeps."""
