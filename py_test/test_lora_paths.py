"""Where a LoRA adapter a remote caller names may be loaded from (core/lora_paths.py: vllm-rs's
rule): the rule on its own, then on the mock server's two LoRA loads (the v1 contract's
LoadLoraAdapter, vLLM's native LoadLora), where a refused path never reaches the engine, and
its prefixes as the CLI and the start-up check take them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from vllm_router.cli import build_parser
from vllm_router.contracts.vllm_native import convert as native_convert
from vllm_router.core.lora_paths import (
    INACCESSIBLE,
    NO_HUB,
    NO_PREFIXES,
    NOT_ABSOLUTE,
    OUTSIDE,
    PREFIXES_ENV,
    LoraPathRule,
    PrefixError,
)
from vllm_router.dataclass_flags import from_args
from vllm_router.engine import LoraAdapter
from vllm_router.errors import InvalidRequest, NotFound, ServicerError
from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_native_pb2 as npb
from vllm_router.proto import vllm_native_pb2_grpc as npb_grpc
from vllm_router.server import ServerConfig
from vllm_router.server.app import preflight
from vllm_router.server.config import StartupError

from harness import Harness, StartServer


def _refusal(rule: LoraPathRule, path: str) -> ServicerError:
    with pytest.raises(ServicerError) as err:
        rule.check(path)
    return err.value


def _invalid(rule: LoraPathRule, path: str) -> str:
    """The INVALID_ARGUMENT message `rule` refuses `path` with."""
    refusal = _refusal(rule, path)
    assert type(refusal) is InvalidRequest, (path, refusal)
    assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    return refusal.message


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """A prefix with an adapter in it, a sibling that shares its name's start, and an
    outside directory with an adapter of its own (all resolved)."""
    base = tmp_path.resolve()
    paths = {
        "prefix": base / "lora",
        "adapter": base / "lora" / "tiny",
        "sibling": base / "lora2" / "tiny",
        "outside": base / "elsewhere" / "tiny",
    }
    for name in ("adapter", "sibling", "outside"):
        paths[name].mkdir(parents=True)
        (paths[name] / "adapter_config.json").write_text("{}")
    return paths


# -- prefixes, checked at start ----------------------------------------------------------------


def test_prefixes_are_resolved_existing_absolute_directories(tmp_path: Path) -> None:
    real = tmp_path.resolve() / "adapters"
    real.mkdir()
    link = tmp_path / "via-link"
    link.symlink_to(real)
    assert LoraPathRule.of([str(link)]).prefixes == (str(real),)
    assert LoraPathRule.of([str(real) + "/"]).prefixes == (str(real),)
    # Empty entries (an empty variable, "a::b") are dropped, as vllm-rs drops them.
    assert LoraPathRule.of(["", str(real), ""]).prefixes == (str(real),)
    assert LoraPathRule.of([""]).prefixes == ()
    assert LoraPathRule.of(None).prefixes == ()
    assert LoraPathRule.of(None, hub_ids=False).hub_ids is False


@pytest.mark.parametrize("kind", ["missing", "file", "relative"])
def test_a_prefix_that_is_not_an_existing_absolute_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "relative").mkdir()
    monkeypatch.chdir(tmp_path)  # "relative" exists relative to the cwd, and is refused still
    prefix = {
        "missing": str(tmp_path / "missing"),
        "file": str(tmp_path / "a-file"),
        "relative": "relative",
    }[kind]
    with pytest.raises(PrefixError) as err:
        LoraPathRule.of([str(tmp_path), prefix])
    assert str(err.value) == (
        f"LoRA path prefix {prefix!r} is not an absolute path to an existing directory"
    )


# -- the rule ----------------------------------------------------------------------------------


def test_without_prefixes_every_local_path_is_refused(tree: dict[str, Path]) -> None:
    rule = LoraPathRule.of(None)
    for path in (str(tree["adapter"]), "./tiny", "~/tiny", ".", "..", "a/../b"):
        assert _invalid(rule, path) == NO_PREFIXES, path
    assert NO_PREFIXES == (
        "Local LoRA adapter paths require VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES to be configured."
    )


def test_a_relative_local_path_is_refused_with_prefixes(tree: dict[str, Path]) -> None:
    rule = LoraPathRule.of([str(tree["prefix"])])
    for path in ("./tiny", "~/tiny", "~", ".", "..", "../lora/tiny", "org/../tiny"):
        assert _invalid(rule, path) == NOT_ABSOLUTE, path
    assert NOT_ABSOLUTE == (
        "Local LoRA adapter paths must be absolute and under one of the prefixes configured "
        "by VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES."
    )


def test_an_absolute_path_inside_a_prefix_is_given_resolved(tmp_path: Path) -> None:
    real = tmp_path.resolve() / "adapters"
    (real / "tiny").mkdir(parents=True)
    (real / "other").mkdir()
    link = tmp_path / "via-link"
    link.symlink_to(real)
    rule = LoraPathRule.of([str(link)])
    assert rule.check(str(real / "tiny")) == str(real / "tiny")
    assert rule.check(f"{link}/tiny") == str(real / "tiny")  # the engine gets the real path
    assert rule.check(f"{real}/tiny/../other/") == str(real / "other")
    assert rule.check(f"{real}//tiny/.") == str(real / "tiny")
    assert rule.check(str(real)) == str(real)  # the prefix itself lies under itself
    (real / "tiny-link").symlink_to(real / "tiny")  # a link that stays inside: allowed
    assert rule.check(str(real / "tiny-link")) == str(real / "tiny")


def test_the_first_of_several_prefixes_or_any_other_covers_a_path(tree: dict[str, Path]) -> None:
    rule = LoraPathRule.of([str(tree["outside"].parent), str(tree["prefix"])])
    assert rule.check(str(tree["adapter"])) == str(tree["adapter"])
    assert rule.check(str(tree["outside"])) == str(tree["outside"])
    assert _invalid(rule, str(tree["sibling"])) == OUTSIDE


def test_paths_that_resolve_outside_every_prefix_are_refused(tree: dict[str, Path]) -> None:
    prefix = tree["prefix"]
    rule = LoraPathRule.of([str(prefix)])
    (prefix / "escape").symlink_to(tree["outside"])
    (prefix / "escape-up").symlink_to("..")
    outside_paths = [
        str(tree["outside"]),
        f"{prefix}/escape",  # a link inside the prefix, pointing outside
        f"{prefix}/escape/adapter_config.json",
        f"{prefix}/../elsewhere/tiny",  # `..` out of the prefix
        f"{prefix}/escape-up/elsewhere/tiny",
        str(tree["sibling"]),  # /data/lora does not cover /data/lora2
        str(prefix.parent / "lora2"),
        str(prefix.parent),
        "/",
    ]
    for path in outside_paths:
        assert _invalid(rule, path) == OUTSIDE, path
    assert OUTSIDE == "Local LoRA adapter path is outside the configured allowed prefixes."


def test_a_missing_path_inside_a_prefix_is_not_found(tree: dict[str, Path]) -> None:
    prefix = tree["prefix"]
    rule = LoraPathRule.of([str(prefix)])
    (prefix / "dangling").symlink_to(prefix / "gone")  # a link to nothing, inside
    for path in (f"{prefix}/missing", f"{prefix}/dangling", f"{prefix}/tiny/../missing"):
        refusal = _refusal(rule, path)
        assert type(refusal) is NotFound, path
        assert refusal.code == grpc.StatusCode.NOT_FOUND
        assert refusal.message == f"No adapter found for {path}"


def test_outside_every_prefix_existence_makes_no_difference(tree: dict[str, Path]) -> None:
    """No existence oracle: a path outside is refused the same whether it exists or not
    (vllm-rs answers "No adapter found" for a missing one; this server does not)."""
    prefix = tree["prefix"]
    rule = LoraPathRule.of([str(prefix)])
    (prefix / "to-missing").symlink_to(tree["outside"].parent / "missing")
    existing = [str(tree["outside"]), f"{prefix}/../elsewhere/tiny"]
    missing = [
        str(tree["outside"].parent / "missing"),
        f"{prefix}/../elsewhere/missing",
        f"{prefix}/to-missing",  # a dangling link inside, to a missing path outside
        "/no/such/adapter",
    ]
    messages = {path: _invalid(rule, path) for path in existing + missing}
    assert set(messages.values()) == {OUTSIDE}, messages


def test_a_path_that_cannot_be_resolved_is_inaccessible(tree: dict[str, Path]) -> None:
    prefix = tree["prefix"]
    (prefix / "loop").symlink_to(prefix / "loop")
    assert _invalid(LoraPathRule.of([str(prefix)]), f"{prefix}/loop") == INACCESSIBLE


def test_hub_ids_go_to_the_engine_as_they_are(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tree["outside"])  # no "org/adapter" relative to the cwd
    for rule in (LoraPathRule.of(None), LoraPathRule.of([str(tree["prefix"])])):
        for name in ("org/adapter", "adapter", "org/adapter-v2.1"):
            assert rule.check(name) == name
    no_hub = LoraPathRule.of([str(tree["prefix"])], hub_ids=False)
    assert _invalid(no_hub, "org/adapter") == NO_HUB
    assert NO_HUB.startswith("LoRA adapters from a model hub are not loaded on this worker")
    # Local paths are judged as local paths either way.
    assert no_hub.check(str(tree["adapter"])) == str(tree["adapter"])
    assert _invalid(no_hub, str(tree["outside"])) == OUTSIDE


def test_a_name_that_exists_relative_to_the_cwd_is_a_local_path(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tree["outside"] / "org" / "adapter").mkdir(parents=True)
    (tree["outside"] / "org" / "dangling").symlink_to("nowhere")  # exists as a link
    monkeypatch.chdir(tree["outside"])
    with_prefix = LoraPathRule.of([str(tree["prefix"])])
    for name in ("org/adapter", "org", "org/dangling", "adapter_config.json"):
        assert _invalid(with_prefix, name) == NOT_ABSOLUTE, name
        assert _invalid(LoraPathRule.of(None), name) == NO_PREFIXES, name
        # Not a hub id: --no-lora-hub-ids does not decide it.
        no_hub = LoraPathRule.of([str(tree["prefix"])], hub_ids=False)
        assert _invalid(no_hub, name) == NOT_ABSOLUTE, name
    assert with_prefix.check("org/other") == "org/other"  # absent here: a hub id


def test_a_directory_swapped_for_a_link_after_the_first_check_leads_nowhere(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter's directory is replaced by a link to outside between the rule's first
    (non-strict) resolution and its strict one: the check after the strict one refuses."""
    prefix, adapter = tree["prefix"], tree["adapter"]
    rule = LoraPathRule.of([str(prefix)])
    real_realpath = os.path.realpath
    swapped: list[str] = []

    def realpath_then_swap(path: str, *, strict: bool = False) -> str:
        resolved = real_realpath(path, strict=strict)
        if path == str(adapter) and not strict and not swapped:
            adapter.rename(prefix / "tiny.before")
            adapter.symlink_to(tree["outside"])
            swapped.append(resolved)
        return resolved

    monkeypatch.setattr(os.path, "realpath", realpath_then_swap)
    assert _invalid(rule, str(adapter)) == OUTSIDE
    assert swapped == [str(adapter)]  # the first resolution saw it inside
    monkeypatch.undo()
    assert os.path.realpath(adapter) == str(tree["outside"])


