"""What the frontend does once at start, off the request path: load the tokenizer and chat
template of every model tritonserver serves (chat.py), as soon as Triton answers.

Triton may start after the frontend (as `make serve` starts them side by side), so this
retries until the model list comes back; a chat request arriving meanwhile loads its
tokenizer itself, under the same lock.
"""

from __future__ import annotations

import asyncio
import logging

from frontend.openai_api.chat import ChatTemplates

log = logging.getLogger("frontend")


async def preload_tokenizers(llm, chat: ChatTemplates, retry_s: float = 1.0) -> None:
    while True:
        try:
            served = await llm.models()
        except Exception:               # Triton not up yet (APIError 503), or the channel closing
            await asyncio.sleep(retry_s)
            continue
        if served:
            break
        await asyncio.sleep(retry_s)    # up, its models still loading
    checkpoints = sorted({m.checkpoint for m in served.values() if m.checkpoint})
    try:
        await asyncio.to_thread(chat.load, checkpoints)
    except Exception as e:              # a broken tokenizer: its chat requests will say so
        log.warning("could not load a tokenizer at start: %s", e)
        return
    log.info("loaded the tokenizers of %s", ", ".join(sorted(m.name for m in served.values())))
