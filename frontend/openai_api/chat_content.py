"""Chat message content parts: which ones this frontend takes.

Text parts, and images as OpenAI's `image_url` parts (the Responses API's
`input_image`) for a model that reads them: as `data:` URLs, or http(s) URLs on a host
that `--allowed-media-domains` names (vLLM's flag; media_fetch.py fetches them). Any
other part is a 400 that says what the model cannot take ("this model does not accept
audio"), not a part dropped in silence: a client sending one must not get an answer
about a conversation without it. Whether the served model reads images is known only
per model, so an image part is checked again when the request is routed
(`image_urls`).
"""

from __future__ import annotations

from typing import Any, Optional

from frontend.openai_api.errors import APIError

_REFUSED = {"input_audio": "audio", "audio": "audio", "audio_url": "audio",
            "video_url": "video", "video": "video",
            "file": "files", "input_file": "files"}
IMAGE_PARTS = ("image_url", "input_image")


def image_url_of(part: dict) -> Optional[str]:
    """An image part's URL (OpenAI: {"image_url": {"url": ...}}; Responses:
    {"image_url": "..."}), or None when the part is no image."""
    kind, value = part.get("type"), part.get("image_url")
    if kind == "image_url":
        return value.get("url") if isinstance(value, dict) else None
    return value if kind == "input_image" else None


def check_parts(parts: list[Any]) -> None:
    """Raises ValueError (a 400 naming the message's content) unless every part is text
    or a well-formed image part."""
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ValueError("each content part needs a string 'type' ('text' or 'image_url')")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError("a part of type 'text' needs a string 'text'")
        elif kind in IMAGE_PARTS:
            if not isinstance(image_url_of(part), str):
                raise ValueError(f"a part of type '{kind}' needs 'image_url' with a string 'url'")
        elif kind in _REFUSED:
            raise ValueError(f"this model does not accept {_REFUSED[kind]} (a content part of type '{kind}'): "
                             "send text or image parts only")
        else:
            raise ValueError(f"unsupported content part type {kind!r}: this model takes parts of type 'text' "
                             "and 'image_url'")


def url_host(url: str) -> str:
    """The host a client library would connect to (yarl's parse, as aiohttp's), "" when
    the URL does not parse."""
    from yarl import URL
    try:
        return (URL(url).host or "").lower()
    except ValueError:
        return ""


def checked_images(urls: list[str], accepts_images: bool, model: str,
                   allowed_domains: tuple[str, ...] = ()) -> list[str]:
    """The request's image URLs, once it is known which model serves it: a 400 when that
    model reads no images, or for a URL that is neither inline data nor http(s) on an
    allowed domain (`--allowed-media-domains`; media_fetch.py fetches those)."""
    if urls and not accepts_images:
        raise APIError(400, f"this model ('{model}') does not accept images (a content part of type 'image_url'): "
                            "send text parts only", "messages")
    for url in urls:
        if url.startswith("data:"):
            continue
        scheme = url.split(":", 1)[0].lower() if ":" in url else url[:16]
        if scheme in ("http", "https") and allowed_domains:
            host = url_host(url)
            if any(host == d or host.endswith("." + d) for d in allowed_domains):
                continue
            raise APIError(400, f"image URL host '{host}' is not among the allowed media domains "
                                f"({', '.join(allowed_domains)}); send the image inline as a data: URL", "messages")
        raise APIError(400, f"image URL scheme '{scheme}' is not accepted: send the image inline as a data: URL "
                            "(data:image/png;base64,...)" + ("" if allowed_domains else
                                                            "; this server fetches no URLs (--allowed-media-domains)"),
                       "messages")
    return urls
