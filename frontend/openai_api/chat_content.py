"""Chat message content parts: which ones this frontend takes.

The served models read text only, so a part of any other type is a 400 that says what
the model cannot take ("this model does not accept images"), not a part dropped in
silence: a client sending an image must not get an answer about a conversation without
it. The types are OpenAI's (image_url, input_audio, file) and the Responses API's
spellings (input_image, input_file).
"""

from __future__ import annotations

from typing import Any

_REFUSED = {"image_url": "images", "input_image": "images", "image": "images",
            "input_audio": "audio", "audio": "audio", "audio_url": "audio",
            "video_url": "video", "video": "video",
            "file": "files", "input_file": "files"}


def check_parts(parts: list[Any]) -> None:
    """Raises ValueError (a 400 naming the message's content) unless every part is
    `{"type": "text", "text": "..."}`."""
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ValueError("each content part needs a string 'type' ('text')")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError("a part of type 'text' needs a string 'text'")
        elif kind in _REFUSED:
            raise ValueError(f"this model does not accept {_REFUSED[kind]} (a content part of type '{kind}'): "
                             "send text parts only")
        else:
            raise ValueError(f"unsupported content part type {kind!r}: this model takes parts of type 'text'")
