"""Images as requests bring them (PIL images offline; bytes or `data:` URLs when
served), checked before any decoding work is spent on them: each problem is an
InvalidRequestError naming it, a 400 for the request alone."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from backend.engine.errors import InvalidRequestError

# What Pillow decodes here; anything else (SVG, TIFF, PSD, ...) is refused by name.
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024           # encoded size
    max_pixels: int = 64 * 1024 * 1024          # width x height, read from the header first


# Formats told apart by their first bytes, so that a refusal names them.
_OTHER_FORMATS = ((b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"%PDF", "PDF"), (b"8BPS", "PSD"),
                  (b"<svg", "SVG"), (b"<?xml", "SVG"), (b"\x00\x00\x01\x00", "ICO"))


def _decode(data: bytes, limits: ImageLimits):
    from PIL import Image
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"image of {len(data)} bytes exceeds the limit of {limits.max_bytes} bytes "
                                  "(engine argument max_image_bytes)")
    other = next((name for magic, name in _OTHER_FORMATS if data.lstrip()[:len(magic)] == magic), None)
    if other is None and data[4:12] in (b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypavif"):
        other = "HEIC/AVIF"
    if other is not None:
        raise InvalidRequestError(f"unsupported image format {other} (supported formats: "
                                  f"{', '.join(SUPPORTED_FORMATS)})")
    try:
        # Only the header is read here: a decompression bomb is refused by its declared
        # size before a pixel is decoded.
        image = Image.open(io.BytesIO(data), formats=list(SUPPORTED_FORMATS))
    except Image.UnidentifiedImageError:
        raise InvalidRequestError(f"image data is not a decodable image (supported formats: "
                                  f"{', '.join(SUPPORTED_FORMATS)})") from None
    except Exception as e:      # (Pillow raises several kinds on a corrupt header)
        raise InvalidRequestError(f"image data is not a decodable image: {e}") from None
    check_pixels(image, limits)
    try:
        image.load()
    except Exception as e:
        raise InvalidRequestError(f"image data could not be decoded: {e}") from None
    return image


def check_pixels(image, limits: ImageLimits) -> None:
    w, h = image.size
    if w < 1 or h < 1:
        raise InvalidRequestError(f"image of {w}x{h} pixels is empty")
    if w * h > limits.max_pixels:
        raise InvalidRequestError(f"image of {w}x{h} pixels exceeds the limit of {limits.max_pixels} pixels "
                                  "(engine argument max_image_pixels)")


def image_from_data_url(url: str, limits: ImageLimits):
    """A `data:image/...;base64,` URL. Others (http(s), file) are refused: the engine
    fetches nothing."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise InvalidRequestError(f"image URL scheme '{scheme}' is not accepted: send the image inline as a "
                                  "data: URL (data:image/png;base64,...); this server fetches no URLs")
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise InvalidRequestError("image data URL must be base64-encoded (data:image/png;base64,...)")
    mime = header[len("data:"):].split(";", 1)[0].lower()
    if mime and not mime.startswith("image/"):
        raise InvalidRequestError(f"data URL media type '{mime}' is not an image")
    max_b64 = limits.max_bytes * 4 // 3 + 4
    if len(payload) > max_b64:
        raise InvalidRequestError(f"image of about {len(payload) * 3 // 4} bytes exceeds the limit of "
                                  f"{limits.max_bytes} bytes (engine argument max_image_bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image data URL is not valid base64") from None
    return _decode(data, limits)


def load_image(source: Any, limits: ImageLimits):
    """A PIL image from what a request sent: a PIL image, bytes, or a data: URL string."""
    from PIL import Image
    if isinstance(source, Image.Image):
        check_pixels(source, limits)
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), limits)
    if isinstance(source, str):
        return image_from_data_url(source, limits)
    raise InvalidRequestError(f"an image must be a PIL image, bytes or a data: URL, not {type(source).__name__}")
