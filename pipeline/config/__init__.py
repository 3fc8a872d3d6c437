"""The pipeline config: its typed schema, registered with hydra (`schema`), and the start-up
validation that fails in seconds, before any long work (`validate`)."""
