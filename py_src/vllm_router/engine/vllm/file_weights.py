"""A weight-transfer backend for vLLM that reads the new weights from safetensors files: the
trainer writes a file, `UpdateWeights` names it. For CPU workers (vLLM ships only GPU
backends: NCCL, CUDA IPC) and for tests; registered in every vLLM process of this
environment through a `vllm.general_plugins` entry point (pyproject.toml), so an engine
started with `--weight-transfer-config '{"backend": "file"}'` finds it in its workers —
vLLM's own servers (vllm-rs, `vllm serve`) included.

Which files it may read is the worker's operator's choice, never a remote caller's: the
root is set where the worker starts (`--weight-file-root`, which the CLI passes to vLLM's
processes as $VLLM_SERVICER_WEIGHT_FILE_ROOT; vLLM's own servers read the variable), and
with none every update is refused. Paths are resolved (links, `..`) and must lie beneath
the root; the file is then opened one directory at a time from the root without following
a link, so a directory swapped for a link between the check and the read leads nowhere,
and what was opened is checked to be a regular file.

The JSON a trainer sends (`init_info`, `update_info`, as for every backend):
- init: `{}` or `{"root_dir": "/shared/weights/run-3"}`: narrows the root for this
  engine (it must lie beneath the worker's root; `{}` goes back to the worker's root);
- update: `{"path": "/shared/weights/step-7.safetensors"}` (or a path relative to the
  root), optionally `"names": [...]` to load only some of its tensors. Names are the
  checkpoint's (Hugging Face) names, as in the model's own safetensors; each layer touched
  must be sent whole (vLLM's layerwise reload rebuilds a layer from what it received).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...defaults import WEIGHT_FILE_ROOT_ENV

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BACKEND = "file"
NO_ROOT = (
    "no weight-file root is set on this worker: the file backend reads no file (start the "
    f"worker with --weight-file-root, or ${WEIGHT_FILE_ROOT_ENV} for vLLM's own servers)"
)


class OutsideRoot(ValueError):
    """A path a remote caller named that this worker's operator did not allow."""


def register() -> None:
    """The plugin's entry point: register the backend with vLLM's factory (lazily: the
    module below is imported only by a worker that is configured with it). Runs in every
    vLLM process of this environment, vLLM's own servers included: whatever fails here is
    logged and swallowed, never raised into vLLM's start (vLLM catches a plugin that fails
    to import, not one that fails while it runs)."""
    try:
        _register()
    except Exception as exc:
        logger.warning(
            "vllm-servicer's %r weight-transfer backend is not registered (this vLLM's "
            "factory is not the one it was built for: %s: %s); vLLM runs without it",
            BACKEND, type(exc).__name__, exc,
        )  # fmt: skip


def _register() -> None:
    try:
        from vllm.distributed.weight_transfer import factory
    except ModuleNotFoundError:  # a vLLM without weight transfer: nothing to register
        return
    try:  # a factory without the class or its method is drift: raised, and logged above
        factory.WeightTransferEngineFactory.register_engine(
            BACKEND, "vllm_router.engine.vllm.file_weights_engine", "FileWeightTransferEngine"
        )
    except ValueError:  # registered already (vLLM refuses a name twice): harmless
        pass


def configured_root() -> str | None:
    """The worker's root, as its operator set it (resolved), or None."""
    root = os.environ.get(WEIGHT_FILE_ROOT_ENV, "")
    return os.path.realpath(root) if root else None


def beneath(root: str, path: str) -> bool:
    """Whether the resolved `path` is `root` or inside it (both resolved)."""
    return os.path.commonpath([root, path]) == root


def narrowed_root(root: str | None, root_dir: str | None) -> str | None:
    """The root an `InitWeightTransferEngine` sets: the worker's, or a directory beneath
    it; it never widens the worker's, and with no worker root there is none to narrow."""
    if root_dir is None:
        return root
    if root is None:
        raise OutsideRoot(NO_ROOT)
    wanted = os.path.realpath(os.path.join(root, root_dir))
    if not beneath(root, wanted):
        raise OutsideRoot(
            f"init_info.root_dir {root_dir!r} is outside the worker's weight-file root"
        )
    return wanted


