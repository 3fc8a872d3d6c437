"""Load a drafter folder in the speculators layout with the real speculators package and compute its
draft logits (run by path under an interpreter that has speculators; tests/helpers/engine_envs.py).
Imports nothing of this project.

    python speculators_check.py REQUEST.json ANSWER.json

REQUEST: {"cases": [case, ...]}, each case {"folder": drafter folder, "inputs": safetensors file with "hidden_states" [1, T, k*H]
(the target's features) and "input_ids" [1, T], "logits": where to write the answer's logits,
"attn_implementation": null | "eager" | "sdpa"}. The folder is loaded with
``Eagle3DraftModel.from_pretrained`` (speculators/models/eagle3/core.py; it reads the verifier's
config at ``speculators_config.verifier.name_or_path``) and run once (``ttt_steps=1``, every
position in one document); the logits of its ``lm_head`` (draft vocabulary) are written to
``logits`` as "logits" [T, V_d] float32. ANSWER: one entry per case, the loaded config's draft_vocab_size,
eagle_aux_hidden_state_layer_ids and norm_before_residual, the dtype it loaded in, and whether
every weight it loaded is finite (embeddings included; the training-only verifier_* copies
are not in the file and not checked).
"""

from __future__ import annotations

import json
import sys


def check(case: dict) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from speculators.models.eagle3 import Eagle3DraftModel

    kwargs = {}
    if case.get("attn_implementation"):
        from speculators.models.eagle3 import Eagle3SpeculatorConfig

        config = Eagle3SpeculatorConfig.from_pretrained(case["folder"])
        config.transformer_layer_config._attn_implementation = case["attn_implementation"]  # noqa: SLF001
        kwargs["config"] = config
    model = Eagle3DraftModel.from_pretrained(case["folder"], **kwargs).eval()
    inputs = load_file(case["inputs"])
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    hidden = inputs["hidden_states"].to(model.fc.weight.dtype)
    ids = inputs["input_ids"].long()
    with torch.no_grad():
        model(hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)
    save_file({"logits": captured[0][0].float().contiguous()}, case["logits"])
    return {"draft_vocab_size": model.config.draft_vocab_size,
            "eagle_aux_hidden_state_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
            "norm_before_residual": model.config.norm_before_residual,
            "dtype": str(model.fc.weight.dtype),
            "finite": all(bool(torch.isfinite(p).all()) for name, p in model.state_dict().items()
                          if p.is_floating_point() and not name.startswith("verifier_"))}


def main(request_path: str, answer_path: str) -> None:
    request = json.loads(open(request_path).read())
    answer = [check(case) for case in request["cases"]]
    with open(answer_path, "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
