"""The `file` weight-transfer backend's rules (engine/vllm/file_weights.py), without an engine:
which files a trainer may name (beneath the operator's root, resolved; nothing without a root),
how a file is opened (from the root, one directory at a time, following no link: a directory
swapped for a link after the check leads nowhere), the staging of an update's chunks (checked
as they arrive, a retried chunk taken once) and what a failure says about the served model.
The backend loading weights into a real engine: test_real_weight_transfer.py."""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from vllm_router.defaults import WEIGHT_FILE_ROOT_ENV
from vllm_router.engine.vllm.file_weights import (
    NO_ROOT,
    NOT_RESTORED,
    UNCHANGED,
    FileUpdateInfo,
    OutsideRoot,
    Staging,
    WeightFileRule,
    checkpoint_shapes,
    narrowed_root,
    open_beneath,
    resolved_path,
)
from vllm_router.errors import EngineOperationFailed, PathRefused

from harness import require


def _outside(path: str) -> str:
    return f"update_info.path {path!r} is outside the weight-file root"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The worker's root (resolved, as configured_root gives it), beside an outside dir."""
    base = tmp_path.resolve()
    (base / "root" / "sub").mkdir(parents=True)
    (base / "outside").mkdir()
    return base / "root"


def _needs_torch() -> None:
    require(
        importlib.util.find_spec("torch") is not None
        and importlib.util.find_spec("safetensors") is not None,
        "torch and safetensors are not installed (make test)",
    )


def _save(path: Path, **tensors: Any) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


# -- which paths ------------------------------------------------------------------------------


def test_without_a_root_every_path_is_refused(root: Path) -> None:
    for path in (str(root / "w.safetensors"), "w.safetensors", "", "."):
        with pytest.raises(OutsideRoot) as err:
            resolved_path(None, path)
        assert str(err.value) == NO_ROOT
    assert NO_ROOT.startswith("no weight-file root is set on this worker")


def test_paths_beneath_the_root_are_resolved(root: Path) -> None:
    (root / "sub" / "w.safetensors").write_bytes(b"")
    (root / "link.safetensors").symlink_to(root / "sub" / "w.safetensors")  # inside: allowed
    (root / "sub-link").symlink_to(root / "sub")
    expected = str(root / "sub" / "w.safetensors")
    for path in (
        expected,
        "sub/w.safetensors",  # relative to the root
        "./sub/w.safetensors",
        "sub/../sub/w.safetensors",
        "link.safetensors",
        "sub-link/w.safetensors",
        f"{root}/sub/./w.safetensors",
    ):
        assert resolved_path(str(root), path) == expected, path
    # A file that is not there yet is beneath the root all the same (opening it tells).
    assert resolved_path(str(root), "later.safetensors") == str(root / "later.safetensors")


def test_paths_that_resolve_outside_the_root_are_refused(root: Path) -> None:
    outside = root.parent / "outside"
    (outside / "w.safetensors").write_bytes(b"")
    (root / "out.safetensors").symlink_to(outside / "w.safetensors")  # a file link out
    (root / "out-dir").symlink_to(outside)  # a directory link out
    (root.parent / "root2").mkdir()  # shares the root's name's start
    for path in (
        str(outside / "w.safetensors"),
        "../outside/w.safetensors",
        "sub/../../outside/w.safetensors",
        "out.safetensors",
        "out-dir/w.safetensors",
        str(root.parent / "root2" / "w.safetensors"),
        "/etc/passwd",
        "..",
    ):
        with pytest.raises(OutsideRoot) as err:
            resolved_path(str(root), path)
        assert str(err.value) == _outside(path), path


def test_outside_the_root_existence_and_access_make_no_difference(root: Path) -> None:
    """One message for a path outside the root whether it exists, is missing or cannot be
    read (no oracle for what lies outside)."""
    target = root.parent / "outside" / "w.safetensors"
    path = str(target)

    def refusal() -> str:
        with pytest.raises(OutsideRoot) as err:
            resolved_path(str(root), path)
        return str(err.value)

    missing = refusal()
    target.write_bytes(b"secret")
    existing = refusal()
    target.chmod(0)
    target.parent.chmod(0)
    try:
        unreadable = refusal()
    finally:
        target.parent.chmod(0o755)
    assert missing == existing == unreadable == _outside(path)


