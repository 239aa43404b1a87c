"""TensorRT-LLM's multimodal ensemble inputs, per batch row, as the `llm` model's `image`
input (base64 image files, the vLLM backend's contract):
- `image_bytes_input`: raw pixels, uint8 [num_images, C, H, W] or [num_images, H, W, C]
  (C 3 or 4), each written losslessly as PNG;
- `image_url_input`: URLs, one per image; `data:` URLs only (this backend fetches nothing);
- `image_input` (pixels already through the vision encoder's processor, fp16) is refused:
  this engine runs the checkpoint's own processor.
At most one of them per request, as TensorRT-LLM's preprocessing takes."""

from __future__ import annotations

import base64
import io
from typing import Optional

import numpy as np

from backend.engine.errors import InvalidRequestError

# The engine's default max_image_pixels: checked again there, with its own setting.
MAX_PIXELS = 64 * 1024 * 1024
IMAGE_INPUTS = ("image_bytes_input", "image_url_input", "image_input")
INPUT_SPECS = [{"name": "image_bytes_input", "data_type": "TYPE_UINT8", "dims": [-1, -1, -1, -1], "optional": True},
               {"name": "image_url_input", "data_type": "TYPE_STRING", "dims": [-1], "optional": True},
               {"name": "image_input", "data_type": "TYPE_FP16", "dims": [-1, -1, -1, -1], "optional": True}]


def row_images(rows: dict[str, Optional[np.ndarray]]) -> list[bytes]:
    """A row's images as base64 text of image files ([] when it has none). `rows`: each
    image input's row (None: not sent)."""
    sent = [name for name in IMAGE_INPUTS if rows.get(name) is not None and rows[name].size]
    if not sent:
        return []
    if len(sent) > 1:
        raise InvalidRequestError(f"inputs {' and '.join(sent)}: send one image input per request")
    name, row = sent[0], rows[sent[0]]
    if name == "image_input":
        raise InvalidRequestError("input 'image_input' (pixels already processed for the vision encoder) is not "
                                  "supported: send the images as 'image_bytes_input' or 'image_url_input'; this "
                                  "backend runs the checkpoint's own image processor")
    if name == "image_url_input":
        return [_data_url_payload(value, i) for i, value in enumerate(row.reshape(-1))]
    return [base64.b64encode(_png(image, i)) for i, image in enumerate(_images(row))]


def _data_url_payload(value, i: int) -> bytes:
    text = bytes(value).decode("utf-8", "replace") if not isinstance(value, str) else value
    if not text.startswith("data:"):
        scheme = text.split(":", 1)[0] if ":" in text else text[:16]
        raise InvalidRequestError(f"input 'image_url_input' element {i}: URL scheme '{scheme}' is not accepted: "
                                  "this backend fetches no URLs; send a data: URL or 'image_bytes_input'")
    return text.encode()


def _images(row: np.ndarray) -> list[np.ndarray]:
    if row.ndim == 3:           # one image without its count
        row = row[None]
    if row.ndim != 4:
        raise InvalidRequestError(f"input 'image_bytes_input' must be [num_images, C, H, W] or [num_images, H, W, C] "
                                  f"per batch row, got {list(row.shape)}")
    if row.shape[1] in (3, 4) and row.shape[-1] not in (3, 4):
        row = row.transpose(0, 2, 3, 1)         # channels last, as PIL takes them
    if row.shape[-1] not in (3, 4):
        raise InvalidRequestError(f"input 'image_bytes_input': images need 3 or 4 channels, got shape "
                                  f"{list(row.shape)}")
    if row.shape[1] * row.shape[2] > MAX_PIXELS:
        raise InvalidRequestError(f"input 'image_bytes_input': images of {row.shape[2]}x{row.shape[1]} pixels exceed "
                                  f"{MAX_PIXELS} pixels")
    return list(np.ascontiguousarray(row, dtype=np.uint8))


def _png(image: np.ndarray, i: int) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    try:
        Image.fromarray(image).save(out, format="PNG")
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"input 'image_bytes_input' image {i}: {e}") from None
    return out.getvalue()
