"""Probes for behaviour that Triton's tests check AFTER an assertion we fail for an allowed
reason (e.g. a random model's tool arguments), so those later checks still get looked at.
Usage: probes.py [BASE_URL]"""
import json
import sys

import httpx
import openai

BASE = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:19100").rstrip("/")
c = openai.OpenAI(base_url=BASE + "/v1", api_key="EMPTY")
MODEL = "llm"
WEATHER = {"type": "function", "function": {"name": "get_current_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "state": {"type": "string"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "state", "unit"]}}}
FORECAST = {"type": "function", "function": {"name": "get_n_day_weather_forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "state": {"type": "string"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "num_days": {"type": "integer"}},
    "required": ["city", "state", "unit", "num_days"]}}}
MSGS = [{"role": "system", "content": "You're a helpful assistant!"},
        {"role": "user", "content": "What is the weather in Dallas, Texas in Fahrenheit?"}]
results = []


def check(name, ok, detail=""):
    results.append((name, ok))
    print(("PASS " if ok else "FAIL ") + name + (f"  [{detail}]" if detail else ""))


def stream_tool(**kw):
    s = c.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_completion_tokens=128,
                                  tools=[WEATHER, FORECAST], stream=True, **kw)
    finishes, role, names, ids, args, ncalls_bad = [], None, {}, [], {}, False
    for ch in s:
        ch0 = ch.choices[0]
        if ch0.finish_reason:
            finishes.append(ch0.finish_reason)
        if ch0.delta.role:
            role = ch0.delta.role
        tcs = ch0.delta.tool_calls or []
        if len(tcs) > 1:
            ncalls_bad = True
        for tc in tcs:
            if tc.id:
                ids.append(tc.id)
            if tc.function and tc.function.name:
                names.setdefault(tc.index, []).append(tc.function.name)
            if tc.function and tc.function.arguments:
                args[tc.index] = args.get(tc.index, "") + tc.function.arguments
    return finishes, role, names, ids, args, ncalls_bad


for label, choice, want in [("named", {"type": "function", "function": {"name": "get_n_day_weather_forecast"}}, FORECAST),
                            ("required", "required", None)]:
    r = c.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_completion_tokens=128,
                                  tools=[WEATHER, FORECAST], tool_choice=choice)
    ch = r.choices[0]
    tcs = ch.message.tool_calls or []
    print(f"INFO {label}: {len(tcs)} tool call(s), finish_reason {ch.finish_reason!r}")
    check(f"{label}: at least one tool call", len(tcs) >= 1, f"{len(tcs)}")
    if want:  # OpenAI and vLLM: 'stop' for a named tool_choice ('tool_calls' for auto/required)
        check(f"{label}: finish_reason 'stop' (OpenAI/vLLM for a named tool)", ch.finish_reason == "stop", ch.finish_reason)
    for t in tcs[:1]:
        tool = want or next(x for x in (WEATHER, FORECAST) if x["function"]["name"] == t.function.name)
        a = json.loads(t.function.arguments)
        props = tool["function"]["parameters"]["properties"]
        check(f"{label}: args have the required keys and types", set(a) >= set(tool["function"]["parameters"]["required"])
              and all(isinstance(a[k], int if props[k]["type"] == "integer" else str) for k in a if k in props), str(a)[:80])
        if want:
            check(f"{label}: name", t.function.name == want["function"]["name"], tcs[0].function.name)
    fin, role, names, ids, args, bad = stream_tool(tool_choice=choice)
    check(f"{label} stream: one finish_reason", len(fin) == 1, str(fin))
    check(f"{label} stream: finish_reason == non-streamed", fin[-1:] == [ch.finish_reason], f"{fin} vs {ch.finish_reason}")
    check(f"{label} stream: role assistant", role == "assistant", str(role))
    check(f"{label} stream: at most one tool call per delta", not bad)
    check(f"{label} stream: each call's name streamed once", all(len(v) == 1 for v in names.values()), str(names))
    check(f"{label} stream: one id per call", len(ids) == len(names), str(ids))
    check(f"{label} stream: same calls as non-streamed", [v[0] for _, v in sorted(names.items())] == [t.function.name for t in tcs],
          f"{names} vs {[t.function.name for t in tcs]}")
    for i, t in enumerate(tcs):
        try:
            same = json.loads(args.get(i, "")) == json.loads(t.function.arguments)
            detail = args.get(i, "")[:80]
        except ValueError as e:
            same, detail = False, f"unparsable JSON ({e}): {t.function.arguments[:60]!r}"
        check(f"{label} call {i}: streamed args == non-streamed, both valid JSON", same, detail)

# required with parallel_tool_calls=false: exactly one call
r = c.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_completion_tokens=128,
                              tools=[WEATHER, FORECAST], tool_choice="required", parallel_tool_calls=False)
check("required + parallel_tool_calls=false: exactly one call", len(r.choices[0].message.tool_calls or []) == 1,
      f"{len(r.choices[0].message.tool_calls or [])} calls, finish {r.choices[0].finish_reason}")

# finish_reason without max_tokens: how long does the default run?
r = c.completions.create(model=MODEL, prompt="What is machine learning?")
print(f"INFO completions default: finish={r.choices[0].finish_reason} completion_tokens={r.usage.completion_tokens}")
r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is machine learning?"}])
print(f"INFO chat default: finish={r.choices[0].finish_reason} completion_tokens={r.usage.completion_tokens}")

h = httpx.Client(base_url=BASE, timeout=60)
for path in ["/health/ready", "/metrics", "/v1/models/llm", "/v1/embeddings"]:
    resp = h.request("POST" if path == "/v1/embeddings" else "GET", path,
                     **({"json": {"model": MODEL, "input": "x"}} if path == "/v1/embeddings" else {}))
    print(f"INFO {path}: {resp.status_code} {resp.text[:120]!r}")
resp = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}})
print(f"INFO completions stream_options without stream: {resp.status_code} {resp.text[:150]!r}")
resp = h.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 25})
print(f"INFO chat top_logprobs=25: {resp.status_code} {resp.text[:200]!r}")
resp = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "logprobs": 0})
print(f"INFO completions logprobs=0: {resp.status_code} {json.dumps(resp.json().get('choices', [{}])[0].get('logprobs'))[:200]}")
resp = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "logprobs": 2})
print(f"INFO completions logprobs=2 top_logprobs: {json.dumps(resp.json()['choices'][0]['logprobs']['top_logprobs'])[:200]}")
resp = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2, "best_of": 2, "max_tokens": 3})
print(f"INFO completions n=2 best_of=2: {resp.status_code} choices={len(resp.json().get('choices', []))}")
print(f"probes: {sum(ok for _, ok in results)}/{len(results)} pass")