def test_a_file_is_opened_beneath_the_root(root: Path) -> None:
    (root / "sub" / "w.safetensors").write_bytes(b"weights")
    path = resolved_path(str(root), "sub/w.safetensors")
    with open_beneath(str(root), path, "sub/w.safetensors") as opened:
        assert opened.startswith("/proc/self/fd/")
        assert Path(opened).read_bytes() == b"weights"
    with pytest.raises(ValueError) as err:
        with open_beneath(str(root), str(root / "gone"), "gone"):
            pass
    assert str(err.value) == "update_info.path 'gone': no such file beneath the root"
    with pytest.raises(OutsideRoot) as err:  # the root itself names no file
        with open_beneath(str(root), str(root), "."):
            pass
    assert str(err.value) == _outside(".")


def test_an_open_follows_no_link_even_one_that_stays_inside(root: Path) -> None:
    (root / "sub" / "w.safetensors").write_bytes(b"")
    (root / "link.safetensors").symlink_to(root / "sub" / "w.safetensors")
    # resolved_path gives the link's target; the link itself, named as such, is not opened.
    with pytest.raises(ValueError) as err:
        with open_beneath(str(root), str(root / "link.safetensors"), "link.safetensors"):
            pass
    assert str(err.value) == (
        "update_info.path 'link.safetensors' cannot be opened: Too many levels of symbolic links"
    )


@pytest.mark.parametrize("swapped", ["directory", "file"])
def test_a_swap_for_a_link_after_the_check_leads_nowhere(root: Path, swapped: str) -> None:
    """The path is checked (resolved_path), then a directory on it (or the file itself) is
    replaced by a link to outside before the open: the open refuses it."""
    outside = root.parent / "outside"
    (root / "sub" / "w.safetensors").write_bytes(b"inside")
    (outside / "w.safetensors").write_bytes(b"outside")
    path = resolved_path(str(root), "sub/w.safetensors")
    if swapped == "directory":
        (root / "sub").rename(root / "sub.before")
        (root / "sub").symlink_to(outside)
        reason = "Not a directory"
    else:
        (root / "sub" / "w.safetensors").unlink()
        (root / "sub" / "w.safetensors").symlink_to(outside / "w.safetensors")
        reason = "Too many levels of symbolic links"
    with pytest.raises(ValueError) as err:
        with open_beneath(str(root), path, "sub/w.safetensors"):
            pytest.fail("a link was followed")
    assert str(err.value) == f"update_info.path 'sub/w.safetensors' cannot be opened: {reason}"
    assert Path(path).read_bytes() == b"outside"  # where following the link would have led


def test_a_directory_is_not_a_regular_file(root: Path) -> None:
    path = resolved_path(str(root), "sub")
    with pytest.raises(ValueError) as err:
        with open_beneath(str(root), path, "sub"):
            pass
    assert str(err.value) == "update_info.path 'sub' is not a regular file"


def test_a_fifo_is_not_a_regular_file_and_does_not_block(root: Path) -> None:
    """A fifo beneath the root is refused at once: opening it for reading must not wait for
    a writer (it would hold the engine's worker forever)."""
    fifo = root / "sub" / "pipe"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            with open_beneath(str(root), resolved_path(str(root), "sub/pipe"), "sub/pipe"):
                pass
        except BaseException as exc:
            errors.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(10)
    if opener.is_alive():  # blocked in open(): a writer releases it before the test fails
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        opener.join(10)
        os.close(writer)
        pytest.fail("open_beneath blocked on a fifo, waiting for a writer")
    assert [str(e) for e in errors] == ["update_info.path 'sub/pipe' is not a regular file"]
    assert all(type(e) is ValueError for e in errors)


# -- Init: narrowing the root -----------------------------------------------------------------


