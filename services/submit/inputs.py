"""Input images of image-to-video requests: taken inline, fetched from a URL or named by an upload; checked before
anything is queued, then recorded and stored under their content hash. Text attachments of chat tasks: uploaded
(UTF-8, content type text/plain), recorded and stored the same way, and read back when a chat message names one.

A request's image is resolved in two steps: `check` (decode, limits, ownership of an upload: every refusal names
its field, nothing is written) and, once the whole request is valid, `keep` (the row, then the object, so a
concurrent retention pass cannot delete the object of a row it did not see).
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from taskgate import errors, images, netguard, text
from taskgate.config import GatewaySettings, ModelSpec
from taskgate.results import ResultNotFound, ResultStore
from taskgate.store import inputs as input_store
from taskgate.store.inputs import StoredInput, StoredText
from taskgate.store.pool import Conn
from taskgate_api.v1 import gateway_pb2, task_pb2

USER_AGENT = "taskgate-inputs/1"
TEXT = "text/plain"  # UploadInputRequest.content_type of a text attachment
_SHA256_CHARS = frozenset("0123456789abcdef")


class FetchRefused(Exception):
    """An image URL that could not be used; the message says why."""


@dataclass(frozen=True, slots=True)
class Checked:
    """A request's image, valid for its model: new pixels to store, or an upload the tenant already holds."""

    new: images.Canonical | None = None
    stored: StoredInput | None = None

    @property
    def sha256(self) -> str:
        """The image's identity: its canonical PNG's sha256."""
        if self.stored is not None:
            return self.stored.sha256
        assert self.new is not None
        return self.new.sha256


def _limits(settings: GatewaySettings, spec: ModelSpec | None) -> images.Limits:
    """A model's image limits, or the upload limits without a model."""
    formats, most = tuple(settings.input_formats), settings.input_max_pixels
    if spec is None:
        side = settings.input_max_side
        return images.Limits(formats, side, side, settings.input_max_bytes, most)
    return images.Limits(formats, spec.max_image_width, spec.max_image_height, spec.max_image_bytes, most)


