"""The Grafana dashboard (deploy/monitoring) against the session's real tritonserver:
after one request, every metric family it queries is in Triton's /metrics, except
speculative decoding's, which only a server with a speculative_config exports
(tests/integration/test_speculative_serving.py reads it from one)."""

import json
import os
import time

from clients.triton_client import StreamingRequest
from tests.helpers.dashboard import DASHBOARD, ROOT, queried_families

SPECULATION_ONLY = {"llm_spec_decode_acceptance_rate"}


def test_every_family_the_dashboard_queries_is_in_a_real_servers_metrics(server):
    assert StreamingRequest(server.grpc_url).run("The with statement", {"max_tokens": 4, "temperature": 0}).ok
    with open(DASHBOARD) as f:
        queried = queried_families(json.load(f))
    deadline = time.monotonic() + 30        # (gauges such as the LoRA info arrive with the watcher's next push)
    while True:
        text = server.metrics()
        present = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
        present |= {name.rsplit("_", 1)[0] for name in present if name.endswith(("_bucket", "_sum", "_count"))}
        missing = queried - SPECULATION_ONLY - present
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, missing
    spec_test = open(os.path.join(ROOT, "tests", "integration", "test_speculative_serving.py")).read()
    assert all(f'"{name}"' in spec_test for name in SPECULATION_ONLY & queried)
