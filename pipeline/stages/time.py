"""time: step latency of every candidate tree on this machine and the end-to-end tok/s it implies
(`time.prune` skips trees whose tokens/step cannot pay for their cost).

Tokens/step come from the exact replay under exact acceptance; under typical acceptance, which
the replay does not model, from recalibrate's real decoding with it (so time then runs after
recalibrate), and the timed decodes use typical acceptance too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json, machine_info, read_json, run_stage
from pipeline.graph import config_key, forced, once_per_config, output_digest, plain
from pipeline.loaders import resolve_dtype, runtime_key, sampler_from_cfg, tree_decoder
from pipeline.paths import Layout
from pipeline.stages import grow as grow_stage
from pipeline.stages import recalibrate as recalibrate_stage
from pipeline.stages.prepare import rows_hash, split_rows

READS = ("time", "profile.timing_prompts", "profile.max_new_tokens", "sampling", "acceptance", *grow_stage.CANDIDATES)


@once_per_config
def output(cfg: DictConfig) -> Path:
    from pipeline.timing import e2e_tokens_per_second, time_head_chain, time_trees
    from runtime.decoder import HEAD_SIGNALS
    from runtime.tree import Tree

    cands = grow_stage.candidate_trees(cfg)
    rows = split_rows(cfg, "calib", int(cfg.profile.timing_prompts))
    key = {**runtime_key(cfg), **config_key(cfg, READS), "prompts": rows_hash(rows),
           "grow": output_digest(grow_stage.output(cfg)),
           "machine": {k: v for k, v in machine_info().items() if k != "torch_threads"}}
    exact = cfg.acceptance.kind == "exact"
    if not exact:
        recal_dir = recalibrate_stage.output(cfg)
        key["recalibrate"] = output_digest(recal_dir)

    def build(tmp: Path) -> dict[str, Any]:
        dec = tree_decoder(cfg, [c["tree"] for c in cands])
        if exact:
            per_tree_tps = [c["replay_tokens_per_step"] for c in cands]
        else:
            real = {Tree(r["paths"]): r["real_tokens_per_step"] for r in read_json(recal_dir / "recalibrate.json")["trees"]}
            per_tree_tps = [real[c["tree"]] for c in cands]
        t = time_trees(dec, rows, rounds=int(cfg.time.rounds), new_tokens=int(cfg.time.new_tokens),
                       tokens_per_step=per_tree_tps if cfg.time.prune else None, sampler=sampler_from_cfg(cfg))
        n_new = int(cfg.profile.max_new_tokens)
        trees = []
        for k, (c, s) in enumerate(zip(cands, t["step_s"])):
            tps = per_tree_tps[k]
            timed = k not in t["pruned"]
            trees.append({"paths": [list(p) for p in c["tree"].paths], "nodes": c["tree"].num_nodes, "depth": c["tree"].depth,
                          "tokens_per_step": tps, "step_ms": 1000 * s if timed else None,
                          "tok_per_s": e2e_tokens_per_second(tps, s, t["prefill_s"], n_new) if timed else None,
                          **({} if timed else {"pruned": t["pruned"][k]})})
        ar_tok_s = e2e_tokens_per_second(1.0, t["ar_token_s"], t["prefill_s"], n_new)
        chain_ms = 1000 * time_head_chain(dec, rows[0])
        atomic_write_json(tmp / "timing.json", {"trees": trees, "ar_token_ms": 1000 * t["ar_token_s"], "ar_tok_per_s": ar_tok_s,
                                                "signal_ms": {name: chain_ms for name in HEAD_SIGNALS},
                                                "prefill_ms": 1000 * t["prefill_s"], "prompt_tokens": t["prompt_tokens"],
                                                "machine": machine_info(), "dtype": resolve_dtype(cfg),
                                                "tokens_per_step_from": "replay" if exact else "recalibrate",
                                                "acceptance": plain(cfg.acceptance)})
        best = max((x for x in trees if x["tok_per_s"] is not None), key=lambda x: x["tok_per_s"])
        return {"best_nodes": best["nodes"], "best_tok_per_s": best["tok_per_s"], "ar_tok_per_s": ar_tok_s,
                "pruned": len(t["pruned"])}

    return run_stage("time", Layout.from_cfg(cfg).decode_work / "time", key, build, force=forced(cfg, "time"))
