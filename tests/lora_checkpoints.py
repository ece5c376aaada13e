"""Random PEFT LoRA adapters of tiny base checkpoints (PEFT's get_peft_model, B made non-zero, save_pretrained), and
PEFT's own greedy continuation with the adapter unmerged (full forward passes), the oracle strata's LoRA is checked
against."""
from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, folder: Path, *, r: int = 8, alpha: float = 16, rslora: bool = False,
                 targets: list[str] | None = None, seed: int = 0, **config) -> Path:
    """A LoRA adapter of `base` with random A and B (PEFT initialises B to zero), saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets or ALL_TARGETS,
                      lora_dropout=0.0, task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(model, lora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(folder)
    return folder


def edit_adapter_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """PEFT's greedy continuation of each prompt (the base model alone when `adapter` is None), with the
    log-softmax of every generated position: [{"tokens": [...], "logprobs": [max_tokens, vocab]}]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            sequence = list(prompt)
            for _ in range(max_tokens):
                sequence.append(int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax()))
            logits = model(input_ids=torch.tensor([sequence[:-1]])).logits[0, len(prompt) - 1:]
            results.append({"tokens": sequence[len(prompt):], "logprobs": torch.log_softmax(logits, dim=-1)})
    return results
