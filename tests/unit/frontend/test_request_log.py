"""Request logging is off unless asked (frontend/openai_api/request_log.py)."""

import logging

from frontend.openai_api.app import create_app
from frontend.openai_api.request_log import RequestLog


def test_off_by_default_logs_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="frontend.requests")
    log = create_app("127.0.0.1:1").state.request_log
    log.received("cmpl-1", "llm", "my secret prompt", {"max_tokens": 3})
    log.finished("cmpl-1", ["my secret output"], ["length"])
    assert caplog.records == []


def test_on_logs_prompt_parameters_and_output_cut_to_max_log_len(caplog):
    caplog.set_level(logging.INFO, logger="frontend.requests")
    log = RequestLog(enabled=True, max_len=9)
    log.received("cmpl-1", "llm", "my secret prompt", {"max_tokens": 3})
    log.finished("cmpl-1", ["my secret output"], ["length"])
    text = caplog.text
    assert "cmpl-1" in text and "'my secret'" in text and '"max_tokens": 3' in text and "['length']" in text
    assert "prompt" not in text.replace("prompt=", "") and "output'" not in text
    RequestLog(enabled=True).received("cmpl-2", "llm", [{"role": "user", "content": "hi"}], {})
    assert '"content": "hi"' in caplog.text
