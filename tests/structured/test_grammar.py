"""The grammars JSON schemas compile to: integers and numbers have bounded digits (at most 16 integral, 16
fractional, 3 exponent digits) so that a model cannot write digits until max_tokens, while strings matching a
`pattern` stay unbounded; `multipleOf`, which the backend drops or leaves unbounded, is refused; a grammar that does
not compile is a RequestError whatever its characters."""
from __future__ import annotations

import json

import pytest
from checkpoints import write_tokenizer
from transformers import AutoTokenizer

from strata.config import StructuredOutputsConfig
from strata.errors import RequestError
from strata.sampling_params import StructuredOutputsParams
from strata.structured.grammar import GrammarCompiler


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], StructuredOutputsConfig())
    yield compiler
    compiler.shutdown()


def accepts(compiler: GrammarCompiler, schema: dict, value: str) -> bool:
    """Whether the grammar of `{"v": <schema>}` takes `{"v": value}` whole (and may end there)."""
    wrapped = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json=wrapped)))
    return matcher.accept_string(f'{{"v": {value}}}') and matcher.is_completed()


INTEGER, NUMBER = {"type": "integer"}, {"type": "number"}


@pytest.mark.parametrize(("schema", "sign"), [
    (INTEGER, ""), (NUMBER, ""), (INTEGER, "-"), ({"type": "integer", "minimum": 0}, ""),
    ({"type": "integer", "maximum": 5}, "-"), ({"type": "number", "minimum": 0}, ""),
    ({"type": "number", "exclusiveMaximum": 5}, "-"), ({"type": ["integer", "null"]}, "")],
    ids=["integer", "number", "negative", "int_min", "int_max", "num_min", "num_excl_max", "type_list"])
def test_integral_digits_stop_at_sixteen(compiler, schema, sign):
    assert accepts(compiler, schema, sign + "9" * 16)
    assert not accepts(compiler, schema, sign + "1" * 17)


def test_fraction_and_exponent_digits_are_bounded(compiler):
    assert accepts(compiler, NUMBER, "-1." + "5" * 16 + "e-308")
    assert not accepts(compiler, NUMBER, "1." + "5" * 17)
    assert not accepts(compiler, NUMBER, "1.5e1000")


def test_numbers_inside_arrays_and_json_objects_are_bounded(compiler):
    assert not accepts(compiler, {"type": "array", "items": NUMBER}, "[1, " + "2" * 17 + "]")
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json_object=True)))
    assert not matcher.accept_string('{"a": ' + "3" * 17)


def test_a_two_sided_range_keeps_its_own_larger_bound(compiler):
    assert accepts(compiler, {"type": "integer", "minimum": 0, "maximum": 10 ** 18}, "9" * 18)


def test_string_patterns_with_digit_runs_are_not_bounded(compiler):
    schema = {"type": "string", "pattern": "^[1-9][0-9]*$"}
    assert accepts(compiler, schema, json.dumps("1" * 40))


@pytest.mark.parametrize("schema", [
    {"type": "number", "multipleOf": 0.5},                                   # xgrammar ignores it
    {"type": "integer", "multipleOf": 3, "minimum": 0},                      # one-sided: ignored
    {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10 ** 6},  # too wide: ignored
    {"type": "integer", "multipleOf": 3}])                                   # unbounded digits
def test_multiple_of_which_the_backend_drops_or_leaves_unbounded_is_refused(compiler, schema):
    with pytest.raises(RequestError, match="'multipleOf'.*enum"):
        accepts(compiler, schema, "3")


def test_a_grammar_with_non_ascii_junk_is_a_request_error_not_a_crash(compiler):
    """xgrammar's lexer quotes half a UTF-8 character in its message, which then fails to decode (a 500 before)."""
    with pytest.raises(RequestError, match="structured_outputs.grammar cannot be compiled: EBNF lexer error"):
        compiler.compile(StructuredOutputsParams(grammar="\u008c\u00b1\u00d4-N"))
