"""EntMTP runtime: a slim tree-speculative decoder for Llama-family models.

Depends on torch, numpy, safetensors and a tokenizer only. Never imports `pipeline`,
hydra-core, pandas or matplotlib (a test enforces this).
"""
