"""The flag reference (docs/flags.md): every flag of `vllm-servicer` (and of its `check-vllm`)
and `vllm-servicer-client` with its default and help, rendered from the parsers those commands
build, so the page can say nothing they do not.

`python -m vllm_router.flag_reference docs/flags.md` writes it (without the path it prints
it); py_test/test_flag_reference.py fails while the page differs. `vllm-servicer` has two
parsers (`cli.build_parser`): vLLM's on a real engine, which this builds to tell where each
flag exists (that imports vLLM; no engine starts), and this package's alone with
`--mock-engine` or without vLLM. The page reads nothing from the environment: a default
taken from a variable is shown as the variable's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

from .cli import build_parser
from .client.cli import parser as client_parser
from .engine.vllm.check_vllm import PROG as CHECK_VLLM_PROG
from .engine.vllm.check_vllm import build_parser as check_vllm_parser
from .server import ServerConfig
from .testing.mock_config import MockConfig

REGENERATE = ".venv/bin/python -m vllm_router.flag_reference docs/flags.md"
# What add_flags and the client's own help append: a default, or the variable that gives it.
DEFAULT_NOTE = re.compile(r"\s*\(default: ([^()]*)\)$")
# What argparse's BooleanOptionalAction appends to a help (Python 3.13 and older).
BOOLEAN_NOTE = " (default: %(default)s)"


def _cell(text: str) -> str:
    """One table cell: one line, its pipes escaped, and `<` too (`<key>` is no HTML tag)."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def _code(text: str) -> str:
    return f"`{text}`"


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _invocation(action: argparse.Action) -> str:
    """The flag as typed: its names, then its value's placeholder (argparse's choices form)."""
    if not action.option_strings:
        name = action.metavar if isinstance(action.metavar, str) else action.dest
        return _code(f"{name} ..." if action.nargs == "+" else name)
    names = " / ".join(_code(option) for option in action.option_strings)
    if _is_switch(action):
        return names
    if isinstance(action.metavar, str):
        value = action.metavar
    elif action.choices is not None:
        value = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        value = "INT" if action.type is int else "FLOAT" if action.type is float else "TEXT"
    if action.nargs == "+":
        value = f"{value} [{value} ...]"
    return f"{names} {_code(value)}"


def _value(value: object, *, switch: bool) -> str:
    if value is argparse.SUPPRESS or value is None:
        return "unset"
    if switch:
        return "on" if value else "off"
    return _code(str(value) if value != "" else '""')


def _default_and_help(action: argparse.Action) -> tuple[str, str]:
    """The default as the page shows it, and the help without the note that repeats it. A
    note ("(default: $VARIABLE)", "(default: --host)") is shown as written: never the value a
    variable has where the page is rendered."""
    text = (action.help or "").removesuffix(BOOLEAN_NOTE)
    if "%(" in text:
        raise ValueError(f"{action.option_strings}: help with a format field: {text!r}")
    text = text.replace("%%", "%")
    note = DEFAULT_NOTE.search(text)
    if note is not None:
        text = text[: note.start()]
    if not action.option_strings and action.required:
        shown = "required"
    elif note is not None and note.group(1) != str(action.default) and not _is_switch(action):
        shown = _code(note.group(1))  # a variable, or another flag, gives it
    else:
        shown = _value(action.default, switch=_is_switch(action))
    return shown, text.strip()


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return lines


def _flags(actions: Iterable[argparse.Action]) -> list[argparse.Action]:
    return [
        action
        for action in actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
    ]