def test_init_narrows_the_root_beneath_it(root: Path) -> None:
    assert narrowed_root(str(root), None) == str(root)
    assert narrowed_root(None, None) is None
    assert narrowed_root(str(root), "sub") == str(root / "sub")
    assert narrowed_root(str(root), str(root / "sub")) == str(root / "sub")
    assert narrowed_root(str(root), "./sub/../sub/") == str(root / "sub")
    assert narrowed_root(str(root), ".") == str(root)
    (root / "sub-link").symlink_to(root / "sub")
    assert narrowed_root(str(root), "sub-link") == str(root / "sub")


def test_init_never_widens_the_root(root: Path) -> None:
    (root / "out-link").symlink_to(root.parent / "outside")
    for root_dir in (
        str(root.parent / "outside"),
        "..",
        "../outside",
        "sub/../../outside",
        "out-link",
        "/",
    ):
        with pytest.raises(OutsideRoot) as err:
            narrowed_root(str(root), root_dir)
        assert str(err.value) == (
            f"init_info.root_dir {root_dir!r} is outside the worker's weight-file root"
        ), root_dir


def test_init_without_a_worker_root_narrows_nothing(root: Path) -> None:
    for root_dir in (str(root), "sub", "."):
        with pytest.raises(OutsideRoot) as err:
            narrowed_root(None, root_dir)
        assert str(err.value) == NO_ROOT


# -- staging an update's chunks -----------------------------------------------------------------


def test_chunks_are_staged_once_and_read_back(root: Path) -> None:
    _needs_torch()
    import torch

    a, b, c = torch.arange(6.0).reshape(2, 3), torch.ones(4), torch.full((1, 2), 7.0)
    _save(root / "one.safetensors", a=a, b=b)
    _save(root / "sub" / "two.safetensors", c=c)
    staging = Staging(None)
    assert staging.add(FileUpdateInfo("one.safetensors"), str(root)) is True
    assert staging.add(FileUpdateInfo(str(root / "sub" / "two.safetensors")), str(root))
    # The same chunk again (a trainer's retry) is taken once.
    assert staging.add(FileUpdateInfo("one.safetensors"), str(root)) is False
    assert staging.add(FileUpdateInfo(str(root / "one.safetensors")), str(root)) is False
    assert [(c.path, c.names, c.shown) for c in staging.chunks] == [
        (str(root / "one.safetensors"), ("a", "b"), "one.safetensors"),
        (str(root / "sub" / "two.safetensors"), ("c",), str(root / "sub" / "two.safetensors")),
    ]
    read = staging.read(str(root))
    assert [name for name, _ in read] == ["a", "b", "c"]
    for (_, got), want in zip(read, (a, b, c), strict=True):
        assert torch.equal(got, want)


def test_a_chunk_may_name_some_of_its_files_tensors(root: Path) -> None:
    _needs_torch()
    import torch

    _save(root / "w.safetensors", a=torch.zeros(2), b=torch.ones(3), c=torch.full((2,), 5.0))
    staging = Staging(None)
    assert staging.add(FileUpdateInfo("w.safetensors", ["c", "a"]), str(root))
    assert staging.add(FileUpdateInfo("w.safetensors", ["b"]), str(root))
    read = dict(staging.read(str(root)))
    assert list(read) == ["c", "a", "b"]
    assert torch.equal(read["c"], torch.full((2,), 5.0)) and torch.equal(read["b"], torch.ones(3))


def test_a_tensor_already_sent_from_another_file_is_refused(root: Path) -> None:
    _needs_torch()
    import torch

    _save(root / "one.safetensors", a=torch.zeros(2), b=torch.zeros(2))
    _save(root / "two.safetensors", a=torch.ones(2), z=torch.ones(1))
    staging = Staging(None)
    assert staging.add(FileUpdateInfo("one.safetensors", ["a"]), str(root))
    with pytest.raises(ValueError) as err:
        staging.add(FileUpdateInfo("two.safetensors"), str(root))
    assert str(err.value) == (
        "tensors already sent in this update: ['a'] (each tensor once per update)"
    )
    # A chunk that overlaps a staged one is not a retry of it: refused the same.
    with pytest.raises(ValueError) as err:
        staging.add(FileUpdateInfo("one.safetensors"), str(root))
    assert str(err.value).startswith("tensors already sent in this update: ['a']")
    assert staging.add(FileUpdateInfo("two.safetensors", ["z"]), str(root))
    assert staging.add(FileUpdateInfo("one.safetensors", ["b"]), str(root))
    assert [(c.shown, c.names) for c in staging.chunks] == [
        ("one.safetensors", ("a",)),
        ("two.safetensors", ("z",)),
        ("one.safetensors", ("b",)),
    ]


