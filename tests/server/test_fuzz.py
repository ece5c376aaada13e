"""Schemathesis generates requests from the app's own /openapi.json for every route: no answer may be a 5xx, and
every answer must match the documented status codes, content types and schemas."""
from __future__ import annotations

import pytest

from strata.config import EngineConfig
from strata.engine.async_engine import AsyncEngine
from strata.server.app import build_app

API_KEY = "fuzz-key"
CASES_PER_ROUTE = 120  # routes without parameters take one case; the 5 POST routes give > 500


@pytest.fixture(scope="module")
def app(server_checkpoint):
    import argparse

    config = EngineConfig.create(str(server_checkpoint), max_model_len=64, kv_cache_memory=1 << 20,
                                 max_num_seqs=8, served_model_name="fuzz")
    engine = AsyncEngine.from_config(config)
    args = argparse.Namespace(api_key=API_KEY, disable_log_requests=True, max_request_bytes=1 << 16)
    yield build_app(engine, args)
    engine.shutdown()


@pytest.mark.slow
def test_generated_requests_get_no_server_error_and_schema_valid_answers(app):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 11
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    calls = []
    for operation in operations:
        @settings(max_examples=CASES_PER_ROUTE, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case) -> None:
            response = case.call_and_validate(checks=checks, headers={"Authorization": f"Bearer {API_KEY}"})
            calls.append(response.status_code)

        run()
    assert len(calls) >= 500