def _key(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


# -- vllm-servicer ------------------------------------------------------------------------------

OUR_DESTS = frozenset(
    {field.name for field in dataclasses.fields(ServerConfig)}
    | {"mock_" + field.name for field in dataclasses.fields(MockConfig)}
    | {"mock_engine", "log_level"}
)


def _groups(
    parser: argparse.ArgumentParser, *, ungrouped: bool
) -> list[tuple[str, list[argparse.Action]]]:
    """The parser's groups of this package's flags, in order; with `ungrouped`, the flags
    outside any group too (as "other": on vLLM's parser those are vLLM's)."""
    found = []
    for group in parser._action_groups:
        default = group in (parser._optionals, parser._positionals)
        actions = _flags(group._group_actions)
        if (default and not ungrouped) or not actions:
            continue
        if all(action.dest in OUR_DESTS for action in actions):
            found.append(("other" if default else group.title or "other", actions))
    return found


def _where(action: argparse.Action, ours: set[str], vllm: argparse.ArgumentParser) -> str:
    """Which parser takes the flag: both, vLLM's alone, or ours with vLLM's own of its name."""
    key = _key(action)
    if key not in ours:
        return "real engine only"
    own = vllm._option_string_actions.get(key)
    if own is None:
        return "mock only"
    if any(own is a for _, actions in _groups(vllm, ungrouped=False) for a in actions):
        return "both"
    default, _ = _default_and_help(own)
    return f"mock; on a real engine vLLM's own {_invocation(own)} (default {default})"


def server_reference() -> list[str]:
    ours = build_parser(with_vllm=False)
    vllm = build_parser(with_vllm=True)
    our_keys = {_key(action) for action in _flags(ours._actions)}
    sections: dict[str, list[argparse.Action]] = {}
    for title, actions in _groups(vllm, ungrouped=False) + _groups(ours, ungrouped=True):
        listed = {_key(action) for action in sections.setdefault(title, [])}
        sections[title] += [action for action in actions if _key(action) not in listed]
    lines = [
        "## `vllm-servicer`",
        "",
        "Two parsers take its command line. On a **real engine** (vLLM installed, no "
        "`--mock-engine` on the line) vLLM's: every `AsyncEngineArgs` flag (`vllm-servicer "
        "--help` lists them; they are vLLM's and not repeated here) and this package's flags "
        "below. With `--mock-engine`, or without vLLM, the **mock** parser: this package's "
        "flags alone. The column *parser* says which take each flag.",
    ]
    for title, actions in sections.items():
        rows = []
        for action in actions:
            default, help_text = _default_and_help(action)
            rows.append((_invocation(action), default, _where(action, our_keys, vllm), help_text))
        lines += ["", f"### {title}", ""]
        lines += _table(("flag", "default", "parser", "what"), rows)
    return lines


# -- vllm-servicer check-vllm -------------------------------------------------------------------


def check_vllm_reference() -> list[str]:
    lines = [
        f"## `{CHECK_VLLM_PROG}`",
        "",
        "Reads what the worker would run on a vLLM without starting an engine (the installed "
        "one, or another release's `vllm` package): every touch point and feature, and the "
        "public API the worker calls ([vLLM versions](operations.md#vllm-versions)).",
        "",
    ]
    return lines + _table(("flag", "default", "what"), _rows(_flags(check_vllm_parser()._actions)))


# -- vllm-servicer-client -----------------------------------------------------------------------


def _rows(actions: Iterable[argparse.Action]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for action in actions:
        default, help_text = _default_and_help(action)
        rows.append((_invocation(action), default, help_text))
    return rows


def client_reference() -> list[str]:
    top = client_parser()
    top_dests = {action.dest for action in _flags(top._actions)}
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help or "" for choice in commands._choices_actions}
    lines = [
        "## `vllm-servicer-client`",
        "",
        "`vllm-servicer-client [OPTIONS] COMMAND [ARGUMENTS]`. The options below are taken "
        "before the command and after it (`health --address HOST:PORT`, as probes are "
        "written), where only one given there overrides.",
        "",
    ]
    lines += _table(("option", "default", "what"), _rows(_flags(top._actions)))
    for name, sub in commands.choices.items():
        own = [
            action
            for action in _flags(sub._actions)
            if not (action.dest in top_dests and action.default is argparse.SUPPRESS)
        ]
        lines += ["", f"### `{name}`", "", _cell(helps.get(name, "")) + "."]
        if own:
            lines += ["", *_table(("argument", "default", "what"), _rows(own))]
    return lines


def render() -> str:
    lines = [
        f"<!-- Generated from the parsers by `{REGENERATE}`: edit the flags' help in the "
        "code, then run that. py_test/test_flag_reference.py fails while this page differs. -->",
        "",
        "# Flag reference",
        "",
        "Every flag of the two commands (and of `vllm-servicer check-vllm`), with its default "
        "and its help, as the parsers define them. What the flags do together, by task: "
        "[operations](operations.md#command-line).",
        "",
        *server_reference(),
        "",
        *check_vllm_reference(),
        "",
        *client_reference(),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_router.flag_reference", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "page", nargs="?", type=Path, help="write the page here (default: print it)"
    )
    page = parser.parse_args(argv).page
    text = render()  # vLLM's import may log on stdout: the file gets the page alone
    if page is None:
        print(text, end="")
    else:
        page.write_text(text)


if __name__ == "__main__":
    main()
