"""Host memory peak while loading a model, as a multiple of the size of its weights.

    python -m pipeline.benchmarks.load_memory [--model DIR] [--random-mb 450] [--dtype float32]

Each load runs in a fresh child process, which reads its resident set (VmRSS in /proc/self/status)
after importing torch and the runtime, loads the model, then reads its high-water mark (VmHWM):
peak = VmHWM - baseline, in units of the loaded weights' bytes (parameters and persistent buffers,
each storage counted once; tied embeddings once). tracemalloc would miss torch's storages, which
are allocated outside Python's allocator. The KV cache is kept tiny and the CPU fast paths (a
transposed copy of every matrix, see runtime.model.Linear) are off, so the figure is the loading
alone; every weight is read once before the peak is taken (a memory-mapped weight is resident
only once touched). Two models: the default one, and a random Llama of about `--random-mb` MB written as two
safetensors shards with an index (the sharded layout of large checkpoints).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.benchmarks import DEFAULT_MODEL_DIR


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (this benchmark needs Linux)")


def _child(model_dir: str, dtype: str) -> dict[str, Any]:
    import torch

    from runtime.model.checkpoint import load_model

    base_kb = _status_kb("VmRSS")
    model = load_model(model_dir, dtype=getattr(torch, dtype), max_seq_len=16, fast_paths=False)
    # read every weight once: tensors left memory-mapped to the file become resident only when
    # touched, and a model that decodes touches them all
    for t in model.parameters():
        t.float().sum()
    peak_kb = _status_kb("VmHWM")
    seen, weight_bytes = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            weight_bytes += t.untyped_storage().nbytes()
    weight_bytes -= model.kv_cache.untyped_storage().nbytes() + model.rope_cos.nbytes + model.rope_sin.nbytes
    peak = (peak_kb - base_kb) * 1024
    return {"model": model_dir, "dtype": dtype, "weights_mb": round(weight_bytes / 2**20, 1),
            "peak_mb": round(peak / 2**20, 1), "peak_over_weights": round(peak / weight_bytes, 3)}


def write_random_llama(folder: Path, target_mb: float, seed: int = 0) -> Path:
    """A random float32 Llama of about `target_mb` MB as two safetensors shards + index + config."""
    import torch
    from safetensors.torch import save_file

    dim, inter, heads, kv_heads, vocab = 1024, 2816, 16, 4, 32000
    head_dim = dim // heads
    per_layer = 2 * dim * dim + 2 * dim * kv_heads * head_dim + 3 * dim * inter + 2 * dim
    layers = max(1, round((target_mb * 2**20 / 4 - 2 * vocab * dim) / per_layer))
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": dim, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rand(vocab, dim)},
                                             {"lm_head.weight": rand(vocab, dim), "model.norm.weight": torch.ones(dim)}]
    for i in range(layers):
        p, shard = f"model.layers.{i}.", shards[0] if i < layers // 2 else shards[1]
        shard[p + "input_layernorm.weight"] = torch.ones(dim)
        shard[p + "post_attention_layernorm.weight"] = torch.ones(dim)
        shard[p + "self_attn.q_proj.weight"] = rand(dim, dim)
        shard[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, dim)
        shard[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, dim)
        shard[p + "self_attn.o_proj.weight"] = rand(dim, dim)
        shard[p + "mlp.gate_proj.weight"] = rand(inter, dim)
        shard[p + "mlp.up_proj.weight"] = rand(inter, dim)
        shard[p + "mlp.down_proj.weight"] = rand(dim, inter)
    weight_map = {}
    for j, shard in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def measure(model_dir: str | Path, dtype: str) -> dict[str, Any]:
    """Run `_child` in a fresh interpreter and return its figures."""
    out = subprocess.run([sys.executable, "-m", "pipeline.benchmarks.load_memory", "--child", str(model_dir),
                          "--dtype", dtype], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"loading {model_dir} failed in the child process:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--random-mb", type=float, default=450.0, help="size of the random model (0 = skip it)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.dtype)))
        return
    rows = [measure(a.model, a.dtype)]
    if a.random_mb > 0:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(write_random_llama(Path(tmp) / "random-llama", a.random_mb), a.dtype))
            rows[-1]["model"] = f"random Llama, 2 shards ({a.random_mb:.0f} MB asked)"
    for r in rows:
        print(f"{r['model']}: weights {r['weights_mb']} MB {r['dtype']}, host peak while loading {r['peak_mb']} MB "
              f"= {r['peak_over_weights']}x the weights")


if __name__ == "__main__":
    main()
