"""EntMTP offline pipeline: staged jobs that build a per-task TopologyBank."""
