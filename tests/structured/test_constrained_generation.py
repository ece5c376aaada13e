"""Grammar-constrained generation offline, on a random-weight checkpoint: the text is nonsense, the structure exact."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from strata import LLM, RequestError, SamplingParams, StructuredOutputsParams

SCHEMAS = {
    "object_required_and_optional": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120},
                       "ok": {"type": "boolean"}},
        "required": ["name", "age"]},
    "nested_arrays_bounds": {
        "type": "object",
        "properties": {"grid": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                          "items": {"type": "integer", "minimum": -5, "maximum": 5}}}},
        "required": ["grid"]},
    "enum_number_anyof": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"type": "null"}]}},
        "required": ["color", "score", "id"]},
    "string_pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "required": ["code", "flags"]},
}
EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9] | "(" expr ")"'


@pytest.fixture(scope="module")
def llm(llama_gqa):
    with LLM(str(llama_gqa), max_model_len=512) as llm:
        yield llm


def sample(n: int = 4, **constraint) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=300,
                          structured_outputs=StructuredOutputsParams(**constraint))


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def test_every_sampled_json_output_validates_against_its_schema(llm):
    names = list(SCHEMAS)
    outputs = llm.generate(["Hello"] * len(names), [sample(json=SCHEMAS[n]) for n in names], use_tqdm=False)
    for name, out in zip(names, outputs, strict=True):
        assert len(out.outputs) == 4
        for c in out.outputs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
    assert len(set(texts(outputs))) > len(names)  # sampled, not one fixed answer per schema


def test_json_whitespace_is_bounded_between_tokens(llm):
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 4}},
              "required": ["a"]}
    for text in texts(llm.generate(["x"] * 2, sample(json=schema), use_tqdm=False)):
        json.loads(text)
        assert not re.search(r"\s{3,}", text)  # no strings in this schema: every whitespace run is structural


def test_json_object_regex_choice_and_grammar_outputs_conform(llm):
    prompts = ["Hi", "Hi", "Hi", "Hi"]
    params = [sample(json_object=True), sample(regex=r"[a-c]{2,5}(x|yz)"),
              sample(choice=["yes", "no", "it depends"]), sample(grammar=EBNF)]
    obj, regex, choice, grammar = llm.generate(prompts, params, use_tqdm=False)
    # Any object may run on to max_tokens (free keys and strings); those that end are whole objects.
    ended = [c.text for c in obj.outputs if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)
    assert all(c.text.startswith("{") for c in obj.outputs)
    assert all(re.fullmatch(r"[a-c]{2,5}(x|yz)", c.text) for c in regex.outputs)
    assert all(c.text in ("yes", "no", "it depends") for c in choice.outputs)
    for c in grammar.outputs:
        assert re.fullmatch(r"[0-9()+\-]+", c.text)
        eval(c.text)  # noqa: S307 - digits, parentheses, + and - only (checked just above)


@pytest.mark.parametrize("plain", [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                   SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_constrained_request_leaves_unconstrained_neighbours_unchanged(llm, plain):
    prompts = ["The quick brown fox", "import os", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["enum_number_anyof"]))
    mixed = llm.generate(prompts + ["Hello"], [plain] * 3 + [constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    json.loads(mixed[3].outputs[0].text)


BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x float32


@pytest.mark.parametrize("engine", [
    {"max_model_len": 160, "enable_prefix_caching": False, "kv_cache_memory": 10 * BLOCK_BYTES},  # preempts
    {"max_num_batched_tokens": 4, "max_num_seqs": 4},  # prefill in chunks of a few tokens
], ids=["preemption", "chunked_prefill"])
def test_preemption_and_chunked_prefill_mid_json_give_the_same_tokens(llama_gqa, llm, engine):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["nested_arrays_bounds"]))
    prompts = ["def add(a, b):", "The quick brown fox jumps over the lazy dog.", "import os", "Once upon a time",
               "class Engine:", "x"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(llama_gqa), **engine) as other:
        got = [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)]
        if "kv_cache_memory" in engine:
            assert other.engine.scheduler.num_preemptions > 0
    assert got == want


@pytest.mark.parametrize(("constraint", "param", "words"), [
    ({"json": {"type": "frobnicate"}}, "structured_outputs.json", "frobnicate"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "structured_outputs.json",
     "'uniqueItems'"),
    ({"json": {"type": "string", "format": "color"}}, "structured_outputs.json", "'color'"),
])
def test_invalid_or_unenforceable_schemas_are_refused_naming_the_param(llm, constraint, param, words):
    with pytest.raises(RequestError, match=re.escape(words)) as e:
        llm.generate("x", sample(n=1, **constraint), use_tqdm=False)
    assert e.value.param == param
    assert llm.generate("x", sample(n=1, choice=["ok"]), use_tqdm=False)[0].outputs[0].text == "ok"


def test_invalid_regex_and_grammar_fail_their_request_only(llm):
    for constraint, param in (({"regex": "[.*"}, "structured_outputs.regex"),
                              ({"grammar": 'root ::= "a" |'}, "structured_outputs.grammar")):
        with pytest.raises(RequestError) as e:
            llm.generate("x", sample(n=1, **constraint), use_tqdm=False)
        assert e.value.param == param
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("x", sample(n=1, regex="ab"), use_tqdm=False)[0].outputs[0].text == "ab"


def test_exactly_one_kind_of_constraint():
    with pytest.raises(RequestError, match="exactly one") as e:
        StructuredOutputsParams(regex="a", choice=["a"])
    assert e.value.param == "structured_outputs"
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams()


def test_a_compile_slower_than_the_timeout_fails_its_request_not_the_engine(llama_gqa, monkeypatch):
    with LLM(str(llama_gqa), structured_outputs_timeout=0.2) as llm:
        compiler = llm.engine.grammars.compiler
        real_submit = compiler.submit
        monkeypatch.setattr(compiler, "submit", lambda params: Future())  # a compile that never ends
        with pytest.raises(RequestError, match="took longer than 0.2 s") as e:
            llm.generate("x", sample(n=1, regex="ab"), use_tqdm=False)
        assert e.value.param == "structured_outputs.regex"
        monkeypatch.setattr(compiler, "submit", real_submit)
        assert llm.generate("x", sample(n=1, regex="ab"), use_tqdm=False)[0].outputs[0].text == "ab"


def test_a_grammar_compiles_once_and_is_then_served_from_the_cache(llm):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}}
    compiler = llm.engine.grammars.compiler
    first = compiler.submit(StructuredOutputsParams(json=schema))
    first.result()
    assert compiler.submit(StructuredOutputsParams(json=dict(reversed(schema.items())))) is first


def test_llm_chat_hands_tools_to_the_chat_template(llama_gqa):
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with LLM(str(llama_gqa)) as llm:
        with_tools = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                              chat_template=template, tools=tools)[0]
        without = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                           chat_template=template)[0]
    assert with_tools.prompt == "hi[get_weather]" and without.prompt == "hi"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}])
def test_constrained_tokens_are_the_same_under_tp_and_pp(llama_gqa, llm, layout):
    # The bitmask is filled in the engine process and travels with the step to the rank that samples.
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=s))
              for s in SCHEMAS.values()]
    prompts = ["Hello"] * len(params)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(llama_gqa), max_model_len=512, kv_cache_memory=4 << 20, **layout) as other:
        got = [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)]
    assert got == want
