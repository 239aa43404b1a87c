"""benchmarks/event_loop_stall.py end to end at a small size (its figures come from runs on
the default model's tokenizer: docs/security.md, items 2 and 11)."""

import re

from benchmarks import event_loop_stall


def test_times_the_loops_longest_wait_while_each_huge_prompt_is_refused(tiny_ckpt, capsys):
    event_loop_stall.main(["--checkpoint", tiny_ckpt, "--mib", "1", "--trials", "1", "--max-model-len", "64"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["/tokenize", "400"], ["/v1/completions", "400"]], lines
    assert all(re.search(r"\d+ ms +loop's longest wait +[\d.]+ ms$", line) for line in lines), lines
