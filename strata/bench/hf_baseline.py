"""transformers generate() on the prompts strata's throughput benchmark uses: the baseline strata is compared to."""
from __future__ import annotations

import gc
import importlib.util
import logging
import time

import torch

logger = logging.getLogger(__name__)


def left_padded(prompts: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of a batch padded on the left, as decoder-only generate() needs."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _generate(model, prompts: list[list[int]], output_len: int, pad_id: int, device: str) -> int:
    ids, mask = left_padded(prompts, pad_id, device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                             min_new_tokens=output_len, pad_token_id=pad_id)
    if out.shape[1] != ids.shape[1] + output_len:
        raise RuntimeError(f"generate() returned {out.shape[1] - ids.shape[1]} new tokens, expected {output_len}")
    return len(prompts) * output_len


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run_batches(model, prompts: list[list[int]], output_len: int, pad_id: int, device: str,
                 deadline: float) -> dict:
    """Greedy generate() over all prompts in one batch, halving it on out-of-memory; once split, sub-batches run
    until `deadline`, and throughput is that of the prompts that ran (sub-batches are independent)."""
    batch, done, produced, elapsed = len(prompts), 0, 0, 0.0
    while done < len(prompts) and (done == 0 or time.monotonic() < deadline):
        chunk = prompts[done:done + batch]
        started, out_of_memory = time.perf_counter(), False
        try:
            produced += _generate(model, chunk, output_len, pad_id, device)
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            out_of_memory = True
        if out_of_memory:  # outside the except block, so that its traceback no longer holds the activations
            batch //= 2
            logger.warning("transformers generate() ran out of memory; retrying with batches of %d", batch)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        _sync(device)
        elapsed += time.perf_counter() - started
        done += len(chunk)
    return {"prompts_run": done, "batch_size": batch, "output_tokens": produced, "elapsed_s": elapsed}


def hf_generate_throughput(path: str, prompts: list[list[int]], output_len: int, *, device: str, dtype: torch.dtype,
                           deadline: float, pad_id: int = 1) -> dict:
    """Output and total tokens/s of transformers greedy generate() with exactly `output_len` new tokens each."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - started
    attention = getattr(model.config, "_attn_implementation", None)
    try:
        _generate(model, prompts[:1], 4, pad_id, device)  # warm-up: library and kernel initialisation
        result = _run_batches(model, prompts, output_len, pad_id, device, deadline)
    finally:
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    input_tokens = sum(len(p) for p in prompts[:result["prompts_run"]])
    # Without these packages transformers runs its plain-torch paths (Mamba2's scan among them).
    result["kernel_packages"] = {name: importlib.util.find_spec(name) is not None
                                 for name in ("mamba_ssm", "causal_conv1d", "flash_attn", "kernels")}
    result.update(load_s=load_s, attn_implementation=attention,
                  output_tokens_per_s=result["output_tokens"] / result["elapsed_s"],
                  total_tokens_per_s=(result["output_tokens"] + input_tokens) / result["elapsed_s"])
    return result
