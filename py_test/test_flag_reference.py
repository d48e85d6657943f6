"""docs/flags.md is what `python -m vllm_router.flag_reference` renders from the parsers now,
wherever it is rendered: a flag, default or help changed in the code fails here until the
page is written again. Nothing is started; vLLM's parser is built (vLLM imported) to tell
which flags exist only on a real engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vllm_router import flag_reference
from vllm_router.defaults import API_KEY_ENV, CONTROL_API_KEY_ENV
from vllm_router.server import ServerConfig

from real_engine import require_vllm

PAGE = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
STALE = f"docs/flags.md is stale: run `{flag_reference.REGENERATE}`"
# Every variable a default is read from (the worker's settings and the client's keys).
VARIABLES = sorted(
    {API_KEY_ENV, CONTROL_API_KEY_ENV}
    | {f.metadata["env"] for f in dataclasses.fields(ServerConfig) if f.metadata.get("env")}
)


@pytest.fixture
def variables_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variable a default comes from, set: the page must not show its value."""
    for name in VARIABLES:
        monkeypatch.setenv(name, f"/value-of-{name.lower()}")


def test_the_client_reference_is_current(variables_set: None) -> None:
    section = "\n".join(flag_reference.client_reference())
    assert section in PAGE.read_text(), STALE


@pytest.mark.vllm
def test_the_flag_reference_is_current() -> None:
    require_vllm()
    assert PAGE.read_text() == flag_reference.render(), STALE


@pytest.mark.vllm
def test_the_page_shows_variables_not_their_values(variables_set: None) -> None:
    require_vllm()
    page = flag_reference.render()
    assert page == PAGE.read_text(), STALE
    assert "/value-of-" not in page
    for name in VARIABLES:
        assert f"${name}" in page, name
