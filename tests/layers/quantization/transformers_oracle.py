"""Greedy tokens and logits of transformers loading a quantized checkpoint (run in an environment with the
checkpoint's library, e.g. compressed-tensors, by subprocess).

usage: python transformers_oracle.py CHECKPOINT PROMPTS_JSON MAX_TOKENS OUT_PT
Writes {"tokens": [[...] per prompt], "logits": [float32 [len, vocab] of prompt + tokens, per prompt]}.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    path, prompts_json, max_tokens, out = sys.argv[1:]
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in json.loads(prompts_json):
            sequence = list(prompt)
            for _ in range(int(max_tokens)):  # plain greedy steps: no generation config can interfere
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
            tokens.append(sequence[len(prompt):])
            logits.append(model(torch.tensor([sequence])).logits[0].float())
    torch.save({"tokens": tokens, "logits": logits}, out)


if __name__ == "__main__":
    main()
