"""The worker's own tokenizer, fetched once through GetTokenizer and cached by its digest.

Clients tokenize text exactly as the worker does, with no model hub access: the files
are stored under `<cache>/<sha256>/` (the digest GetModelInfo reports), so a second
client of the same model loads them from disk without a fetch.

They are loaded without transformers (whose import alone costs seconds, a CLI call's
whole budget): `tokenizer.json` with the `tokenizers` library, set up as transformers'
TokenizersBackend sets it up, and the chat template with jinja2 (`chat_template`). Only
files without a `tokenizer.json` (a bare SentencePiece model, vocab + merges) fall back to
transformers, which converts them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..contracts.vllm_engine_v1.rules import tokenizer_digest
from .chat_template import ChatTemplateError, render, select

if TYPE_CHECKING:
    import tokenizers

    from ..proto import vllm_engine_pb2 as pb

logger = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES in
# 5.x), in its order; a model may name more (`*_token` keys, e.g. image_token).
NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("VLLM_SERVICER_TOKENIZER_CACHE", Path(base) / "vllm-servicer"))


async def fetch_files(chunks: AsyncIterator[pb.GetTokenizerResponse]) -> tuple[str, Path]:
    """Store a GetTokenizer stream under its digest (checked); returns (digest, directory)."""
    files: dict[str, bytearray] = {}
    expected = ""
    async for chunk in chunks:
        if chunk.sha256:
            expected = chunk.sha256
            break
        files.setdefault(chunk.file_name, bytearray()).extend(chunk.data)
    ordered = [(name, bytes(data)) for name, data in files.items()]
    actual = tokenizer_digest(ordered)
    if not expected or actual != expected:
        raise ValueError(f"tokenizer files arrived corrupt (sha256 {actual}, sent {expected})")
    return actual, await asyncio.to_thread(_store, actual, ordered)


def _store(digest: str, files: list[tuple[str, bytes]]) -> Path:
    target = cache_root() / "tokenizers" / digest
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
        for name, data in files:
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        try:
            staging.rename(target)  # atomic: readers never see half a directory
        except OSError:  # another client stored it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    return target


def cached_tokenizer(digest: str) -> Path | None:
    path = cache_root() / "tokenizers" / digest
    return path if digest and path.is_dir() else None


class ClientTokenizer(Protocol):
    """What the client needs of a tokenizer: transformers' `encode` and chat rendering."""

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The model's chat template(s): one, or several by name, or None."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat as text, as `apply_chat_template(..., tokenize=False)` renders it."""
        ...


def load_tokenizer(directory: Path) -> ClientTokenizer:
    """The tokenizer the worker's vLLM built from these files (transformers' AutoTokenizer)."""
    if (directory / TOKENIZER_JSON).is_file():
        return FastTokenizer(directory)
    names = sorted(path.name for path in directory.iterdir())
    logger.warning(
        "the worker's tokenizer has no %s (files: %s): loading it with transformers, "
        "which takes seconds", TOKENIZER_JSON, ", ".join(names),
    )  # fmt: skip
    return TransformersTokenizer(directory)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token's text: a string, or a serialized AddedToken's content."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _added_token(value: Any, *, special: bool | None = None) -> tokenizers.AddedToken | None:
    """tokenizers' AddedToken from a string or a serialized one (tokenizer_config.json)."""
    from tokenizers import AddedToken

    if isinstance(value, str):
        return AddedToken(value, special=True if special is None else special)
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        return None
    fields = {
        key: value[key]
        for key in ("single_word", "lstrip", "rstrip", "normalized", "special")
        if key in value
    }
    if special is not None:
        fields["special"] = special
    return AddedToken(value["content"], **fields)