def test_bad_names_are_refused(root: Path) -> None:
    _needs_torch()
    import torch

    _save(root / "w.safetensors", a=torch.zeros(2), b=torch.zeros(2))
    staging = Staging(None)
    with pytest.raises(ValueError) as err:
        staging.add(FileUpdateInfo("w.safetensors", ["a", "b", "a"]), str(root))
    assert str(err.value) == "update_info.names lists ['a'] more than once"
    with pytest.raises(ValueError) as err:
        staging.add(FileUpdateInfo("w.safetensors", ["a", "missing"]), str(root))
    assert str(err.value) == "tensors not in 'w.safetensors': ['missing']"
    assert staging.chunks == []  # nothing staged by a refused chunk
    assert staging.add(FileUpdateInfo("w.safetensors", ["a"]), str(root))


def test_shapes_are_checked_against_the_served_checkpoint(root: Path, tmp_path: Path) -> None:
    _needs_torch()
    import torch

    model = tmp_path / "model"
    model.mkdir()
    _save(model / "model-1.safetensors", a=torch.zeros(2, 3))
    _save(model / "model-2.safetensors", b=torch.zeros(4))
    (model / "config.json").write_text("{}")
    reference = checkpoint_shapes(str(model))
    assert reference == {"a": (2, 3), "b": (4,)}
    _save(root / "wrong.safetensors", a=torch.zeros(3, 2), b=torch.zeros(4))
    staging = Staging(reference)
    with pytest.raises(ValueError) as err:
        staging.add(FileUpdateInfo("wrong.safetensors"), str(root))
    assert str(err.value) == (
        "tensors of the wrong shape in 'wrong.safetensors': "
        + repr(["a [3, 2] (the model's: [2, 3])"])
    )
    assert staging.add(FileUpdateInfo("wrong.safetensors", ["b"]), str(root))
    # A tensor the checkpoint does not have is not checked (the engine's load tells).
    _save(root / "extra.safetensors", extra=torch.zeros(9))
    assert staging.add(FileUpdateInfo("extra.safetensors"), str(root))


def test_checkpoint_shapes_without_safetensors_is_none(tmp_path: Path) -> None:
    _needs_torch()
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_shapes(str(tmp_path)) is None
    assert checkpoint_shapes(str(tmp_path / "missing")) is None
    assert checkpoint_shapes("org/hub-model") is None


def test_staging_refuses_what_the_rule_refuses(root: Path) -> None:
    _needs_torch()
    import torch

    _save(root.parent / "outside" / "w.safetensors", a=torch.zeros(1))
    (root / "w.safetensors").symlink_to(root.parent / "outside" / "w.safetensors")
    (root / "junk.safetensors").write_bytes(b"not safetensors")
    staging = Staging(None)
    with pytest.raises(OutsideRoot) as err:
        staging.add(FileUpdateInfo("w.safetensors"), str(root))
    assert str(err.value) == _outside("w.safetensors")
    with pytest.raises(OutsideRoot) as err:
        staging.add(FileUpdateInfo("w.safetensors"), None)
    assert str(err.value) == NO_ROOT
    with pytest.raises(ValueError, match=r"^cannot read 'junk.safetensors' as safetensors: "):
        staging.add(FileUpdateInfo("junk.safetensors"), str(root))
    assert staging.chunks == []


def test_read_opens_each_file_anew(root: Path) -> None:
    """What Finish reads is checked again: a file moved out, or changed, since its chunk was
    staged fails the read (the model is not touched)."""
    _needs_torch()
    import torch

    _save(root / "sub" / "w.safetensors", a=torch.zeros(2))
    staging = Staging(None)
    staging.add(FileUpdateInfo("sub/w.safetensors"), str(root))
    _save(root / "sub" / "w.safetensors", b=torch.zeros(2))
    with pytest.raises(ValueError, match=r"^cannot read 'sub/w.safetensors' as staged: "):
        staging.read(str(root))
    (root / "sub").rename(root / "sub.before")
    (root / "sub").symlink_to(root.parent / "outside")
    _save(root.parent / "outside" / "w.safetensors", a=torch.ones(2))
    with pytest.raises(OutsideRoot):  # the link resolves outside: refused before the open
        staging.read(str(root))