class PixelBudget:
    """The pixels a process may be decoding at once (memory is about 3 to 12 bytes a pixel while an image is checked):
    a decode waits, first come first served, until its pixels fit, and gives them back when its thread has finished —
    not when its caller left, since the thread runs on."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._free = total
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def decode(self, data: bytes, limits: images.Limits) -> images.Canonical:
        """`images.canonical(data, limits)` on a thread once its pixels fit the budget; ImageRefused as it raises."""
        need = min(await asyncio.to_thread(images.pixels, data, limits), self._total)  # the header: refusals never wait
        if self._waiting or self._free < need:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append((need, turn))
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._give_back(need)  # granted as the caller left
                else:
                    self._waiting.remove((need, turn))
                    self._wake()  # it may have held back smaller ones behind it
                raise
        else:
            self._free -= need
        running = asyncio.ensure_future(asyncio.to_thread(images.canonical, data, limits))
        running.add_done_callback(lambda _: self._give_back(need))
        return await asyncio.shield(running)

    def _give_back(self, pixels: int) -> None:
        self._free += pixels
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._waiting[0][0] <= self._free:
            need, turn = self._waiting.popleft()
            if not turn.done():
                self._free -= need
                turn.set_result(None)


class InputImages:
    """Checks, fetches and keeps input images for one gateway: its pool, its result store, its settings."""

    def __init__(self, pool: Conn, store: ResultStore, settings: GatewaySettings) -> None:
        self._pool = pool
        self._store = store
        self._settings = settings
        self._client: httpx.AsyncClient | None = None
        self._budget = PixelBudget(settings.input_decode_pixels)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            verify: ssl.SSLContext | bool = True
            if self._settings.input_fetch_ca_file is not None:
                verify = ssl.create_default_context(cafile=str(self._settings.input_fetch_ca_file))
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                verify=verify,
                timeout=httpx.Timeout(self._settings.input_fetch_timeout_seconds),
                trust_env=False,  # never through an environment proxy: the checked address is pinned
                headers={
                    "user-agent": USER_AGENT,
                    "accept": "image/png, image/jpeg, image/webp",
                    "accept-encoding": "identity",
                },
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def check(
        self, tenant: str, image: gateway_pb2.ImageInput, spec: ModelSpec, bad: list[tuple[str, str]], *, within: float
    ) -> Checked | None:
        """The request's image if it is usable by `spec`'s model; otherwise None, with the reason added to `bad`."""
        limits = _limits(self._settings, spec)
        source = image.WhichOneof("source")
        if source is None:
            bad.append(("image", "needs one of data, url or upload_sha256"))
            return None
        if source == "upload_sha256":
            sha256 = image.upload_sha256
            if len(sha256) != 64 or not set(sha256) <= _SHA256_CHARS:
                bad.append(("image.upload_sha256", "must be the 64 lower-case hex digits UploadInput answered with"))
                return None
            stored = await input_store.use(self._pool, tenant, sha256, within=within)
            if stored is None:
                bad.append(("image.upload_sha256", "names no input image of this tenant (never uploaded, or expired)"))
                return None
            if stored.width > limits.max_width or stored.height > limits.max_height:
                bad.append((
                    "image.upload_sha256",
                    f"the image is {stored.width}x{stored.height}; this model takes at most "
                    f"{limits.max_width}x{limits.max_height}",
                ))
                return None
            return Checked(stored=stored)
        field = f"image.{source}"
        if source == "url":
            try:
                data = await self._fetch(image.url, limits.max_bytes)
            except FetchRefused as exc:
                bad.append((field, str(exc)))
                return None
        else:
            data = image.data
        try:
            return Checked(new=await self._budget.decode(data, limits))
        except images.ImageRefused as exc:
            bad.append((field, str(exc)))
            return None

    async def keep(self, tenant: str, checked: Checked, *, within: float) -> StoredInput:
        """The image recorded for the tenant and written to the result store (the row first: see submit_keep_input)."""
        if checked.stored is not None:
            return checked.stored
        new = checked.new
        assert new is not None
        uri = self._store.uri_of(new.name)
        row = await input_store.keep(
            self._pool, tenant, StoredInput(new.sha256, uri, new.width, new.height, len(new.png)), within=within
        )
        await self._store.put(new.name, new.png, images.CONTENT_TYPE)
        return row

    async def upload(
        self, tenant: str, parts: AsyncIterator[gateway_pb2.UploadInputRequest], *, within: float
    ) -> gateway_pb2.UploadInputResponse:
        """An UploadInput stream's image (checked against the upload limits) or text attachment (the first part's
        content_type text/plain), recorded and stored."""
        limits = _limits(self._settings, None)
        received = bytearray()
        kind: str | None = None
        cap = limits.max_bytes
        async for part in parts:
            if kind is None:
                kind = part.content_type.split(";", 1)[0].strip().lower()
                if kind == TEXT:
                    cap = 4 * self._settings.max_input_chars  # UTF-8 takes at most 4 bytes a character
                elif kind and not kind.startswith("image/"):
                    raise errors.invalid_argument([("content_type", f"must be an image type or {TEXT}")])
            received += part.data
            if len(received) > cap:
                raise errors.invalid_argument([("data", f"larger than {cap} bytes")])
        if kind == TEXT:
            return gateway_pb2.UploadInputResponse(text=await self._keep_text(tenant, bytes(received), within=within))
        return gateway_pb2.UploadInputResponse(image=await self._upload_image(tenant, bytes(received), within=within))

    async def _keep_text(self, tenant: str, data: bytes, *, within: float) -> task_pb2.InputText:
        """A text attachment checked (UTF-8, storable, not empty, at most max_input_chars), recorded and stored."""
        try:
            decoded = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise errors.invalid_argument([("data", f"not UTF-8 text: {exc.reason} at byte {exc.start}")]) from None
        bad: list[tuple[str, str]] = []
        if not decoded:
            bad.append(("data", "is empty"))
        elif len(decoded) > self._settings.max_input_chars:
            bad.append(("data", f"{len(decoded)} characters; at most {self._settings.max_input_chars}"))
        text.check("data", [decoded], bad)
        if bad:
            raise errors.invalid_argument(bad)
        sha256 = hashlib.sha256(data).hexdigest()
        name = f"{images.PREFIX}{sha256}.txt"
        kept = await input_store.keep_text(
            self._pool, tenant, StoredText(sha256, self._store.uri_of(name), len(data), len(decoded)), within=within
        )
        if kept is None:
            raise errors.invalid_argument([("data", "this tenant holds an input image of the same sha256")])
        await self._store.put(name, data, f"{TEXT}; charset=utf-8")
        return task_pb2.InputText(sha256=kept.sha256, size_bytes=kept.size_bytes, chars=kept.chars, content_type=TEXT)

    async def text_of(
        self, tenant: str, sha256: str, field: str, bad: list[tuple[str, str]], *, within: float
    ) -> str | None:
        """The text of the tenant's attachment `sha256`, marked used now; None with the reason in `bad` (naming
        `field`) when it has none (never uploaded, or expired)."""
        if len(sha256) != 64 or not set(sha256) <= _SHA256_CHARS:
            bad.append((field, "must be the 64 lower-case hex digits UploadInput answered with"))
            return None
        stored = await input_store.use_text(self._pool, tenant, sha256, within=within)
        data = bytearray()
        if stored is not None:
            try:
                async for chunk in self._store.read(stored.uri):
                    data += chunk
            except ResultNotFound:
                stored = None
        if stored is None:
            bad.append((field, "names no text attachment of this tenant (never uploaded, or expired)"))
            return None
        return data.decode("utf-8")

    async def _upload_image(self, tenant: str, received: bytes, *, within: float) -> task_pb2.InputImage:
        """An uploaded image checked against the upload limits, recorded and stored."""
        limits = _limits(self._settings, None)
        try:
            new = await self._budget.decode(bytes(received), limits)
        except images.ImageRefused as exc:
            raise errors.invalid_argument([("data", str(exc))]) from None
        stored = await self.keep(tenant, Checked(new=new), within=within)
        return task_pb2.InputImage(
            sha256=stored.sha256, width=stored.width, height=stored.height, size_bytes=stored.size_bytes,
            content_type=images.CONTENT_TYPE, source_format=new.source_format,
        )

    async def _fetch(self, url: str, cap: int) -> bytes:
        """The body of an https image URL: public hosts only (the webhook's SSRF guard), no redirects, at most `cap`
        bytes, an image content type, all within input_fetch_timeout_seconds."""
        timeout = self._settings.input_fetch_timeout_seconds
        if len(url) > self._settings.max_callback_url_chars:
            raise FetchRefused(f"longer than {self._settings.max_callback_url_chars} characters")
        try:
            target = httpx.URL(url)
        except httpx.InvalidURL:
            raise FetchRefused("not a valid URL") from None
        if target.userinfo:
            raise FetchRefused("must not carry credentials")
        try:
            async with asyncio.timeout(timeout):
                pinned = await netguard.pin(
                    target, schemes=("https",), within=timeout, allow_hosts=self._settings.input_fetch_allow_hosts
                )
                async with self._http().stream(
                    "GET", pinned.url, headers=pinned.headers, extensions=pinned.extensions
                ) as answer:
                    if answer.is_redirect:
                        raise FetchRefused(f"answered HTTP {answer.status_code}: redirects are not followed")
                    if answer.status_code != 200:
                        raise FetchRefused(f"answered HTTP {answer.status_code}")
                    kind = answer.headers.get("content-type", "").split(";", 1)[0].strip().lower()
                    if not kind.startswith("image/"):
                        raise FetchRefused(f"answered with content type {kind or 'none'}, not an image")
                    declared = answer.headers.get("content-length", "")
                    if declared.isascii() and declared.isdigit() and int(declared) > cap:
                        raise FetchRefused(f"is {declared} bytes; at most {cap} are allowed")
                    body = bytearray()
                    async for chunk in answer.aiter_raw():
                        body += chunk
                        if len(body) > cap:
                            raise FetchRefused(f"larger than {cap} bytes")
                    return bytes(body)
        except netguard.Refused as exc:
            raise FetchRefused(f"may not be fetched: {exc}") from None
        except TimeoutError:
            raise FetchRefused(f"could not be fetched within {timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise FetchRefused(f"could not be fetched ({type(exc).__name__})") from None