class FastTokenizer:
    """tokenizer.json on the `tokenizers` library, set up as transformers 5's TokenizersBackend
    sets it up in `from_pretrained` (the generic class, that tokenizer_config.json's
    "TokenizersBackend" / "PreTrainedTokenizerFast" names): the file's pipeline as it is,
    the config's added and special tokens added to it in transformers' order (tokens the
    file has already are left as they are), no truncation or padding while encoding, and
    `split_special_tokens`. Model-specific transformers classes may rebuild the pipeline
    from their own code instead; they are meant to match the file, which is also what the
    Rust routers in front of a worker tokenize with."""

    def __init__(self, directory: Path) -> None:
        # Imported here: only text and chat prompts need it (~15 ms; transformers: seconds).
        from tokenizers import Tokenizer, processors

        config = _read_json(directory / "tokenizer_config.json")
        try:
            backend = Tokenizer.from_file(str(directory / TOKENIZER_JSON))
        except Exception as exc:  # the library raises a bare Exception (a newer format)
            path = directory / TOKENIZER_JSON
            raise ValueError(f"{path}: the tokenizers library cannot read it: {exc}") from exc
        # transformers encodes with DO_NOT_PAD / DO_NOT_TRUNCATE unless asked otherwise.
        backend.no_truncation()
        backend.no_padding()
        if backend.post_processor is None:
            # With a tokenizer.json transformers drops the config's add_bos_token and
            # add_eos_token, and fills a missing post-processor with one adding neither.
            backend.post_processor = processors.TemplateProcessing(
                single="$A:0", pair="$A:0 $B:1", special_tokens=[]
            )
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        named, extra = self._special_tokens(directory, config)
        self._add_config_tokens(backend, config, named, extra)
        self._backend = backend
        # The template's variables: every named special token, as a string.
        self.special_tokens: dict[str, str] = {
            name: text for name, value in named.items() if (text := _token_content(value))
        }
        self._chat_template = self._chat_templates(directory, config)

    @staticmethod
    def _special_tokens(
        directory: Path, config: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Any]]:
        """(named special tokens in transformers' order, the extra ones), from the config and,
        as transformers does only when the config has no added_tokens_decoder, the legacy
        special_tokens_map.json."""
        merged = dict(config)
        if "added_tokens_decoder" not in config:
            merged.update(_read_json(directory / "special_tokens_map.json"))
        named: dict[str, Any] = {name: merged.get(name) for name in NAMED_SPECIAL_TOKENS}
        for key, value in merged.items():
            if key.endswith("_token") and key not in named and _token_content(value):
                named[key] = value
        extra = merged.get("extra_special_tokens") or merged.get("additional_special_tokens")
        if isinstance(extra, dict):  # model-specific tokens by name
            named.update(extra)
            extra = []
        return named, list(extra) if isinstance(extra, list) else []

    @staticmethod
    def _add_config_tokens(
        backend: tokenizers.Tokenizer,
        config: dict[str, Any],
        named: dict[str, Any],
        extra: list[Any],
    ) -> None:
        """TokenizersBackend.__init__'s additions: every added_tokens_decoder entry (by id),
        then the named and extra special tokens the tokenizer lacks. The library ignores a
        token whose text it has already, so only new ones change anything."""
        decoder = config.get("added_tokens_decoder")
        tokens = []
        if isinstance(decoder, dict):
            for _, value in sorted(decoder.items(), key=lambda item: int(item[0])):
                if (token := _added_token(value)) is not None:
                    tokens.append(token)
        known = {token.content for token in backend.get_added_tokens_decoder().values()}
        known |= {token.content for token in tokens}
        named_texts = {text for value in named.values() if (text := _token_content(value))}
        for value in [*named.values(), *extra]:
            text = _token_content(value)
            if text is None or text in known:
                continue
            special = True if text in named_texts or isinstance(value, str) else None
            if (token := _added_token(value, special=special)) is not None:
                tokens.append(token)
                known.add(text)
        if tokens:
            backend.add_tokens(tokens)

    @staticmethod
    def _chat_templates(directory: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
        """transformers' order: chat_template.jinja, else the config's chat_template (one, or
        a list of named ones). Else a processor's chat_template.json, which vLLM falls back
        to when the tokenizer has none."""
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        value = config.get("chat_template")
        if value is None:
            value = _read_json(directory / "chat_template.json").get("chat_template")
        if isinstance(value, list):
            return {
                str(entry["name"]): str(entry["template"])
                for entry in value
                if isinstance(entry, dict) and "name" in entry and "template" in entry
            }
        return value if isinstance(value, str) else None

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self._chat_template

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        return render(
            select(self._chat_template),
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
        )


class TransformersTokenizer:
    """transformers' AutoTokenizer, for files `tokenizers` cannot read by itself."""

    def __init__(self, directory: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                f"the worker's tokenizer has no {TOKENIZER_JSON}; reading its files needs "
                "transformers (pip install transformers)"
            ) from exc
        self._tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        value = getattr(self._tokenizer, "chat_template", None)
        return value if isinstance(value, (str, dict)) else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("the model has no chat template")
        rendered = self._tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return str(rendered)
