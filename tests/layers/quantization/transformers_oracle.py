"""Greedy tokens and logits of transformers loading a quantized checkpoint (run in an environment with the
checkpoint's library, e.g. compressed-tensors, by subprocess).

usage: python transformers_oracle.py PROMPTS_JSON MAX_TOKENS OUT_PT CHECKPOINT [CHECKPOINT ...]
Writes {checkpoint: {"tokens": [[...] per prompt], "logits": [float32 [len, vocab] of prompt + tokens]}}.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def skip_init_of_compressed_linears() -> None:
    """transformers' Mamba2 re-initialises out_proj.weight while loading, which a compressed linear (weight_packed,
    weight_scale, ...) lacks; every stored tensor is loaded anyway, so that step is skipped for such mixers."""
    from transformers.models.mamba2 import modeling_mamba2

    init = modeling_mamba2.Mamba2PreTrainedModel._init_weights

    def init_unless_compressed(self, module):
        if not (isinstance(module, modeling_mamba2.Mamba2Mixer) and not hasattr(module.out_proj, "weight")):
            init(self, module)

    modeling_mamba2.Mamba2PreTrainedModel._init_weights = init_unless_compressed


def main() -> None:
    skip_init_of_compressed_linears()
    prompts_json, max_tokens, out, *paths = sys.argv[1:]
    torch.save({path: greedy(path, json.loads(prompts_json), int(max_tokens)) for path in paths}, out)


def greedy(path: str, prompts: list[list[int]], max_tokens: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            sequence = list(prompt)
            for _ in range(max_tokens):  # plain greedy steps: no generation config can interfere
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
            tokens.append(sequence[len(prompt):])
            logits.append(model(torch.tensor([sequence])).logits[0].float())
    return {"tokens": tokens, "logits": logits}


if __name__ == "__main__":
    main()
