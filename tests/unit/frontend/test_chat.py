"""Chat prompts: the checkpoint's template (the default model carries one), an override
(--chat-template, a file or the template itself), and clear errors without either."""

import pytest

from frontend.openai_api.chat import ChatTemplates, load_template
from frontend.openai_api.errors import APIError

MESSAGES = [{"role": "user", "content": "hi"}]


def test_checkpoint_template_and_override(tiny_ckpt, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    ids = ChatTemplates().render(tiny_ckpt, "llm", MESSAGES)[1]
    assert ids == [tok.bos_token_id] + tok("user: hi\nassistant:", add_special_tokens=False)["input_ids"]
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    ids = ChatTemplates(load_template(str(path))).render(tiny_ckpt, "llm", MESSAGES)[1]
    assert tok.decode(ids) == "<<hi>>"
    assert load_template("{{ x }}") == "{{ x }}"


def test_no_tokenizer_or_template_is_a_400(tiny_ckpt):
    with pytest.raises(APIError) as e:
        ChatTemplates().render(None, "llm", MESSAGES)[1]
    assert e.value.status == 400 and "--model-repository" in e.value.message
    with pytest.raises(APIError) as e:
        ChatTemplates("{% for m in messages %}{{ m.nope.deeper }}{% endfor %}").render(tiny_ckpt, "llm", MESSAGES)[1]
    assert e.value.status == 400 and e.value.param == "messages"


def test_concurrent_first_requests_load_the_tokenizer_once(tiny_ckpt, monkeypatch):
    """Chat requests tokenize on worker threads: the first ones after a start each
    imported transformers and loaded the tokenizer at once, and half of them failed
    (issue 31). Under the lock, one loads it and the others wait for it."""
    import threading
    import time

    import transformers
    loads = []
    real = transformers.AutoTokenizer.from_pretrained

    def slow_load(path, *a, **kw):
        loads.append(path)
        time.sleep(0.2)                 # a real load takes about this long: the others arrive meanwhile
        return real(path, *a, **kw)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", slow_load)
    chat = ChatTemplates()
    results, errors = [], []

    def first_request():
        try:
            results.append(chat.render(tiny_ckpt, "llm", MESSAGES)[1])
        except Exception as e:          # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=first_request) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 10 and all(r == results[0] for r in results)
    assert loads == [tiny_ckpt]
    chat.load([tiny_ckpt, None])        # at start: already there, nothing loads again
    assert loads == [tiny_ckpt]


def test_a_16_mb_message_is_refused_without_tokenizing_it_whole(tiny_ckpt):
    """With the model's max_model_len known (its config's parameter), a conversation that
    cannot fit is a 400 naming messages after about max_model_len tokens' worth of text."""
    import time
    chat = ChatTemplates()
    huge = [{"role": "user", "content": "The pass statement does nothing at all. " * (16 * 2**20 // 40)}]
    start = time.perf_counter()
    with pytest.raises(APIError) as e:
        chat.render(tiny_ckpt, "llm", huge, max_model_len=1024)[1]
    assert time.perf_counter() - start < 3.0
    assert e.value.status == 400 and e.value.param == "messages" and "max_model_len is 1024" in e.value.message
    assert chat.render(tiny_ckpt, "llm", MESSAGES, max_model_len=1024)[1] == chat.render(tiny_ckpt, "llm", MESSAGES)[1]
