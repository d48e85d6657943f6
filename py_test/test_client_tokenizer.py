"""The client's own tokenizer: the worker's files loaded with `tokenizers` and jinja2 (no
transformers), fetched once through GetTokenizer, and token ids identical to transformers'
AutoTokenizer (`encode`, `apply_chat_template`), which is what the worker's vLLM uses."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from vllm_router.client import UnsupportedError, WorkerClient
from vllm_router.client.chat_template import ChatTemplateError
from vllm_router.client.tokenizer import FastTokenizer, TransformersTokenizer, load_tokenizer
from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.server import ServerConfig
from vllm_router.testing.mock_config import MockConfig
from vllm_router.testing.mock_tokenizer import (
    CHAT_TEMPLATE,
    MockEngineWithTokenizer,
    write_word_tokenizer,
)

import real_engine
from harness import Harness, require, start_harness

USER = [{"role": "user", "content": "hello world"}]
# "<s>user: hello world\n<s>assistant:" in the word tokenizer's ids, with no second <s>
# in front: the template writes the special tokens itself.
USER_CHAT_IDS = [1, 3, 6, 7, 8, 1, 4, 6]


@pytest.fixture
def words(tmp_path: Path) -> Path:
    return write_word_tokenizer(tmp_path / "words")


@pytest_asyncio.fixture
async def worker_with_tokenizer(
    words: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Harness]:
    """A mock worker that serves the word tokenizer's files; a fresh client cache."""
    monkeypatch.setenv("VLLM_SERVICER_TOKENIZER_CACHE", str(tmp_path / "cache"))
    engine = MockEngineWithTokenizer(words, MockConfig(step_delay=0.001))
    harness = await start_harness(engine, ServerConfig(port=0, shutdown_grace_seconds=2.0))
    try:
        yield harness
    finally:
        await harness.close()


def test_the_word_tokenizer_without_transformers(words: Path) -> None:
    tokenizer = load_tokenizer(words)
    assert isinstance(tokenizer, FastTokenizer)
    assert tokenizer.encode("hello world") == [1, 7, 8]
    assert tokenizer.encode("good servers drain?", add_special_tokens=False) == [9, 10, 11, 12]
    rendered = tokenizer.render_chat(USER, add_generation_prompt=True)
    assert rendered == "<s>user: hello world\n<s>assistant:"
    assert tokenizer.encode(rendered, add_special_tokens=False) == USER_CHAT_IDS
    assert tokenizer.render_chat(USER, add_generation_prompt=False) == "<s>user: hello world\n"


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_which_chat_template(words: Path) -> None:
    """transformers' order (chat_template.jinja, then the config's), then a processor's
    chat_template.json as vLLM falls back to it; of several, the one named default."""
    (words / "chat_template.jinja").unlink()
    assert load_tokenizer(words).chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_tokenizer(words).render_chat(USER)
    (words / "chat_template.json").write_text(json.dumps({"chat_template": "json {{ bos_token }}"}))
    assert load_tokenizer(words).render_chat(USER) == "json <s>"
    _edit_config(words, chat_template="config")
    assert load_tokenizer(words).render_chat(USER) == "config"
    _edit_config(words, chat_template=[{"name": "tool_use", "template": "tools"}])
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        load_tokenizer(words).render_chat(USER)
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "named"}]
    _edit_config(words, chat_template=named)
    assert load_tokenizer(words).render_chat(USER) == "named"
    (words / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert load_tokenizer(words).render_chat(USER).startswith("<s>user: hello world")


def test_transformers_template_environment(words: Path) -> None:
    """What transformers' environment adds to jinja2's, which real templates use."""
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n  {% endfor %}"
        "{% if messages | length > 2 %}{{ raise_exception('at most two messages') }}{% endif %}"
        "{{ strftime_now('%Y') | length }}"
    )
    (words / "chat_template.jinja").write_text(template)
    tokenizer = load_tokenizer(words)
    chat = [{"role": "system", "content": "<b>"}, {"role": "user", "content": "é"}]
    # No HTML or ASCII escaping; trim_blocks and lstrip_blocks ate the "\n  " between tags.
    assert tokenizer.render_chat(chat) == '{"role": "user", "content": "é"}4'
    with pytest.raises(ChatTemplateError, match="at most two messages"):
        tokenizer.render_chat([*chat, *chat])


