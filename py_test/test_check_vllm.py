"""`vllm-servicer check-vllm`: the touch-point table read from vLLM's classes, no engine.

On the installed vLLM every touch point runs and the command exits 0; a vLLM source folder
that lacks what the worker needs falls back feature by feature, and exits 1 when an essential
public call is missing; a changed signature turns only its feature to its fallback. The saved
outputs (docs/check-vllm.md), the data compat.CHECKED_VERSIONS is read from, and the `vllm`
extra's bounds say the same thing. Nothing here starts an engine.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_router.engine.vllm import check_vllm, compat, public_api
from vllm_router.engine.vllm.check_versions import DATA, INSTALLED, REGENERATE, _how

from harness import require
from real_engine import require_vllm

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "check-vllm.md"
STALE = f"docs/check-vllm.md is stale: run `{REGENERATE}`"
FALLS_BACK = check_vllm.FALLS_BACK
FEATURES = len({point.feature for point in compat.TOUCH_POINTS})


def _check_vllm(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it (`vllm-servicer check-vllm ...`)."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_router.vllm_servicer", "check-vllm", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def _section(version: str) -> str:
    """The page's section for `version`, from its heading to the next one."""
    page = PAGE.read_text()
    match = re.search(rf"^## vLLM {re.escape(version)}\n(.*?)(?=^## |\Z)", page, re.S | re.M)
    assert match, f"docs/check-vllm.md has no section for vLLM {version}"
    return match.group(0).rstrip("\n")


@pytest.mark.vllm
@pytest.mark.slow  # it imports vLLM in a child process: half a minute on 2 cores
def test_every_touch_point_runs_on_the_installed_vllm() -> None:
    require_vllm()
    done = _check_vllm()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    version = re.search(r"^vLLM (\S+) at ", out, re.M)
    assert version and version.group(1).split("+")[0] in compat.CHECKED_VERSIONS, out
    for point in compat.TOUCH_POINTS:
        assert f"  runs        {point.name}  [{point.feature}]" in out, point.name
    for feature in {point.feature for point in compat.TOUCH_POINTS}:
        assert f"  runs        {feature}\n" in out, feature
    # Every public call is there but what only a later vLLM has (0.34's sleep keyword).
    later = {call.name for call in public_api.PUBLIC_API if "(vLLM 0.34)" in call.name}
    assert later, "the table names what only vLLM 0.34 has"
    for call in public_api.PUBLIC_API:
        state = "missing" if call.name in later else "ok"
        assert f"  {state:<10}{call.name}: " in out, call.name
    assert FALLS_BACK not in out
    assert len(re.findall(r"^  missing ", out, re.M)) == len(later)
    assert f"Result: {len(later)} non-essential public calls missing; the worker serves." in out


def _fake_vllm(root: Path, version: str) -> Path:
    """A `vllm` package that has a version and nothing else the worker touches."""
    package = root / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    return root


def test_a_vllm_without_what_the_worker_needs_falls_back_and_exits_1(tmp_path: Path) -> None:
    source = _fake_vllm(tmp_path / "source", "0.99.0")
    done = _check_vllm("--vllm-source", str(source))
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert f"vLLM 0.99.0 at {(source / 'vllm').resolve()}," in out
    # A touch point whose module is gone falls back, with the import that failed.
    assert (
        "  falls back  IncrementalDetokenizer.get_next_output_text  [lean outputs]: "
        "cannot import vllm.v1: No module named 'vllm.v1'" in out
    )
    assert f"  falls back  {compat.LEAN_OUTPUTS}: {compat.GENERATE_PATH} (because" in out
    # One that needs only prometheus_client still runs: features are judged one by one.
    assert f"  runs        {compat.ENGINE_SERIES}\n" in out
    assert "  MISSING   AsyncLLM.generate: " in out
    assert "Result: the worker cannot run on this vLLM: " in out