def resolved_path(root: str | None, path: str) -> str:
    """`path` (absolute, or relative to the root) resolved; refused unless beneath the root.
    A path outside the root is refused with one message whether it exists or not."""
    if root is None:
        raise OutsideRoot(NO_ROOT)
    resolved = os.path.realpath(os.path.join(root, path))
    if not beneath(root, resolved):
        raise OutsideRoot(f"update_info.path {path!r} is outside the weight-file root")
    return resolved


@dataclass
class WeightFileRule:
    """The same rule, in the serving process: a path plainly outside the root is refused
    before vLLM is called (the update stays open); vLLM's worker checks again as it opens."""

    applies: bool
    worker_root: str | None  # the operator's, read once as the engine starts
    root: str | None  # the worker's, or what an Init narrowed it to
    # A load that fails in Finish can be undone on this vLLM (weight_reload.abort's names).
    restartable: bool = False

    @classmethod
    def of(cls, backend: str, *, restartable: bool) -> WeightFileRule:
        ours = backend == BACKEND
        root = configured_root() if ours else None
        return cls(ours, root, root, ours and restartable)

    def outcome(self, exc: Any, *, loads: bool) -> Any:
        """`exc` (an EngineOperationFailed from a weight-update step) with what it left of
        the served model, as far as this backend knows it: a step that loads nothing, or
        a Finish that refused before loading, left it whole; a Finish whose load failed
        left it consistent when undone, lost when not. Other backends: unknown."""
        from ...errors import EngineOperationFailed

        message = str(exc.message)
        if not self.applies:
            return EngineOperationFailed(message)
        if not loads or UNCHANGED in message:
            return EngineOperationFailed(message, model_whole=True)
        restored = self.restartable and NOT_RESTORED not in message
        return EngineOperationFailed(message, model_whole=False, restartable=restored)

    def narrowed(self, init_info: dict[str, Any]) -> str | None:
        """The root an Init with `init_info` sets (the worker's when it names none)."""
        root_dir = init_info.get("root_dir")
        if not self.applies or not isinstance(root_dir, str) or not root_dir:
            return self.worker_root
        return self._checked(narrowed_root, self.worker_root, root_dir)

    def check_update(self, update_info: dict[str, Any]) -> None:
        path = update_info.get("path")
        if self.applies and isinstance(path, str) and path:
            self._checked(resolved_path, self.root, path)

    @staticmethod
    def _checked(rule: Any, root: str | None, path: str) -> Any:
        from ...errors import PathRefused

        try:
            return rule(root, path)
        except OutsideRoot as exc:
            raise PathRefused(str(exc)) from None


@dataclass
class FileInitInfo:
    """What `InitWeightTransferEngine` takes: an optional directory the files must be in."""

    root_dir: str | None = None

    def __post_init__(self) -> None:  # where the root lies is checked by narrowed_root
        if self.root_dir is not None and (not isinstance(self.root_dir, str) or not self.root_dir):
            raise ValueError("root_dir must be a non-empty string")


@dataclass
class FileUpdateInfo:
    """What `UpdateWeights` takes: a safetensors file and, optionally, which of its tensors."""

    path: str
    names: list[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("path must be a non-empty string (a safetensors file)")
        if self.names is not None and (
            not isinstance(self.names, list) or not all(isinstance(n, str) for n in self.names)
        ):
            raise ValueError("names must be a list of tensor names")


@contextlib.contextmanager
def open_beneath(root: str, path: str, shown: str) -> Iterator[str]:
    """A path that names the file `path` (resolved, beneath `root`) as it was opened: one
    directory at a time from the root, following no link, so that nothing swapped in after
    the check leads outside; the file opened must be a regular file. Yields the
    `/proc/self/fd` name of the open file (what readers that take a path re-open)."""
    parts = os.path.relpath(path, root).split(os.sep)
    if parts == ["."] or ".." in parts:
        raise OutsideRoot(f"update_info.path {shown!r} is outside the weight-file root")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    opened: list[int] = []
    try:
        opened.append(os.open(root, flags | os.O_DIRECTORY))
        for part in parts[:-1]:
            opened.append(os.open(part, flags | os.O_DIRECTORY, dir_fd=opened[-1]))
        # Non-blocking: a fifo (or a device) is refused below at once, not waited on.
        fd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=opened[-1])
        opened.append(fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"update_info.path {shown!r} is not a regular file")
        yield f"/proc/self/fd/{fd}"
    except FileNotFoundError:
        raise ValueError(f"update_info.path {shown!r}: no such file beneath the root") from None
    except OSError as exc:  # a link (ELOOP, ENOTDIR), no permission
        raise ValueError(f"update_info.path {shown!r} cannot be opened: {exc.strerror}") from None
    finally:
        for fd in opened:
            os.close(fd)


