"""`strata bench throughput --lora-rank R --num-loras N`: a random adapter PEFT itself loads, requests spread over N
adapter ids, and a line saying which decode path ran."""
from __future__ import annotations

import pytest
import torch

from strata.bench.lora import random_adapter
from strata.cli import main


def test_random_bench_adapter_is_one_peft_loads(llama_gqa, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = random_adapter(str(llama_gqa), tmp_path / "adapter", rank=4)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_gqa), folder)
    lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert len(lora_a) == 7 * model.config.num_hidden_layers and all(p.shape[0] == 4 for p in lora_a)
    assert all(torch.count_nonzero(p) for n, p in model.named_parameters() if "lora_B" in n)


def test_bench_throughput_spreads_requests_over_adapters(llama_gqa, capsys):
    rc = main(["bench", "throughput", "--model", str(llama_gqa), "--num-prompts", "4", "--input-len", "5",
               "--output-len", "2", "--dtype", "float32", "--max-model-len", "64", "--enable-lora", "--max-loras",
               "2", "--max-lora-rank", "8", "--lora-rank", "8", "--num-loras", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "LoRA: 2 adapter id(s)" in printed and "of them with adapter rows (shrink and expand in C)" in printed


def test_bench_lora_needs_enable_lora(llama_gqa):
    with pytest.raises(SystemExit, match="need --enable-lora"):
        main(["bench", "throughput", "--model", str(llama_gqa), "--num-prompts", "1", "--lora-rank", "4"])
