"""`schemathesis run --checks all` in process: every phase and every check schemathesis has, on requests it
generates from the app's own /openapi.json for every route. No failure: no server error, answers as documented,
schema-valid requests accepted, schema-violating ones refused, undeclared methods 405 with `Allow`. On the built-in
demo model, whose chat template refuses roles other than system, user and assistant (as `strata serve` runs it)."""
from __future__ import annotations

import argparse
from collections import Counter

import jsonschema
import pytest
from fastapi.testclient import TestClient

from strata.config import EngineConfig
from strata.demo import demo_checkpoint_path
from strata.engine.async_engine import AsyncEngine
from strata.server.app import build_app

API_KEY = "fuzz-key"
MAX_MODEL_LEN = 256
ROUTES = 11
FUZZED_PER_ROUTE = 10  # random cases; the coverage phase adds its systematic ones: > 1,500 in all


@pytest.fixture(scope="module")
def app():
    config = EngineConfig.create(str(demo_checkpoint_path()), max_model_len=MAX_MODEL_LEN, kv_cache_memory=4 << 20,
                                 max_num_seqs=8, served_model_name="fuzz")
    engine = AsyncEngine.from_config(config)
    args = argparse.Namespace(api_key=API_KEY, disable_log_requests=True, max_request_bytes=1 << 20)
    yield build_app(engine, args)
    engine.shutdown()


def _run_schemathesis(app) -> tuple[Counter, list[str]]:
    """Cases per (phase, route) and a line per failure or error, as `schemathesis run --checks all` would report
    them."""
    import contract_hooks
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    from schemathesis.engine import events, from_schema

    contract_hooks.max_prompt_tokens = MAX_MODEL_LEN - 32
    contract_hooks.max_new_tokens = 2
    config = SchemathesisConfig.from_dict({
        "headers": {"Authorization": f"Bearer {API_KEY}"},
        "generation": {"max-examples": FUZZED_PER_ROUTE, "deterministic": True, "database": "none"}})
    config.projects.get_default().checks.update(included_check_names=["all"])
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    cases: Counter = Counter()
    problems = []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            recorder = event.recorder
            cases[event.phase.name, recorder.label] += len(recorder.cases)
            for case_id, checks in recorder.checks.items():
                for check in checks:
                    if check.failure_info is not None:
                        case = recorder.cases[case_id].value
                        problems.append(f"{event.phase.name} {recorder.label} {check.name}: "
                                        f"{check.failure_info.failure.title}; body {str(case.body)[:300]}")
        elif isinstance(event, events.NonFatalError):
            problems.append(f"error in {event.label}: {event.info.format()[:500]}")
        elif isinstance(event, events.FatalError):
            problems.append(f"fatal: {event.exception}")
    return cases, problems


@pytest.mark.slow
def test_schemathesis_with_every_check_and_phase_finds_nothing(app):
    cases, problems = _run_schemathesis(app)
    assert not problems, "\n".join(problems[:20])
    for phase in ("COVERAGE", "FUZZING"):
        assert len([n for (p, _), n in cases.items() if p == phase and n]) == ROUTES, cases
    assert cases["STATEFUL_TESTING", "Stateful tests"], cases  # /tokenize's answer, linked to /detokenize
    assert sum(cases.values()) >= 1000, cases


# Schema-valid by /openapi.json before, and refused: what `st run --checks all --seed 7 --max-examples 100` found
# against `strata serve` (the demo model), as ST202.
ST202_SEED_7 = [
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"add_generation_prompt": False, "logprobs": True, "messages": [{"role": ""}]}),
    ("/tokenize", "TokenizeRequest", {"add_generation_prompt": True, "messages": [{"role": ""}]}),
    ("/invocations", "ChatCompletionRequest", {"messages": [{"role": ""}]}),
    ("/v1/completions", "CompletionRequest", {"prompt": "", "echo": True, "max_tokens": 1,
                                              "structured_outputs": {"json": ")-U\u00e7X\n*m"}}),
]


def _body_validator(app, component: str) -> jsonschema.Validator:
    document = app.openapi()
    schema = {"$ref": f"#/components/schemas/{component}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.mark.parametrize(("path", "component", "body"), ST202_SEED_7, ids=[p for p, _, _ in ST202_SEED_7])
def test_requests_the_server_refuses_are_outside_its_schema(app, path, component, body):
    assert not _body_validator(app, component).is_valid(body)
    response = TestClient(app).post(path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text


# What a plain `st run --checks all --seed 7 --max-examples 100` (no hooks) found next, as ST202: one function
# listed twice, schema-valid and now served.
ST202_SEED_7_PLAIN = [
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "none", "max_tokens": 1, "logprobs": True,
      "tools": [{"function": {"name": "0"}}, {"": [None], "function": {"\u00d5": {}, "name": "0"}}]}),
    ("/invocations", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "none", "max_tokens": 1,
      "tools": [{"": None, "function": {"name": "0"}}, {"function": {"": None, "name": "0"}}]}),
]


@pytest.mark.parametrize(("path", "component", "body"), ST202_SEED_7_PLAIN, ids=[p for p, _, _ in ST202_SEED_7_PLAIN])
def test_schema_valid_requests_a_plain_run_found_refused_are_served(app, path, component, body):
    assert _body_validator(app, component).is_valid(body)
    response = TestClient(app).post(path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text


def test_the_schema_admits_the_roles_the_chat_template_renders_and_the_server_no_other(app):
    validator, client = _body_validator(app, "TokenizeRequest"), TestClient(app)
    for role, expected in (("system", 200), ("user", 200), ("assistant", 200), ("tool", 400), ("x", 400)):
        body = {"messages": [{"role": role, "content": "Hi"}], "add_generation_prompt": True}
        response = client.post("/tokenize", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert (response.status_code, validator.is_valid(body)) == (expected, expected == 200), (role, response.text)
    own = {"messages": [{"role": "x", "content": "Hi"}], "chat_template": "{{ messages[0]['role'] }}", "max_tokens": 1}
    assert not _body_validator(app, "ChatCompletionRequest").is_valid(own)  # a template of its own renders "x" ...
    response = client.post("/v1/chat/completions", json=own, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "'x' is not one of system, user, assistant" in response.text  # ... refused


def test_json_schema_values_of_the_wrong_kind_are_outside_the_schema(app):
    validator = _body_validator(app, "JsonSchema")
    assert validator.is_valid({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}},
                               "required": ["a"], "additionalProperties": False})
    for bad in ({"type": 5}, {"anyOf": [{}, 3]}, {"minLength": -1}, {"pattern": "a", "maxLength": 2},
                {"multipleOf": 2}, {"required": [1]}):
        assert not validator.is_valid(bad), bad