def test_a_module_that_fails_while_imported_is_told_as_that_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM module that raises as it loads (a compiled part this machine lacks, say) is a
    failed import, named as such, like a module that is gone."""
    (tmp_path / "loads_badly.py").write_text('raise RuntimeError("no kernels here")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    point = compat.TouchPoint("a.b", "feature", "the public path", lambda shape: _load_badly())
    problem = compat.touch_point_problem(point, compat.VllmShape())
    assert problem == "cannot import loads_badly: RuntimeError: no kernels here"


def _load_badly() -> str | None:
    import loads_badly  # type: ignore[import-not-found]

    return str(loads_badly)


def test_a_folder_without_a_vllm_package_is_an_error(tmp_path: Path) -> None:
    done = _check_vllm("--vllm-source", str(tmp_path))
    assert done.returncode == 1
    assert "holds no vllm package" in done.stderr and not done.stdout


@pytest.mark.vllm
def test_a_changed_signature_falls_back_for_its_feature_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read in this process (the command's child does the same), with one vLLM method
    changed as a new release might change it."""
    require_vllm()
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    def changed(self: object, finished: bool) -> str:
        raise AssertionError("only its signature is read")

    monkeypatch.setattr(IncrementalDetokenizer, "get_next_output_text", changed)
    report = check_vllm.read_vllm()
    assert report.falls_back() == [compat.LEAN_OUTPUTS]
    text = check_vllm.render_text(report)
    assert (
        "  falls back  IncrementalDetokenizer.get_next_output_text  [lean outputs]: "
        "takes (finished)" in text
    )
    assert f"1 of {FEATURES} features fall back; " in text and "the worker serves." in text
    assert check_vllm.exit_status(report) == 0  # the worker serves, on vLLM's public path
    assert check_vllm.exit_status(report, require_all=True) == 1


@pytest.mark.vllm
def test_the_saved_output_is_the_installed_vllms() -> None:
    """The installed vLLM's section of docs/check-vllm.md is what the check reads now: a
    touch point or public call changed in the code fails here until the page is written
    again (which reads the other releases again too)."""
    require_vllm()
    report = check_vllm.read_vllm()
    version = report.version.split("+")[0]
    require(version in PAGE.read_text(), f"docs/check-vllm.md has no vLLM {version}: {STALE}")
    expected = check_vllm.render_markdown(report, "##", _how(INSTALLED, report))
    how = re.compile(r"^How: .*\n\n", re.M)
    assert how.sub("", _section(version)) == how.sub("", expected), STALE


def test_checked_versions_are_what_the_page_shows() -> None:
    data = json.loads(DATA.read_text())["versions"]
    assert [entry["how"] for entry in data].count("installed, run by the test suite") == 1
    passed = tuple(entry["version"] for entry in data if entry["passed"])
    assert compat.CHECKED_VERSIONS == passed
    for entry in data:
        section = _section(entry["version"])
        # Passed: every feature runs and no essential call is missing (a non-essential one
        # may be, and the page says which).
        serves = "Result: every feature runs and the public API" in section or (
            "non-essential public calls missing; the worker serves" in section
        )
        assert serves == entry["passed"], entry["version"]
        assert (entry["passed"] and not entry["missing"]) == (
            "Result: every feature runs and the public API" in section
        ), entry["version"]
        assert (f"| {FALLS_BACK}" in section) == bool(entry["falls_back"]), entry["version"]


def test_the_vllm_extra_bounds_the_checked_versions() -> None:
    """pyproject.toml's `vllm` extra admits every release checked and none past the newest."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^vllm = \["vllm([^"]*)"\]', text, re.M)
    assert match, "no `vllm` extra in pyproject.toml"
    bounds = SpecifierSet(match.group(1))
    checked = [Version(v) for v in compat.CHECKED_VERSIONS]
    assert all(version in bounds for version in checked), (bounds, checked)
    newest = max(checked)
    assert Version(f"{newest.major}.{newest.minor + 1}.0") not in bounds, bounds


def test_the_public_api_names_every_request_keyword_the_adapter_passes() -> None:
    """What adapter.py gives AsyncLLM.generate / add_request by keyword (`options=` of its
    VllmCall, and the reasoning gate's) is what check-vllm looks for, no more, no less."""
    adapter = ROOT / "py_src" / "vllm_router" / "engine" / "vllm" / "adapter.py"
    tree = ast.parse(adapter.read_text())
    passed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "options":
                    passed |= {
                        key.value
                        for inner in ast.walk(keyword.value)
                        if isinstance(inner, ast.Dict)
                        for key in inner.keys
                        if isinstance(key, ast.Constant) and isinstance(key.value, str)
                    }
        if isinstance(node, ast.FunctionDef) and node.name == "_reasoning_gate":
            passed |= {
                target.slice.value
                for inner in ast.walk(node)
                if isinstance(inner, ast.Assign)
                for target in inner.targets
                if isinstance(target, ast.Subscript)
                and isinstance(target.slice, ast.Constant)
                and isinstance(target.slice.value, str)
            }
    expected = {*compat.REQUEST_KEYWORDS, *public_api.OPTIONAL_REQUEST_KEYWORDS}
    assert passed == expected, passed ^ expected
