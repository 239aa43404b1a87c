"""Chat prompts: the checkpoint's template (the default model carries one), an override
(--chat-template, a file or the template itself), and clear errors without either."""

import pytest

from frontend.openai_api.chat import ChatTemplates, load_template
from frontend.openai_api.errors import APIError

MESSAGES = [{"role": "user", "content": "hi"}]


def test_checkpoint_template_and_override(tiny_ckpt, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    ids = ChatTemplates().prompt_ids(tiny_ckpt, "llm", MESSAGES)
    assert ids == [tok.bos_token_id] + tok("user: hi\nassistant:", add_special_tokens=False)["input_ids"]
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    ids = ChatTemplates(load_template(str(path))).prompt_ids(tiny_ckpt, "llm", MESSAGES)
    assert tok.decode(ids) == "<<hi>>"
    assert load_template("{{ x }}") == "{{ x }}"


def test_no_tokenizer_or_template_is_a_400(tiny_ckpt):
    with pytest.raises(APIError) as e:
        ChatTemplates().prompt_ids(None, "llm", MESSAGES)
    assert e.value.status == 400 and "--model-repository" in e.value.message
    with pytest.raises(APIError) as e:
        ChatTemplates("{% for m in messages %}{{ m.nope.deeper }}{% endfor %}").prompt_ids(tiny_ckpt, "llm", MESSAGES)
    assert e.value.status == 400 and e.value.param == "messages"
