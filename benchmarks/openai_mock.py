"""A minimal OpenAI chat-completions server that answers at once, without a model: it
separates client behaviour (genai-perf, perf_analyzer) from the serving stack's (issue 49).

    python -m benchmarks.openai_mock --port 19010
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

app = FastAPI()
COUNT = {"requests": 0, "streamed": 0}
WORDS = ["mock", " token"]


@app.get("/v1/models")
def models() -> dict:
    return {"object": "list", "data": [{"id": "llm", "object": "model", "created": 0, "owned_by": "mock"}]}


@app.get("/stats")
def stats() -> dict:
    return COUNT


@app.post("/v1/chat/completions")
async def chat(request: Request):
    body = await request.json()
    COUNT["requests"] += 1
    n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.get("model", "llm")

    def chunk(delta: dict, finish=None) -> str:
        return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    if body.get("stream"):
        COUNT["streamed"] += 1

        def events():
            yield chunk({"role": "assistant", "content": ""})
            for i in range(n):
                yield chunk({"content": WORDS[i % 2]}, "length" if i == n - 1 else None)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    text = "".join(WORDS[i % 2] for i in range(n))
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}})


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.openai_mock")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=19010)
    a = ap.parse_args()
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
