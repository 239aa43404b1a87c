"""Images by http(s) URL, for hosts that `--allowed-media-domains` names (vLLM's flag):
fetched here, on the event loop without blocking it (aiohttp), each within a time limit
and a size limit, redirects not followed (a redirect could leave the allowed hosts), and
passed on as data: URLs. Any failure is a 400 naming the URL's host and what went wrong.
Without the flag nothing is fetched (chat_content.py refuses such URLs)."""

from __future__ import annotations

import asyncio
import base64
from typing import Optional
from urllib.parse import urlsplit

from frontend.openai_api.errors import APIError

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_TIMEOUT_S = 5.0         # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
MAX_FETCHED_IMAGES = 16         # (the engine's default limit_mm_per_prompt: more would be refused there)


class MediaFetcher:
    def __init__(self, allowed_domains: tuple[str, ...] = (), max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.allowed_domains = tuple(d.strip().lower().lstrip(".") for d in allowed_domains if d.strip())
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self._session = None

    async def inline(self, urls: list[str]) -> list[str]:
        """The URLs (checked already: data: or an allowed host's) as data: URLs."""
        if all(u.startswith("data:") for u in urls):
            return urls
        fetched = sum(not u.startswith("data:") for u in urls)
        if fetched > MAX_FETCHED_IMAGES:
            raise APIError(400, f"{fetched} image URLs to fetch; a request may have at most {MAX_FETCHED_IMAGES}",
                           "messages")
        fetched = iter(await asyncio.gather(*(self._fetch(u) for u in urls if not u.startswith("data:"))))
        return [u if u.startswith("data:") else next(fetched) for u in urls]

    async def _fetch(self, url: str) -> str:
        import aiohttp
        host = urlsplit(url).hostname or ""
        if self._session is None:
            # auto_decompress off: the size limit counts the bytes that arrive, not what a
            # compressed body would expand to.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  auto_decompress=False)
        try:
            async with self._session.get(url, allow_redirects=False) as r:
                if r.status != 200:
                    raise APIError(400, f"fetching the image at host '{host}' answered HTTP {r.status}"
                                        + (" (redirects are not followed)" if 300 <= r.status < 400 else ""),
                                   "messages")
                declared = r.content_length
                if declared is not None and declared > self.max_bytes:
                    raise self._too_large(host)
                data = bytearray()
                async for chunk in r.content.iter_chunked(64 * 1024):
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise self._too_large(host)
                mime = (r.content_type or "image/png").lower()
        except asyncio.TimeoutError:
            raise APIError(400, f"fetching the image at host '{host}' took longer than {self.timeout_s:g} s",
                           "messages") from None
        except aiohttp.ClientError as e:
            raise APIError(400, f"fetching the image at host '{host}' failed: {e}", "messages") from None
        return f"data:{mime};base64,{base64.b64encode(bytes(data)).decode()}"

    def _too_large(self, host: str) -> APIError:
        return APIError(400, f"the image at host '{host}' is larger than {self.max_bytes} bytes", "messages")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def domains_value(value: Optional[str]) -> tuple[str, ...]:
    """--allowed-media-domains: comma- or space-separated host names."""
    return tuple(d for d in (value or "").replace(",", " ").split() if d)
