"""The mock engine serving a real model's tokenizer files through GetTokenizer, no vLLM.

The plain mock has no tokenizer files (it "tokenizes" UTF-8 bytes), so a client's own
tokenizer path (GetTokenizer, the digest cache, text and chat prompts tokenized on the
client) is never taken against it. This one sends a directory's files exactly as a vLLM
worker sends its model's (the same file list, `engine.vllm.facts.read_tokenizer_files`);
the answers are still the mock's. benchmarks/client_cli_latency.py serves it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..engine.vllm.facts import read_tokenizer_files
from .mock_config import MockConfig
from .mock_engine import MockAsyncEngine


class MockEngineWithTokenizer(MockAsyncEngine):
    """MockAsyncEngine whose tokenizer files are those in `tokenizer_dir`. Give a MockConfig
    with a vocab_size of at least the tokenizer's, or the server refuses its larger ids."""

    def __init__(self, tokenizer_dir: str | Path, config: MockConfig | None = None) -> None:
        super().__init__(config)
        self.tokenizer_dir = Path(tokenizer_dir)
        if not self.tokenizer_dir.is_dir():
            raise ValueError(f"{self.tokenizer_dir} is not a directory")

    async def tokenizer_files(self) -> list[tuple[str, bytes]]:
        return await asyncio.to_thread(read_tokenizer_files, str(self.tokenizer_dir))


# A tokenizer small enough to state its ids in a test: one id per word or punctuation run.
WORDS = ("<unk>", "<s>", "</s>", "user", "assistant", "system", ":", "hello", "world", "good",
         "servers", "drain", "?")  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
)


def write_word_tokenizer(directory: Path) -> Path:
    """Save a word-level tokenizer (ids: WORDS' order; `<s>` added in front of a text) with
    a chat template, as transformers saves one: tokenizer.json, tokenizer_config.json and
    chat_template.jinja. Built with the `tokenizers` library alone (no transformers)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", WORDS.index("<s>"))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory
