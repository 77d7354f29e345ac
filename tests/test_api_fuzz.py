"""Schemathesis against a live server's /openapi.json: for whatever the schema admits (and, in
negative mode, much that it does not) no 5xx, and every response shaped as the schema documents.

Each operation is its own Hypothesis test over schemathesis' case strategy (schemathesis' own
pytest integration does not run under pytest 9.2: it sets `Function._nodeid`)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from server_utils import Server, running_server
from tiny_served_model import tiny_served_model

pytestmark = pytest.mark.slow

# What is checked is the API (validation, errors, response shapes), not the model's words: the tiny
# random model with the default model's tokenizer and chat template (tests/tiny_served_model.py) answers a
# generated request (n up to 128, max_tokens up to the context) in milliseconds where the default model
# took seconds. A short context and a request timeout bound it all the same; a 408 is a 4xx like any other.
SERVER_ARGS = (str(tiny_served_model()), "--dtype", "float32", "--kv-cache-memory", "0.25", "--max-model-len", "128",
               "--request-timeout", "3")
OPERATIONS = ["GET /health", "GET /version", "GET /metrics", "GET /v1/models", "GET /v1/cluster",
              "GET /tokenizer_info", "POST /tokenize", "POST /detokenize", "POST /v1/completions",
              "POST /v1/chat/completions", "POST /v1/cluster/workers/{worker_id}/migrate", "POST /v1/messages",
              "POST /v1/messages/count_tokens", "POST /v1/responses", "GET /v1/responses/{response_id}",
              "DELETE /v1/responses/{response_id}", "GET /v1/responses/{response_id}/input_items"]
MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    with running_server(*SERVER_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server: Server) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_the_operations_are_all_covered(api_schema: schemathesis.BaseSchema) -> None:
    labels = {r.ok().label for r in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS), "a route was added or removed: update OPERATIONS"


@pytest.mark.parametrize("label", OPERATIONS)
def test_no_server_errors_and_responses_match_the_schema(api_schema: schemathesis.BaseSchema, server: Server,
                                                         label: str) -> None:
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None
    cases = st.one_of(operation.as_strategy(schemathesis.GenerationMode.POSITIVE),
                      operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))

    @given(case=cases, keep_model=st.booleans())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case, keep_model: bool) -> None:
        if isinstance(case.body, dict) and not keep_model:
            case.body.pop("model", None)  # a random model name is a 404 before anything else is looked at
        response = case.call(base_url=server.url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

    run()
