"""The GPU check (`make gpu-check`): `check` runs it with the machine's own Python and torch,
`measure` holds its measurements on a random-weight model of a given shape, `cuda_graphs` captures
tree verify steps as CUDA graphs, and `bank_check` builds and decodes real banks on a GPU."""