# What the engine's failures say about the served model, for the serving process (the
# adapter reads them in the engine's message): a refusal before anything was loaded, and a
# load that failed and could not be undone.
UNCHANGED = "nothing was loaded: the served model is as it was"
NOT_RESTORED = "the part-loaded model could not be restored"


@dataclass(frozen=True)
class Chunk:
    """One UpdateWeights, checked and staged: which tensors of which file (resolved)."""

    path: str
    names: tuple[str, ...]
    shown: str  # the path as the trainer named it


def _shapes(opened: str, shown: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in a safetensors file (its header only)."""
    from safetensors import safe_open

    try:
        with safe_open(opened, framework="pt", device="cpu") as weights:
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    except Exception as exc:  # safetensors' own errors: a truncated or foreign file
        raise ValueError(f"cannot read {shown!r} as safetensors: {exc}") from exc


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """The served checkpoint's tensors and shapes (its safetensors headers), what a chunk's
    shapes are checked against; None when it has no local safetensors to read."""
    try:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    except OSError:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        shapes.update(_shapes(os.path.join(model_dir, name), name))
    return shapes or None


class Staging:
    """The chunks of the update in progress: each checked as it arrives (the file beneath
    the root, its tensors there, each named once in the update, shapes as the served
    checkpoint's), nothing loaded. A chunk sent again whole (a trainer's retry after a
    timeout) is taken once; a tensor sent twice from different chunks is refused."""

    def __init__(self, reference: dict[str, tuple[int, ...]] | None) -> None:
        self._reference = reference
        self.chunks: list[Chunk] = []
        self._source: dict[str, str] = {}  # tensor name -> the resolved file it comes from

    def add(self, info: FileUpdateInfo, root: str | None) -> bool:
        """Stage `info`; False when it repeats a staged chunk (nothing new to stage)."""
        path = resolved_path(root, info.path)
        assert root is not None  # resolved_path refuses None
        with open_beneath(root, path, info.path) as opened:
            shapes = _shapes(opened, info.path)
        names = tuple(info.names) if info.names is not None else tuple(sorted(shapes))
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"update_info.names lists {twice[:5]} more than once")
        missing = [name for name in names if name not in shapes]
        if missing:
            raise ValueError(f"tensors not in {info.path!r}: {missing[:5]}")
        if names and all(self._source.get(name) == path for name in names):
            return False
        sent = [name for name in names if name in self._source]
        if sent:
            raise ValueError(
                f"tensors already sent in this update: {sent[:5]} (each tensor once per update)"
            )
        if self._reference is not None:
            wrong = [
                f"{name} {list(shapes[name])} (the model's: {list(self._reference[name])})"
                for name in names
                if name in self._reference and shapes[name] != self._reference[name]
            ]
            if wrong:
                raise ValueError(f"tensors of the wrong shape in {info.path!r}: {wrong[:3]}")
        self.chunks.append(Chunk(path, names, info.path))
        self._source.update((name, path) for name in names)
        return True

    def read(self, root: str | None) -> list[tuple[str, torch.Tensor]]:
        """Every staged tensor, read again (each file opened beneath the root anew)."""
        weights: list[tuple[str, torch.Tensor]] = []
        for chunk in self.chunks:
            path = resolved_path(root, chunk.shown)
            assert root is not None
            with open_beneath(root, path, chunk.shown) as opened:
                weights += _read(opened, chunk)
        return weights


def _read(opened: str, chunk: Chunk) -> list[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(opened, framework="pt", device="cpu") as weights:
            return [(name, weights.get_tensor(name)) for name in chunk.names]
    except Exception as exc:  # the file changed since its chunk was checked
        raise ValueError(f"cannot read {chunk.shown!r} as staged: {exc}") from exc


def parse(cls: type[Any], info: dict[str, Any], what: str) -> Any:
    """`cls(**info)`, its failures told as vLLM's backends tell them."""
    if not isinstance(info, dict):
        raise ValueError(f"{what} must be a JSON object")
    try:
        return cls(**info)
    except TypeError as exc:
        raise ValueError(f"Invalid {what} for the file backend: {exc}") from exc
