"""Property-based fuzzing of the OpenAI frontend from its own /openapi.json (schemathesis,
pinned in requirements/cpu.txt) against the session's real server: schemathesis'
coverage phase (boundary values, missing fields, wrong types, unexpected methods) and
MAX_EXAMPLES generated bodies per operation, valid and invalid (mode "all"), seeded,
with the hooks of fuzz_hooks.py (a served model in most cases, a few tokens each).

Every response must be no 5xx, a status the document declares for the operation, of a
declared content type, and match the schema of that status (each event of a stream
included); the API key must be enforced (ignored_auth takes it away from successful
cases); after the run no KV block is held and no request is in the engine. Without the
key, every /v1 operation answers 401 as documented. The same run by hand: docs/security.md.
"""

import collections
import json
import urllib.request

import pytest

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    allow_header_conformance, content_type_conformance, ignored_auth, response_headers_conformance,
    response_schema_conformance, status_code_conformance, unsupported_method)

from frontend.openai_api.app import create_app  # noqa: E402
from frontend.openai_api.auth import APIKeys  # noqa: E402
from tests.integration import fuzz_hooks  # noqa: E402,F401  (registers the hooks)
from tests.integration.conftest import API_KEY, openai_frontend, wait_blocks_free  # noqa: E402

SEED = 20240611
# Generated cases per operation, after the coverage phase's (which is unchanged: every
# operation still gets its boundary values, missing fields, wrong types and methods).
# 75, down from 150 to keep `make test` near 15 minutes: 2568 cases instead of 3168, and
# 31 s of fuzzing calls instead of 37 s on an idle 2-core machine (most of the time is
# the coverage phase); every operation is still fuzzed, and the engine still answers
# 200s and 400s (18/295 completions, 33/461 chat, 25/206 responses).
MAX_EXAMPLES = 75
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, ignored_auth, unsupported_method, allow_header_conformance]
STATUSES: collections.Counter = collections.Counter()
# The document of a frontend with API keys, as the session's serves it (the first test
# checks that): loaded at collection, when no server runs yet (schemathesis' loader from a
# fixture needs a pytest older than ours).
DOCUMENT = create_app("127.0.0.1:1", api_keys=APIKeys([API_KEY])).openapi()
# Same seed, same cases: generation does not feed on the server's answers (which vary).
NO_FEEDBACK = {"extra-data-sources": {"responses": False}}


def load(max_examples: int, key: bool = True):
    """key: send the API key the way the document's security scheme says, so that
    ignored_auth knows what to take away."""
    return schemathesis.openapi.from_dict(DOCUMENT, config=schemathesis.Config.from_dict({
        "seed": SEED, "request-timeout": 60, "max-stream-events": 400,
        "generation": {"mode": "all", "max-examples": max_examples, "database": "none",
                       "with-security-parameters": False},
        "phases": {"examples": NO_FEEDBACK, "coverage": NO_FEEDBACK, "stateful": {"enabled": False},
                   "fuzzing": {**NO_FEEDBACK, "error-feedback": {"enabled": False}}},
        "output": {"sanitization": {"enabled": False}},       # a test key; failures show max_tokens
        **({"auth": {"openapi": {"apiKey": {"bearer": API_KEY}}}} if key else {})}))


@pytest.fixture(scope="module")
def frontend(server):
    return openai_frontend(server)


def test_the_server_serves_the_fuzzed_document(frontend):
    with urllib.request.urlopen(frontend + "/openapi.json", timeout=10) as r:
        assert json.loads(r.read()) == json.loads(json.dumps(DOCUMENT))


@load(MAX_EXAMPLES).parametrize()
def test_fuzz_the_openai_api(case, frontend):
    response = case.call_and_validate(base_url=frontend, checks=CHECKS)
    STATUSES[case.operation.label, response.status_code] += 1


def test_the_fuzzing_reached_the_engine_and_left_nothing_behind(server):
    print(sum(STATUSES.values()), "cases:", dict(STATUSES))
    for op in ("POST /v1/completions", "POST /v1/chat/completions"):
        # Which cases hypothesis runs shifts with the schema and with shrinking: a floor
        # that shows the engine was reached, not a count.
        assert STATUSES[op, 200] >= 5 and STATUSES[op, 400] >= 20, STATUSES
    wait_blocks_free(server, timeout_s=30)


@load(5, key=False).include(path_regex="^/v1/").parametrize()
def test_without_the_key_every_v1_operation_is_401(case, frontend):
    response = case.call_and_validate(base_url=frontend, checks=[status_code_conformance, response_schema_conformance,
                                                                 response_headers_conformance])
    assert response.status_code == 401, response.text
