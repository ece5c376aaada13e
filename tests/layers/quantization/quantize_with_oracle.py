"""Quantize checkpoints with llm-compressor's `oneshot`, and compute transformers' greedy tokens and logits on the
dense checkpoint compressed-tensors' own compressors decompress each into (a compressed checkpoint loaded by
transformers re-quantizes its weights on every forward pass, 100x slower), in one process of llm-compressor's
environment: importing the libraries takes longer than quantizing and running a test checkpoint.

usage: python quantize_with_oracle.py PROMPTS_JSON MAX_TOKENS OUT_PT SCHEME BASE [BASE ...]
writes BASE-SCHEME (see write_llmcompressor_checkpoint.py for the schemes) and BASE-SCHEME-dense beside each BASE,
and OUT_PT: {quantized folder: {"tokens": [[...] per prompt], "logits": [float32 [len, vocab] of prompt + tokens]}}.
Experts stay one tensor per expert, as transformers loads released Qwen3-MoE checkpoints.
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationConfig
from decompress_checkpoint import decompress
from safetensors.torch import load_file, save_file
from transformers_oracle import greedy
from write_llmcompressor_checkpoint import write


def decompress_per_expert(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    quant = QuantizationConfig.model_validate(config.pop("quantization_config"))
    save_file(decompress(load_file(str(src / "model.safetensors")), quant), str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))


def main() -> None:
    torch.set_num_threads(1)  # tiny models: a second thread only waits on the other processes sharing the cores
    prompts_json, max_tokens, out, scheme, *bases = sys.argv[1:]
    results = {}
    for base in map(Path, bases):
        quantized, dense = base.parent / f"{base.name}-{scheme}", base.parent / f"{base.name}-{scheme}-dense"
        write(str(base), str(quantized), scheme)
        decompress_per_expert(quantized, dense)
        results[str(quantized)] = greedy(str(dense), json.loads(prompts_json), int(max_tokens))
    torch.save(results, out)


if __name__ == "__main__":
    main()