def test_files_without_tokenizer_json_need_transformers(
    words: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (words / "tokenizer.json").unlink()
    (words / "tokenizer.model").write_bytes(b"a SentencePiece model")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as on an install without it
    with (
        caplog.at_level(logging.WARNING, "vllm_router.client.tokenizer"),
        pytest.raises(ImportError, match=r"no tokenizer\.json; .*\(pip install transformers\)"),
    ):
        load_tokenizer(words)
    assert "loading it with transformers" in caplog.text and "tokenizer.model" in caplog.text


def test_a_tokenizer_json_the_library_cannot_read_is_a_value_error(words: Path) -> None:
    """One line from the CLI (it reports ValueErrors), not the library's bare Exception."""
    (words / "tokenizer.json").write_text('{"version": "9.0", "model": {}}')
    with pytest.raises(ValueError, match="the tokenizers library cannot read it"):
        load_tokenizer(words)


async def test_text_and_chat_prompts_through_the_workers_tokenizer(
    worker_with_tokenizer: Harness, tmp_path: Path
) -> None:
    harness = worker_with_tokenizer
    async with WorkerClient(harness.address) as worker:
        assert await worker.tokenize("hello world") == [1, 7, 8]
        assert await worker.chat_prompt(USER) == USER_CHAT_IDS
        reply = await worker.generate("good servers drain?", max_tokens=2, ignore_eos=True)
    # The worker got the ids (its own "tokenizer" would have counted 19 bytes).
    assert reply.usage.prompt_tokens == 5 and list(reply.output_token_ids) == [13, 14]
    digest = (await harness.stub.GetModelInfo(pb.GetModelInfoRequest())).tokenizer_sha256
    cached = tmp_path / "cache" / "tokenizers" / digest
    assert sorted(p.name for p in cached.iterdir()) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    (cached / "chat_template.jinja").unlink()  # a second client reads the cache, not the worker
    async with WorkerClient(harness.address) as worker:
        with pytest.raises(UnsupportedError, match="no chat template"):
            await worker.chat_prompt(USER)


# -- identity with transformers ------------------------------------------------------------------

TEXTS = [
    "Good servers drain in-flight work before they stop.",
    "",
    " leading space and trailing  ",
    "line\nbreaks\n\n\ttabs",
    "unicode: héllo wörld — 日本語 🙂",
    "Numbers 1, 2, 3, 10, 42 and 2048",
    "x <s>  </s>y<pad> and <|im_start|>user\nhi<|im_end|>",
    "a<tool_call>b <mask> <image><extra_1> the worker,workers <unk2>",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <s> there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again 🙂"},
    ],
]
TEMPLATE_WITH_TOKENS = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ image_token }}assistant:{% endif %}"
)


def _tokens(content: str, *, special: bool, normalized: bool = False, **flags: bool) -> dict:
    return {"content": content, "special": special, "normalized": normalized,
            "lstrip": False, "rstrip": False, "single_word": False, **flags}  # fmt: skip


def _new_tokens(d: Path) -> None:
    """Tokens only the config names: added ones (one lstrip/single_word, normalized), a
    named special token, a model-specific one (a template variable too) and an extra one."""
    decoder = {
        "0": _tokens("<s>", special=True),
        "600": _tokens("<tool_call>", special=False),
        "601": _tokens("worker", special=False, normalized=True, lstrip=True, single_word=True),
    }
    _edit_config(d, added_tokens_decoder=decoder, mask_token="<mask>", image_token="<image>",
                 extra_special_tokens=["<extra_1>"])  # fmt: skip
    (d / "chat_template.jinja").write_text(TEMPLATE_WITH_TOKENS)


