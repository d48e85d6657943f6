"""Media a request names by URL, fetched under the operator's rules before admission.

A client (or the router, in `--mm-processing worker` mode) may send an image as bytes or
as a URL. URLs are resolved here, for every contract alike, so no engine ever opens a
socket or a file a client chose:

- `data:` URLs always (base64 or percent-encoded);
- `http(s)` only to the hosts the engine's `--allowed-media-domains` lists. Stricter than
  vLLM's own servers, which fetch from any host when that flag is unset: a worker behind a
  router should not be a proxy into its network unless the operator says so;
- `file:` only under `--allowed-local-media-path` (vLLM's rule);
- every item at most `max_bytes`, every fetch within `timeout` seconds, no redirects
  (a redirect could leave the allowed hosts), and no more items than the model takes per
  prompt (`--limit-mm-per-prompt`): checked before anything is fetched.

The result is the same request with every URL replaced by the bytes it names.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import itertools
import math
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..engine import DTYPE_SIZES, GenerationRequest, MediaItem, ModelFacts, RawTensor
from ..errors import InvalidRequest, MediaRefused, MediaUnavailable

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_TIMEOUT = 10.0


@dataclass(frozen=True)
class MediaRules:
    """What a worker may fetch (hosts and directory from the engine's facts, limits from
    the server's configuration)."""

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str = ""
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def of(
        cls,
        facts: ModelFacts,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> MediaRules:
        return cls(
            allowed_domains=tuple(d.lower() for d in facts.allowed_media_domains),
            allowed_local_path=facts.allowed_local_media_path,
            max_bytes=max_bytes,
            timeout=timeout,
        )


def url_schemes(facts: ModelFacts) -> tuple[str, ...]:
    """The URL schemes this worker fetches media from (none for a text-only model)."""
    if not facts.media_limits:
        return ()
    schemes = ["data"]
    if facts.allowed_media_domains:
        schemes += ["http", "https"]
    if facts.allowed_local_media_path:
        schemes.append("file")
    return tuple(schemes)


def check_media_counts(request: GenerationRequest, facts: ModelFacts) -> None:
    """Modalities the model takes, no more items of each than its per-prompt limit."""
    counts = Counter(item.modality for item in request.media)
    for batch in request.processed_media:
        counts[batch.modality] += len(batch.placeholders)
    field_name = request.media_field
    for modality, count in counts.items():
        limit = facts.media_limits.get(modality)
        if limit is None:
            takes = ", ".join(sorted(facts.media_limits)) or "no media (a text-only model)"
            raise InvalidRequest(
                f"{field_name}: modality {modality!r} is not taken by this worker's model; "
                f"it takes {takes}"
            )
        if count > limit:
            raise InvalidRequest(
                f"{field_name}: {count} {modality} items sent; this model takes at most "
                f"{limit} per prompt (--limit-mm-per-prompt)"
            )


def checked_tensor(dtype: str, shape: list[int], data: bytes, where: str) -> RawTensor:
    """A wire tensor whose dtype is known and whose bytes fill its shape exactly."""
    size = DTYPE_SIZES.get(dtype)
    if size is None:
        raise InvalidRequest(
            f"{where}: dtype {dtype!r} is not supported; use one of {', '.join(DTYPE_SIZES)}"
        )
    want = math.prod(shape) * size
    if len(data) != want:
        raise InvalidRequest(
            f"{where}: {len(data)} bytes for shape {list(shape)} of {dtype}; expected {want}"
        )
    return RawTensor(dtype, tuple(shape), data)


def check_placeholders(request: GenerationRequest) -> None:
    """Processed items' runs lie inside the prompt, one hash each, no two overlapping."""
    prompt_len = len(request.prompt_token_ids or ())
    runs = []
    for number, batch in enumerate(request.processed_media):
        where = f"{request.media_field} batch {number}"
        if len(batch.hashes) != len(batch.placeholders):
            raise InvalidRequest(
                f"{where}: {len(batch.placeholders)} placeholder runs but {len(batch.hashes)} "
                "hashes; every item needs its content hash"
            )
        for offset, length in batch.placeholders:
            if length < 1 or offset + length > prompt_len:
                raise InvalidRequest(
                    f"{where}: placeholder run at {offset} of length {length} is not inside "
                    f"the {prompt_len}-token prompt"
                )
            runs.append((offset, length))
    runs.sort()
    for (first, length), (second, _) in itertools.pairwise(runs):
        if first + length > second:
            raise InvalidRequest(
                f"{request.media_field}: placeholder runs at {first} and {second} overlap"
            )


async def resolve_media(
    request: GenerationRequest, facts: ModelFacts, rules: MediaRules
) -> GenerationRequest:
    """`request` with its media checked and every URL fetched (bytes in their place)."""
    if not request.media and not request.processed_media:
        return request
    check_media_counts(request, facts)
    check_placeholders(request)
    if all(item.url is None for item in request.media):
        return request
    fetched = await asyncio.gather(
        *(_resolved(item, i, request.media_field, rules) for i, item in enumerate(request.media))
    )
    return dataclasses.replace(request, media=tuple(fetched))


async def _resolved(item: MediaItem, index: int, field_name: str, rules: MediaRules) -> MediaItem:
    if item.url is None:
        return item
    where = f"{field_name}[{index}]"
    data = await fetch(item.url, rules, where)
    return dataclasses.replace(item, url=None, data=data)


async def fetch(url: str, rules: MediaRules, where: str = "media") -> bytes:
    """The bytes `url` names, under `rules` (MediaRefused: not allowed; InvalidRequest:
    malformed, too large or refused by its host; MediaUnavailable: the fetch failed in a
    way that may pass on a retry)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url(url, where)
    elif scheme in ("http", "https"):
        data = await _http(url, rules, where)
    elif scheme == "file":
        data = await _file(url, rules, where)
    else:
        raise InvalidRequest(
            f"{where}: URL scheme {scheme or '(none)'!r} is not supported; "
            "use data:, http(s): or file: URLs"
        )
    if len(data) > rules.max_bytes:
        raise InvalidRequest(f"{where}: {len(data)} bytes; at most {rules.max_bytes} per item")
    if not data:
        raise InvalidRequest(f"{where}: the URL names no data (0 bytes)")
    return data


def _data_url(url: str, where: str) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise InvalidRequest(f"{where}: a data: URL needs a ',' before its payload")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(
                f"{where}: the data: URL's base64 payload is invalid: {exc}"
            ) from exc
    return urllib.parse.unquote_to_bytes(payload)


async def _http(url: str, rules: MediaRules, where: str) -> bytes:
    import aiohttp  # vLLM's own HTTP client; imported only when a worker fetches

    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not rules.allowed_domains:
        raise MediaRefused(
            f"{where}: http(s) media URLs are refused on this worker; the operator allows "
            "hosts with --allowed-media-domains (send the image as a data: URL or bytes)"
        )
    if host not in rules.allowed_domains:
        raise MediaRefused(
            f"{where}: host {host!r} is not in this worker's --allowed-media-domains"
        )
    timeout = aiohttp.ClientTimeout(total=rules.timeout)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, allow_redirects=False) as response,
        ):
            if response.status != 200:
                # As vLLM's servers: a client error is the request's, a server error may
                # pass on a retry; a redirect is not followed (it could leave the hosts).
                failed = InvalidRequest if response.status < 500 else MediaUnavailable
                redirect = " (redirects are not followed)" if response.status < 400 else ""
                raise failed(f"{where}: fetching {url} answered HTTP {response.status}{redirect}")
            if (response.content_length or 0) > rules.max_bytes:
                raise InvalidRequest(
                    f"{where}: {response.content_length} bytes; at most {rules.max_bytes} per item"
                )
            # One byte past the limit is enough to know it is too large.
            return await response.content.read(rules.max_bytes + 1)
    except asyncio.TimeoutError as exc:
        raise MediaUnavailable(f"{where}: fetching {url} took over {rules.timeout}s") from exc
    except aiohttp.ClientError as exc:
        raise MediaUnavailable(f"{where}: fetching {url} failed: {exc}") from exc


async def _file(url: str, rules: MediaRules, where: str) -> bytes:
    if not rules.allowed_local_path:
        raise MediaRefused(
            f"{where}: file: URLs are refused on this worker; the operator allows a directory "
            "with --allowed-local-media-path"
        )

    def read() -> bytes:
        # Resolved (symlinks followed) before the check: a link cannot lead outside.
        root = Path(rules.allowed_local_path).resolve()
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
        if not path.is_relative_to(root):
            raise MediaRefused(f"{where}: {path} is outside --allowed-local-media-path {root}")
        try:
            with path.open("rb") as file:
                return file.read(rules.max_bytes + 1)
        except OSError as exc:
            raise InvalidRequest(f"{where}: cannot read {path}: {exc.strerror}") from exc

    return await asyncio.to_thread(read)
