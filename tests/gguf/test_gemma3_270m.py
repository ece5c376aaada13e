"""The real Gemma 3 270M Q4_K_M file (gemma3_270m.py): strata's tokenizer splits mixed text as transformers' GGUF
tokenizer does, and strata's greedy tokens are transformers-from-GGUF's (float32) on prompts of 24+ tokens, where
a first divergence is allowed only at a near tie (transformers' token is strata's second choice)."""
from __future__ import annotations

import pytest
import torch
from gemma3_270m import gemma3_270m_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from strata import LLM, SamplingParams
from strata.tokenizer import load_tokenizer

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type with an oil-based ink and a wooden press, and within fifty years",
    "def merge_sorted(left, right):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    result = []\n"
    "    i = j = 0\n    while i < len(left) and j < len(right):\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light energy into chemical "
    "energy. It takes place mainly in the leaves, where",
    "Recipe for a simple tomato soup.\n\nIngredients:\n- 6 ripe tomatoes\n- 1 onion\n- 2 cloves of garlic\n"
    "- 500 ml of vegetable stock\n\nSteps:\n1.",
]
TEXTS = ["Hello world", "  two  spaces,   three and\ttabs\nnew lines\n\n\n  indented", "trailing spaces   ",
         " leading space", "déjà vu, naïve café: 3.14159 (ok?) 1234567890",
         "漢字とかなの文章。Привет, мир! مرحبا بالعالم",
         "emoji 😀🚀👍🏽 and ZWJ 👨‍👩‍👧 family", "def f(x):\n    return {'a': [x, x ** 2]}  # comment\n",
         "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", "a\u00a0b \u3000c\u200bd",
         "unseen bytes \x7f\x01 and <unknown_tag> </s>"]
TOKENS = 24


@pytest.fixture(scope="module")
def gemma3():
    return gemma3_270m_gguf()


@pytest.fixture(scope="module")
def reference_tokenizer(gemma3):
    return AutoTokenizer.from_pretrained(gemma3.parent, gguf_file=gemma3.name)


def test_tokenizer_splits_mixed_text_as_transformers_gguf_tokenizer(gemma3, reference_tokenizer):
    tokenizer = load_tokenizer(str(gemma3.parent), str(gemma3))
    for text in TEXTS:
        expected = reference_tokenizer(text).input_ids
        assert tokenizer(text).input_ids == expected, text
        assert expected[0] == reference_tokenizer.bos_token_id
        assert tokenizer.decode(expected, skip_special_tokens=True) == \
            reference_tokenizer.decode(expected, skip_special_tokens=True)


def _agrees(got: list[int], top2: list[dict], expected: list[int]) -> bool:
    """Identical, or identical up to a first divergence where transformers' token is strata's second choice."""
    for i, (token, want) in enumerate(zip(got, expected, strict=True)):
        if token != want:
            return want in top2[i]
    return True


@pytest.mark.slow
def test_greedy_tokens_match_transformers_from_gguf(gemma3, reference_tokenizer):
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    with LLM(str(gemma3), device="cpu", max_model_len=512) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(gemma3.parent, gguf_file=gemma3.name, dtype=torch.float32)
    exact = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = reference_tokenizer(prompt).input_ids
        assert out.prompt_token_ids == ids and len(ids) >= 24
        with torch.no_grad():
            tensor = torch.tensor([ids])
            generated = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=TOKENS,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = generated[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        assert _agrees(got, out.outputs[0].logprobs, expected), (prompt, got, expected)
        exact += got == expected
    assert exact >= len(PROMPTS) - 1  # near ties are rare: most continuations are identical throughout