# -- the rule in the serving process ----------------------------------------------------------


def test_the_serving_process_refuses_a_path_outside_before_vllm(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WEIGHT_FILE_ROOT_ENV, str(root / "sub" / ".."))
    rule = WeightFileRule.of("file", restartable=True)
    assert (rule.applies, rule.root, rule.restartable) == (True, str(root), True)
    outside = str(root.parent / "outside" / "w.safetensors")
    with pytest.raises(PathRefused) as err:
        rule.check_update({"path": outside})
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.message == _outside(outside)
    rule.check_update({"path": "sub/w.safetensors"})  # beneath: vLLM's worker opens it
    rule.check_update({"names": ["a"]})  # no path: vLLM's parse refuses it
    rule.check_update({"path": 7})
    assert rule.narrowed({}) == str(root)
    assert rule.narrowed({"root_dir": "sub"}) == str(root / "sub")
    with pytest.raises(PathRefused) as err:
        rule.narrowed({"root_dir": "../outside"})
    assert (
        err.value.message
        == "init_info.root_dir '../outside' is outside the worker's weight-file root"
    )
    # Another backend: the rule does not apply.
    other = WeightFileRule.of("nccl", restartable=True)
    assert (other.applies, other.root, other.restartable) == (False, None, False)
    other.check_update({"path": outside})
    assert other.narrowed({"root_dir": "/anywhere"}) is None


def test_the_serving_process_without_a_root_refuses_every_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WEIGHT_FILE_ROOT_ENV, raising=False)
    rule = WeightFileRule.of("file", restartable=False)
    assert (rule.applies, rule.root) == (True, None)
    for update in ({"path": "/any/w.safetensors"}, {"path": "w.safetensors"}):
        with pytest.raises(PathRefused) as err:
            rule.check_update(update)
        assert (err.value.code, err.value.message) == (grpc.StatusCode.PERMISSION_DENIED, NO_ROOT)
    with pytest.raises(PathRefused) as err:
        rule.narrowed({"root_dir": "/any"})
    assert err.value.message == NO_ROOT
    assert rule.narrowed({}) is None


def _outcome(rule: WeightFileRule, message: str, *, loads: bool) -> tuple[Any, bool, str]:
    result = rule.outcome(EngineOperationFailed(message), loads=loads)
    assert type(result) is EngineOperationFailed
    assert result.code == grpc.StatusCode.INTERNAL
    return result.model_whole, result.restartable, result.message


def test_a_failure_tells_what_it_left_of_the_model() -> None:
    ours = WeightFileRule.of("file", restartable=True)
    failed = "update failed: cannot read 'w' as staged: boom"
    # A step that loads nothing (Start, UpdateWeights) leaves the model whole.
    assert _outcome(ours, failed, loads=False) == (True, False, failed)
    # Finish: refused before loading, or loaded and failed (undone, or not).
    refused = f"nothing loaded ({UNCHANGED})"
    assert _outcome(ours, refused, loads=True) == (True, False, refused)
    assert _outcome(ours, failed, loads=True) == (False, True, failed)
    lost = f"load failed; {NOT_RESTORED}"
    assert _outcome(ours, lost, loads=True) == (False, False, lost)
    # A vLLM that cannot undo a load: a part-loaded model is not restartable.
    no_undo = WeightFileRule.of("file", restartable=False)
    assert _outcome(no_undo, failed, loads=True) == (False, False, failed)
    # Another backend: unknown.
    other = WeightFileRule.of("nccl", restartable=True)
    for loads in (False, True):
        assert _outcome(other, refused, loads=loads) == (None, False, refused)
    assert UNCHANGED == "nothing was loaded: the served model is as it was"
    assert NOT_RESTORED == "the part-loaded model could not be restored"
