"""benchmarks/chat_under_slow_grammars.py end to end against a stand-in OpenAI server (its
figures come from runs against `make serve`: docs/security.md, item 9)."""

import re
import time

from benchmarks import chat_under_slow_grammars
from tests.helpers.stand_in_http import stand_in_server


def test_times_plain_chat_alone_during_and_after_the_slow_schemas(capsys):
    def answer(path, headers, body):
        if "response_format" in body:           # a slow schema: refused at its time limit
            time.sleep(0.3)
            return 400
        return 200

    with stand_in_server(answer) as url:
        chat_under_slow_grammars.main(["--url", url, "--slow", "2", "--seconds", "0.2", "0.2", "0.2"])
    out = capsys.readouterr().out
    for phase in ("alone", "during", "after"):
        assert re.search(rf"plain {phase} *n=\d+ p50=\d+ ms max=\d+ ms codes=\[200\]", out), out
    slow = re.search(r"slow schemas \[400\] \[([\d.]+), ([\d.]+)\]", out)
    assert slow and all(float(t) >= 0.3 for t in slow.groups()), out
