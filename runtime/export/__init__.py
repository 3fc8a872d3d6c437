"""Exports for serving engines: the per-batch-size serving schedule a bank chose (`schedule`) and
its formats for vLLM, TensorRT-LLM, SGLang and JSON (`engines`)."""
