"""Images by URL (frontend/openai_api/media_fetch.py, chat_content.checked_images): only
hosts that --allowed-media-domains names are fetched, from a real local HTTP server here;
redirects, errors, oversized bodies and slow answers are 400s naming the host."""

import asyncio
import base64
import http.server
import threading
import time

import pytest

from frontend.openai_api.chat_content import checked_images
from frontend.openai_api.errors import APIError
from frontend.openai_api.media_fetch import MediaFetcher, domains_value

PNG = b"\x89PNG\r\n\x1a\n" + bytes(64)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.example/cat.png")
            self.end_headers()
        elif self.path == "/large.png":
            body = PNG + bytes(300_000)     # many reads' worth
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/big":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(bytes(5000))
        elif self.path == "/slow":
            time.sleep(1.0)
            self.send_response(200)
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def fetch(urls, **kw):
    async def go():
        fetcher = MediaFetcher(("127.0.0.1",), **kw)
        try:
            return await fetcher.inline(urls)
        finally:
            await fetcher.close()
    return asyncio.run(go())


def test_an_allowed_host_is_fetched_and_inlined(server):
    data = "data:image/gif;base64,R0lGOD"
    assert fetch([server + "/cat.png", data]) == [f"data:image/png;base64,{base64.b64encode(PNG).decode()}", data]
    large = fetch([server + "/large.png"])[0]           # read whole, not its first chunk
    assert base64.b64decode(large.split(",", 1)[1]) == PNG + bytes(300_000)
    with pytest.raises(APIError, match="at most 16"):
        fetch([server + "/cat.png"] * 17)


@pytest.mark.parametrize("path, kw, message", [
    ("/moved", {}, "answered HTTP 302 (redirects are not followed)"),
    ("/missing", {}, "answered HTTP 404"),
    ("/big", {"max_bytes": 1000}, "larger than 1000 bytes"),
    ("/slow", {"timeout_s": 0.2}, "took longer than 0.2 s")])
def test_fetch_failures_are_400s_naming_the_host(server, path, kw, message):
    with pytest.raises(APIError) as e:
        fetch([server + path], **kw)
    assert e.value.status == 400 and message in e.value.message and "'127.0.0.1'" in e.value.message


def test_only_named_hosts_pass_the_check():
    allowed = domains_value("example.com, cdn.example.org")
    assert allowed == ("example.com", "cdn.example.org")
    urls = ["https://img.example.com/a.png", "http://cdn.example.org/b.jpg", "data:image/png;base64,AA"]
    assert checked_images(urls, True, "m", allowed) == urls
    for url, message in (("https://example.com.evil.net/a.png", "host 'example.com.evil.net' is not among"),
                         ("http://169.254.169.254/latest", "host '169.254.169.254' is not among"),
                         ("file:///etc/passwd", "scheme 'file'"), ("ftp://example.com/a.png", "scheme 'ftp'"),
                         ("http://example.com@evil.net/a.png", "host 'evil.net' is not among"),
                         ("http://[not-an-address/a.png", "host '' is not among")):
        with pytest.raises(APIError, match=message):
            checked_images([url], True, "m", allowed)
    with pytest.raises(APIError, match="fetches no URLs"):
        checked_images(["https://example.com/a.png"], True, "m")