def _legacy_special_tokens_map(d: Path) -> None:
    """No added_tokens_decoder: transformers reads special_tokens_map.json (an unknown unk)."""
    config = json.loads((d / "tokenizer_config.json").read_text())
    for name in ("bos_token", "eos_token", "pad_token"):
        config.pop(name, None)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    legacy = {"bos_token": _tokens("<s>", special=True), "eos_token": "</s>", "unk_token": "<unk2>"}
    (d / "special_tokens_map.json").write_text(json.dumps(legacy))


def _edit_tokenizer_json(d: Path, **changes: Any) -> None:
    path = d / "tokenizer.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _add_bos_without_post_processor(d: Path) -> None:
    """With a tokenizer.json transformers drops add_bos_token / add_eos_token."""
    _edit_config(d, add_bos_token=True, add_eos_token=True)
    _edit_tokenizer_json(d, post_processor=None)


def _template_in_the_config(d: Path) -> None:
    template = d / "chat_template.jinja"
    _edit_config(d, chat_template=template.read_text())
    template.unlink()


# A tokenizer.json may keep a truncation setting; transformers encodes untruncated.
TRUNCATION = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
# Variants of the tiny model's tokenizer files, each a path through transformers' loading.
VARIANTS: dict[str, Callable[[Path], None]] = {
    "as-saved": lambda d: None,
    "new-tokens": _new_tokens,
    "legacy-special-tokens-map": _legacy_special_tokens_map,
    "add-bos-without-post-processor": _add_bos_without_post_processor,
    "split-special-tokens": lambda d: _edit_config(d, split_special_tokens=True),
    "truncation-in-the-file": lambda d: _edit_tokenizer_json(d, truncation=TRUNCATION),
    "template-in-the-config": _template_in_the_config,
    "class-gpt2": lambda d: _edit_config(d, tokenizer_class="GPT2Tokenizer"),
}


def assert_same_as_transformers(directory: Path) -> None:
    """Every text and chat tokenized by the client as transformers' AutoTokenizer does."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ours = load_tokenizer(directory)
    assert isinstance(ours, FastTokenizer)
    for text in TEXTS:
        for special in (True, False):
            expected = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
    for chat in CHATS:
        rendered = ours.render_chat(chat, add_generation_prompt=True)
        assert rendered == reference.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )
        # What the brief of this path is: apply_chat_template(tokenize=True)'s very ids.
        expected_ids = reference.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ours.encode(rendered, add_special_tokens=False) == list(expected_ids)


def _require_transformers() -> None:
    require(importlib.util.find_spec("transformers") is not None, "transformers is not installed")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_same_ids_as_transformers_on_the_tiny_model(tmp_path: Path, variant: str) -> None:
    _require_transformers()
    directory = tmp_path / variant
    shutil.copytree(real_engine.tiny_model(), directory)
    VARIANTS[variant](directory)
    assert_same_as_transformers(directory)


def test_same_ids_as_transformers_on_the_word_tokenizer(words: Path) -> None:
    _require_transformers()
    assert_same_as_transformers(words)


@pytest.mark.slow
def test_same_ids_as_transformers_on_the_trained_model() -> None:
    """SmolLM2-135M-Instruct: a 49k byte-level BPE and its ChatML template with a default
    system prompt (built once for the trained-model suites)."""
    _require_transformers()
    model, _ = real_engine.real_model()
    if not Path(model).is_dir():
        pytest.skip(f"{model} is a hub id here (CUDA node), not a directory")
    assert_same_as_transformers(Path(model))


def test_transformers_is_the_fallback_without_tokenizer_json(tmp_path: Path) -> None:
    """GPT-2 style vocab.json + merges.txt: transformers builds the tokenizer from them."""
    _require_transformers()
    source = real_engine.tiny_model()
    directory = tmp_path / "vocab-merges"
    directory.mkdir()
    model = json.loads((source / "tokenizer.json").read_text())["model"]
    (directory / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<s>", "chat_template": CHAT_TEMPLATE}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(directory)
    assert isinstance(tokenizer, TransformersTokenizer)
    rendered = tokenizer.render_chat(USER)
    assert rendered == "<s>user: hello world\n<s>assistant:"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == 0 and len(ids) > 5  # <s> is id 0 in the tiny model's vocabulary
