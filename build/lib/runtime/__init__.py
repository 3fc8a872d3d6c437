"""EntMTP runtime: a slim tree-speculative decoder for Llama-family models.

Depends on torch, numpy, safetensors and a tokenizer only. Never imports `pipeline`,
hydra-core, pandas or matplotlib (a test enforces this).
"""

__all__ = ["EntMTP", "Generation"]


def __getattr__(name: str):
    # lazy, so `import runtime.tree` does not load the model code
    if name in __all__:
        from runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
