"""Reproducibly trains the `strata-demo` checkpoint: a byte-level BPE tokenizer and a tiny Llama,
both fitted on the Python standard library's own sources, on CPU in a few minutes."""
from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import os
import pathlib
import random
import sysconfig
import time
from collections.abc import Iterable, Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = pathlib.Path(__file__).resolve().parent / "checkpoint"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, SYSTEM)

# Each turn is `<|role|>{content}<|end_of_text|>`, so an assistant turn ends on EOS and generation stops.
# No newline after the role: a bare '\n' shared with code let memorised chat lines leak into completions.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('strata-demo only knows the roles system, user and assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Words keep the spaces that follow them ("def ", "import "), newlines keep the next line's indentation.
# GPT-2's split puts the space before the word instead, so a prompt ending in a space ("def ") ends in a
# lone ' ' token that clean code never contains, and the model has no idea what follows it.
_PRE_TOKENIZE_PATTERN = r"\w+[ \t]*|[^\w\s]+[ \t]*|\s*[\r\n][ \t]*|\s+"

# Directories whose sources are tests, third-party code or data tables rather than ordinary Python.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
     "pydoc_data", "lib2to3", "turtledemo"}
)
# Varied and used sparingly: a single repeated sentence gets memorised and then leaks into plain completions.
_SYSTEM_PROMPTS = (
    "You are strata-demo, a tiny model that writes Python.",
    "Answer with Python code only.",
    "You are a helpful assistant.",
)
_USER_PROMPTS = (
    "Write a Python function called {name}.",
    "Show me {name} in Python.",
    "How would you implement {name}?",
)
# Sized so that 1400 steps of 8x128 tokens take ~4 minutes on 2 idle CPU cores and bf16 weights stay < 7 MB.
_MODEL_SHAPE = dict(
    hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0,
)
_CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
)


