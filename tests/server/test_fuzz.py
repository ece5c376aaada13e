"""`schemathesis run --checks all` in process: every phase and every check schemathesis has, on requests it
generates from the app's own /openapi.json for every route. No failure: no server error, answers as documented,
schema-valid requests accepted, schema-violating ones refused, undeclared methods 405 with `Allow`."""
from __future__ import annotations

import argparse
from collections import Counter

import pytest

from strata.config import EngineConfig
from strata.engine.async_engine import AsyncEngine
from strata.server.app import build_app

API_KEY = "fuzz-key"
MAX_MODEL_LEN = 256
ROUTES = 11
FUZZED_PER_ROUTE = 10  # random cases; the coverage phase adds its systematic ones: > 1,500 in all


@pytest.fixture(scope="module")
def app(server_checkpoint):
    config = EngineConfig.create(str(server_checkpoint), max_model_len=MAX_MODEL_LEN, kv_cache_memory=4 << 20,
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