# -- on the server -----------------------------------------------------------------------------


async def _error(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value.code(), err.value.details() or ""


class _Loads:
    """Makes the mock an engine with LoRA (it has none: an engine without it refuses a load,
    whatever its path) and records every load that reaches it."""

    def __init__(self, harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        facts = dataclasses.replace(harness.engine.facts, supports_lora=True)
        monkeypatch.setattr(harness.engine, "_facts", facts)
        monkeypatch.setattr(harness.engine, "load_lora_adapter", self._load)
        monkeypatch.setattr(harness.engine, "list_lora_adapters", self._list)

    async def _load(self, name: str, path: str) -> None:
        self.calls.append((name, path))

    async def _list(self) -> list[LoraAdapter]:
        return [LoraAdapter(name, path, i + 1) for i, (name, path) in enumerate(self.calls)]


async def _started(start_mock: StartServer, *prefixes: str, hub_ids: bool = True) -> Harness:
    config = ServerConfig(
        port=0,
        shutdown_grace_seconds=2.0,
        lora_allowed_path_prefixes=prefixes or None,
        lora_hub_ids=hub_ids,
    )
    return await start_mock(config)


async def test_v1_load_lora_adapter_checks_the_path_before_the_engine(
    start_mock: StartServer, tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = await _started(start_mock, str(tree["prefix"]))
    stub = harness.stub

    def load(path: str) -> Any:
        return stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="a", path=path))

    # An engine without LoRA says so first, whatever the path (the mock's own answer).
    for path in (str(tree["adapter"]), str(tree["outside"])):
        assert await _error(load(path)) == (
            grpc.StatusCode.UNIMPLEMENTED,
            "the mock engine has no LoRA adapters",
        ), path
    loads = _Loads(harness, monkeypatch)
    refused = {
        str(tree["outside"]): (grpc.StatusCode.INVALID_ARGUMENT, OUTSIDE),
        f"{tree['prefix']}/../elsewhere/tiny": (grpc.StatusCode.INVALID_ARGUMENT, OUTSIDE),
        str(tree["sibling"]): (grpc.StatusCode.INVALID_ARGUMENT, OUTSIDE),
        "/no/such/adapter": (grpc.StatusCode.INVALID_ARGUMENT, OUTSIDE),
        "./tiny": (grpc.StatusCode.INVALID_ARGUMENT, NOT_ABSOLUTE),
        f"{tree['prefix']}/missing": (
            grpc.StatusCode.NOT_FOUND,
            f"No adapter found for {tree['prefix']}/missing",
        ),
    }
    for path, answer in refused.items():
        assert await _error(load(path)) == answer, path
    assert loads.calls == []
    await load(f"{tree['prefix']}/./tiny")
    await load("org/adapter")
    assert loads.calls == [("a", str(tree["adapter"])), ("a", "org/adapter")]


async def test_v1_load_lora_adapter_without_prefixes_refuses_local_paths(
    start_mock: StartServer, tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = await _started(start_mock, hub_ids=False)
    loads = _Loads(harness, monkeypatch)
    for path, message in ((str(tree["adapter"]), NO_PREFIXES), ("org/adapter", NO_HUB)):
        request = pb.LoadLoraAdapterRequest(name="a", path=path)
        answer = await _error(harness.stub.LoadLoraAdapter(request))
        assert answer == (grpc.StatusCode.INVALID_ARGUMENT, message), path
    assert loads.calls == []


async def test_native_load_lora_checks_lora_then_the_path_then_calls_the_engine(
    start_mock: StartServer, tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = await _started(start_mock, str(tree["prefix"]))
    control = npb_grpc.ControlStub(harness.channel)

    def load(path: str) -> Any:
        return control.LoadLora(npb.LoadLoraRequest(lora_name="a", source_path=path))

    # The mock serves no LoRA: every load is FAILED_PRECONDITION, whatever its path.
    for path in (str(tree["outside"]), str(tree["adapter"]), "org/adapter"):
        answer = await _error(load(path))
        assert answer == (grpc.StatusCode.FAILED_PRECONDITION, native_convert.NO_LORA), path
    # As an engine started with --enable-lora: the path rule comes next, then the engine.
    loads = _Loads(harness, monkeypatch)
    assert await _error(load(str(tree["outside"]))) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        OUTSIDE,
    )
    assert await _error(load(f"{tree['prefix']}/../elsewhere/tiny")) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        OUTSIDE,
    )
    assert await _error(load("./tiny")) == (grpc.StatusCode.INVALID_ARGUMENT, NOT_ABSOLUTE)
    assert await _error(load(f"{tree['prefix']}/missing")) == (
        grpc.StatusCode.NOT_FOUND,
        f"No adapter found for {tree['prefix']}/missing",
    )
    assert loads.calls == []
    answer = await load(f"{tree['prefix']}/../lora/tiny")
    assert loads.calls == [("a", str(tree["adapter"]))]
    assert answer.adapter.lora_name == "a"
    assert answer.adapter.source_path == str(tree["adapter"])


# -- configuration -----------------------------------------------------------------------------


def test_a_missing_prefix_is_a_one_line_startup_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(StartupError) as err:
        preflight(ServerConfig(port=0, lora_allowed_path_prefixes=(str(tmp_path), missing)))
    assert str(err.value) == (
        f"--lora-allowed-path-prefixes: LoRA path prefix {missing!r} is not an absolute path "
        "to an existing directory"
    )
    assert "\n" not in str(err.value)
    preflight(ServerConfig(port=0, lora_allowed_path_prefixes=(str(tmp_path),)))  # no error


def test_the_variable_holds_colon_separated_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFIXES_ENV, "/a::/b:")
    config = from_args(ServerConfig, build_parser(with_vllm=False).parse_args(["--mock-engine"]))
    assert config.lora_allowed_path_prefixes == ("/a", "/b")
    args = build_parser(with_vllm=False).parse_args(
        ["--mock-engine", "--lora-allowed-path-prefixes", "/c", "--no-lora-hub-ids"]
    )
    config = from_args(ServerConfig, args)  # the flag wins over the variable
    assert (config.lora_allowed_path_prefixes, config.lora_hub_ids) == (("/c",), False)
    monkeypatch.delenv(PREFIXES_ENV)
    config = from_args(ServerConfig, build_parser(with_vllm=False).parse_args(["--mock-engine"]))
    assert (config.lora_allowed_path_prefixes, config.lora_hub_ids) == (None, True)
