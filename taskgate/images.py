"""Input images: decoded safely, normalised to one canonical form, and fitted to a request's frame size.

Whatever arrives (PNG, JPEG or WebP; any orientation, mode or metadata) is decoded with Pillow, checked, turned
upright (EXIF orientation), made RGB (transparency flattened onto white) and stored as a PNG holding nothing but
the pixels. The stored bytes are the input's identity: their sha256 names it, enters the request hash, and is what
the worker reads back. Re-encoding also means a polyglot file (an image that is also an archive or a script)
never reaches the store as sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from PIL import Image, ImageOps, UnidentifiedImageError

from taskgate.config import INPUT_FORMATS

CONTENT_TYPE = "image/png"
PREFIX = "inputs/"  # where inputs live in the result store, beside the outputs
Fit = Literal["crop", "resize", "pad"]
_BACKGROUND = (255, 255, 255)


class ImageRefused(ValueError):
    """An image that cannot be used; the message says why, in words a client can act on."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What an input image may be: its formats, its largest sides, and its size in bytes as sent."""

    formats: tuple[str, ...] = INPUT_FORMATS
    max_width: int = 4096
    max_height: int = 4096
    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 4096 * 4096  # what decoding may hold: about 3 bytes a pixel, whatever the file's size


@dataclass(frozen=True, slots=True)
class Canonical:
    """A checked image in its canonical form: an RGB PNG, named by its sha256."""

    png: bytes
    sha256: str
    width: int
    height: int
    source_format: str  # the format it arrived in
    source_bytes: int

    @property
    def name(self) -> str:
        """Its object name in the result store."""
        return object_name(self.sha256)


def object_name(sha256: str) -> str:
    """The result-store name of the input with this sha256."""
    return f"{PREFIX}{sha256}.png"


def pixels(data: bytes, limits: Limits) -> int:
    """How many pixels decoding `data` would hold, from its header alone (nothing is decoded); ImageRefused for what
    `canonical` would refuse before decoding (empty, too large as sent or decoded, not an allowed image, animated)."""
    with _opened(data, limits) as image:
        return int(image.width * image.height)


@contextlib.contextmanager
def _opened(data: bytes, limits: Limits) -> Iterator[Image.Image]:
    """The image in `data` opened (its header read, no pixel decoded) and checked against `limits`; every failure of
    Pillow inside the block is an ImageRefused saying why."""
    if not data:
        raise ImageRefused("is empty")
    if len(data) > limits.max_bytes:
        raise ImageRefused(f"larger than {limits.max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(limits.formats))
            width, height = image.size
            if width > limits.max_width or height > limits.max_height:
                raise ImageRefused(f"is {width}x{height}; at most {limits.max_width}x{limits.max_height} is allowed")
            if width < 1 or height < 1:
                raise ImageRefused("has no pixels")
            if width * height > limits.max_pixels:
                raise ImageRefused(
                    f"is {width}x{height} = {width * height} pixels; at most {limits.max_pixels} are allowed"
                )
            if getattr(image, "is_animated", False) or getattr(image, "n_frames", 1) > 1:
                raise ImageRefused("is animated; send a single frame")
            yield image
    except ImageRefused:
        raise
    except UnidentifiedImageError:
        raise ImageRefused(f"is not an image in an allowed format ({', '.join(limits.formats)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageRefused("decodes to too many pixels") from None
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as exc:
        raise ImageRefused(f"cannot be decoded ({type(exc).__name__}: truncated or corrupt)") from None


def canonical(data: bytes, limits: Limits) -> Canonical:
    """The image in `data`, checked against `limits` and normalised; ImageRefused says why not.

    The header is read first and the sides and pixel count checked before any pixel is decoded, so a tiny file that
    claims huge sides costs nothing; animated images are refused (no frame is picked silently). The decoded pixels are
    held once (turned upright in place, not copied to RGB when they are RGB already): about 3 bytes a pixel.
    """
    with _opened(data, limits) as image:
        source_format = str(image.format)
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
        upright = image
    try:
        rgb = _rgb(upright)
    except MemoryError:
        raise ImageRefused("decodes to too many pixels") from None
    out = io.BytesIO()
    rgb.save(out, format="PNG", compress_level=6)
    png = out.getvalue()
    return Canonical(png, hashlib.sha256(png).hexdigest(), rgb.width, rgb.height, source_format, len(data))


def _rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode as 8-bit RGB: 16- and 32-bit greys scaled down, transparency flattened onto white."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        image = image.convert("I")
    if image.mode == "I":
        image = image.point(lambda v: v * (1 / 256)).convert("L")
    elif image.mode == "F":
        image = image.convert("L")
    if image.mode == "P" or image.mode == "PA" or (image.mode in ("L", "RGB") and "transparency" in image.info):
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "La", "RGBa"):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, _BACKGROUND)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image if image.mode == "RGB" else image.convert("RGB")  # no second copy of what is RGB already


def open_canonical(png: bytes) -> Image.Image:
    """A stored canonical input back as an RGB image (the worker's side; it was checked when it was stored)."""
    image = Image.open(io.BytesIO(png), formats=["PNG"])
    image.load()
    return image.convert("RGB")


def fit(image: Image.Image, width: int, height: int, mode: Fit) -> Image.Image:
    """The image at exactly width x height: `crop` scales to cover and cuts the centre, `resize` stretches,
    `pad` scales to fit inside and fills the rest with black."""
    if image.size == (width, height):
        return image
    resample = Image.Resampling.LANCZOS
    if mode == "crop":
        return ImageOps.fit(image, (width, height), method=resample)
    if mode == "pad":
        return ImageOps.pad(image, (width, height), method=resample, color=(0, 0, 0))
    return image.resize((width, height), resample=resample)
