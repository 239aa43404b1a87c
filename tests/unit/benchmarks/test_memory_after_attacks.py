"""benchmarks/memory_after_attacks.py end to end against a stand-in HTTP server (its figures
come from runs against `make serve`: docs/archive/benchmarks.md section 36)."""

import json

from benchmarks import memory_after_attacks
from tests.helpers.stand_in_http import stand_in_server


def test_sends_each_attack_and_reads_the_memory_of_the_named_processes(capsys):
    seen = []

    def answer(path, headers, body):
        seen.append((path, headers.get("authorization"), body))
        return 400 if path == "/tokenize" else 200

    with stand_in_server(answer) as url:
        memory_after_attacks.main(["--openai", url, "--http", url, "--grpc", "", "--api-key", "k", "--repeat", "1",
                                   "--settle-s", "0"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[1] == {"warm_up_statuses": [200, 400, 200, 200]}
    attacks = {line["attack"]: line for line in lines if "attack" in line}
    assert sorted(attacks) == ["echo_logprobs_15mb", "generate_15mb", "responses_10mb_reasoning", "tokenize_15mb"]
    assert attacks["tokenize_15mb"]["statuses"] == [400]
    # the attacks at full size: 15 MB prompts, a 10 MB reasoning field; the key on the OpenAI routes only
    sizes = {path: len(json.dumps(body)) for path, _, body in seen[4:]}
    assert sizes["/tokenize"] > 15_000_000 and sizes["/v1/responses"] > 10_000_000
    assert {path: auth for path, auth, _ in seen[4:]} == {"/v1/responses": "Bearer k", "/tokenize": "Bearer k",
                                                          "/v1/completions": "Bearer k",
                                                          "/v2/models/llm/generate": None}
    assert memory_after_attacks.rss_mb("pytest") > 0               # this process's own memory, read from /proc
