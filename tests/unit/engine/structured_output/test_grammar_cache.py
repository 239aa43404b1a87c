"""backend/engine/structured_output/grammar_cache.py: compiled grammars kept, bounded in bytes."""

from backend.engine.structured_output.grammar_cache import GrammarCache, cache_key


def test_the_least_recently_used_go_first_past_the_bound():
    cache = GrammarCache(limit_bytes=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"                    # a is now the most recent
    cache.put("c", "C", 40)
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.size_bytes == 80 and len(cache) == 2


def test_one_larger_than_the_bound_is_not_kept():
    cache = GrammarCache(limit_bytes=100)
    cache.put("a", "A", 40)
    cache.put("huge", "H", 101)
    assert cache.get("huge") is None and cache.get("a") == "A"


def test_the_key_is_the_text_compiled():
    """Key order is the order the grammar makes the model write properties in: two
    schemas that differ only there are two grammars."""
    assert cache_key("guided_json", {"a": 1, "b": 2}) != cache_key("guided_json", {"b": 2, "a": 1})
    assert cache_key("guided_json", {"a": 1}) == cache_key("guided_json", {"a": 1})
    assert cache_key("guided_regex", "x") != cache_key("guided_grammar", "x")