def stdlib_sources(max_bytes: int = 3_500_000, max_file_bytes: int = 150_000) -> list[str]:
    """A deterministic subset of the running Python's stdlib `.py` files, spread over the whole library."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    candidates: list[tuple[pathlib.Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            path = pathlib.Path(dirpath) / name
            # _sysconfigdata* is this machine's build configuration, not code worth imitating.
            if not name.endswith(".py") or name.startswith(("test_", "_sysconfigdata")):
                continue
            size = path.stat().st_size
            if 0 < size <= max_file_bytes:
                candidates.append((path, size))
    candidates.sort(key=lambda item: item[0].relative_to(root).as_posix())
    total = sum(size for _, size in candidates)
    # A stride rather than a prefix, so the subset is not just the modules starting with 'a'..'f'.
    stride = max(1, math.ceil(total / max_bytes))
    texts = []
    for path, _ in candidates[::stride]:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    logger.info("corpus: %d of %d stdlib files under %s, %.1f MB", len(texts), len(candidates), root,
                sum(map(len, texts)) / 1e6)
    return texts


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Byte-level BPE with the demo's special tokens; encoding prepends BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRE_TOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        chat_template=CHAT_TEMPLATE,
        model_max_length=_MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def chat_examples(texts: Sequence[str], max_chars: int, seed: int) -> list[list[dict[str, str]]]:
    """Conversations asking for a named function and answering with that stdlib function's source."""
    functions: list[tuple[str, str]] = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                source = ast.get_source_segment(text, node)
                if source and 80 <= len(source) <= 800:
                    functions.append((node.name, source))
    random.Random(seed).shuffle(functions)
    conversations, used = [], 0
    for i, (name, source) in enumerate(functions):
        if used >= max_chars:
            break
        messages = [{"role": "system", "content": _SYSTEM_PROMPTS[i // 4 % 3]}] if i % 4 == 0 else []
        messages.append({"role": "user", "content": _USER_PROMPTS[i % len(_USER_PROMPTS)].format(name=name)})
        messages.append({"role": "assistant", "content": source})
        conversations.append(messages)
        used += len(source)
    return conversations


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str],
                 conversations: Sequence[list[dict[str, str]]], seed: int) -> torch.Tensor:
    """All documents, each as BOS ... EOS, shuffled and concatenated into one long sequence of ids."""
    # The backend tokenizer, because the wrapper warns about every file longer than model_max_length.
    backend = tokenizer.backend_tokenizer
    eos_id = tokenizer.eos_token_id
    docs = [enc.ids + [eos_id] for enc in backend.encode_batch(list(texts))]
    rendered = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    docs += [enc.ids for enc in backend.encode_batch(rendered, add_special_tokens=False)]
    random.Random(seed).shuffle(docs)
    stream = torch.tensor([t for doc in docs for t in doc], dtype=torch.long)
    logger.info("training stream: %d documents, %d tokens (%d chats)", len(docs), stream.numel(),
                len(conversations))
    return stream


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """The tiny Llama (GQA, tied embeddings) in float32, initialised from `seed`."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        **_MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    logger.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    return model


def train_model(model: LlamaForCausalLM, stream: torch.Tensor, *, steps: int, seed: int,
                batch_size: int = 8, seq_len: int = 128, lr: float = 2e-3) -> float:
    """AdamW on random windows of the stream with warm-up then cosine decay; returns the last loss."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    smoothed = float("nan")
    bar = tqdm(range(steps), desc="train strata-demo", disable=None)
    for step in bar:
        starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        bar.set_postfix(loss=f"{smoothed:.3f}")
        if step % 100 == 0 or step == steps - 1:
            logger.info("step %d/%d loss %.3f (smoothed %.3f)", step + 1, steps, value, smoothed)
    model.eval()
    return smoothed


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                    output: pathlib.Path) -> None:
    """bfloat16 safetensors + config + tokenizer, readable by transformers and by strata."""
    output.mkdir(parents=True, exist_ok=True)
    for name in _CHECKPOINT_FILES:
        (output / name).unlink(missing_ok=True)
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    _patch_json(output / "config.json", {
        "torch_dtype": "bfloat16", "dtype": "bfloat16", "rope_theta": _MODEL_SHAPE["rope_theta"],
    })
    # One home for the chat template, in tokenizer_config.json where older loaders also look.
    (output / "chat_template.jinja").unlink(missing_ok=True)
    # Class and key names that transformers 4.x also understands (5.x accepts them as aliases).
    _patch_json(output / "tokenizer_config.json", {
        "chat_template": CHAT_TEMPLATE, "bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
        "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast",
        "additional_special_tokens": [USER, ASSISTANT, SYSTEM], "extra_special_tokens": None,
    })
    for name in _CHECKPOINT_FILES:
        if (output / name).exists():
            # safetensors writes 0600; an installed package must be readable by every user.
            (output / name).chmod(0o644)
    size = sum(p.stat().st_size for p in output.iterdir() if p.is_file())
    logger.info("saved %s (%.1f MB)", output, size / 1e6)


def _patch_json(path: pathlib.Path, updates: dict) -> None:
    # Both the transformers-5 and the older key names are written, for loaders of either generation.
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(updates)
    data = {key: value for key, value in data.items() if value is not None or key not in updates}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def sample_completions(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                       prompts: Sequence[str], max_new_tokens: int = 40) -> list[str]:
    """Greedy continuations, for a quick look at what the model learned."""
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
            outs.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return outs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the built-in strata-demo checkpoint.")
    parser.add_argument("--output", type=pathlib.Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    started = time.monotonic()

    texts = stdlib_sources()
    tokenizer = train_tokenizer(texts, args.vocab_size)
    conversations = chat_examples(texts, max_chars=sum(map(len, texts)) // 20, seed=args.seed)
    stream = token_stream(tokenizer, texts, conversations, seed=args.seed)
    model = build_model(tokenizer, seed=args.seed)
    loss = train_model(model, stream, steps=args.steps, seed=args.seed)
    save_checkpoint(model, tokenizer, args.output)
    prompts = ("def ", "import os\n")
    for prompt, text in zip(prompts, sample_completions(model.float(), tokenizer, prompts), strict=True):
        logger.info("sample %r -> %r", prompt, text)
    logger.info("done in %.0f s, final smoothed loss %.3f", time.monotonic() - started, loss)


if __name__ == "__main__":
    main()
