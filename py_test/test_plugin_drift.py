"""This package's vLLM plugins (`vllm.general_plugins`: engine/vllm/cpu_amx.py and the `file`
weight backend's registration in engine/vllm/file_weights.py) run in every vLLM process of
the environment, vLLM's own servers included. vLLM catches a plugin that fails to import, not
one that fails while it runs: here vLLM drifts under them while they run (its registry
renamed, torch's AMX check gone or failing) and they log and return; vLLM's plugin loader
returns, and vLLM's own OpenAI server, in an environment broken so, still starts."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import vllm_router.engine.vllm.cpu_amx as cpu_amx
import vllm_router.engine.vllm.file_weights as file_weights

from real_engine import require_vllm, tiny_model
from vllm_servers import vllm_openai_server

pytestmark = pytest.mark.vllm

FACTORY = "vllm.distributed.weight_transfer.factory"
OURS = ("vllm_router_cpu_amx", "vllm_router_file_weights")  # pyproject.toml's entry points
NOT_REGISTERED = "vllm-servicer's 'file' weight-transfer backend is not registered"


def _raising(exc: BaseException) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


def _factory() -> Any:
    require_vllm()
    from vllm.distributed.weight_transfer import factory

    return factory


def _records(caplog: pytest.LogCaptureFixture, module: Any) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == module.__name__]


# -- each plugin on its own --------------------------------------------------------------------


@pytest.mark.parametrize(
    "drift",
    [AttributeError("registry renamed"), TypeError("register_engine() takes 2 arguments")],
    ids=["registry-renamed", "signature-changed"],
)
def test_the_file_backend_plugin_survives_a_registry_that_fails_while_it_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, drift: Exception
) -> None:
    factory = _factory()
    monkeypatch.setattr(factory.WeightTransferEngineFactory, "register_engine", _raising(drift))
    file_weights.register()
    assert _records(caplog, file_weights) == [
        (
            logging.WARNING,
            f"{NOT_REGISTERED} (this vLLM's factory is not the one it was built for: "
            f"{type(drift).__name__}: {drift}); vLLM runs without it",
        )
    ]


def test_the_file_backend_plugin_survives_its_factory_gone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    factory = _factory()
    monkeypatch.delattr(factory, "WeightTransferEngineFactory")
    file_weights.register()
    monkeypatch.setitem(sys.modules, FACTORY, None)  # the whole module gone
    file_weights.register()
    assert not [r for r in _records(caplog, file_weights) if r[0] >= logging.ERROR]


def test_the_file_backend_registered_twice_is_no_drift(caplog: pytest.LogCaptureFixture) -> None:
    factory = _factory()
    file_weights.register()
    file_weights.register()  # vLLM refuses a name twice (ValueError): harmless
    assert file_weights.BACKEND in factory.WeightTransferEngineFactory._registry
    assert _records(caplog, file_weights) == []


def test_the_amx_plugin_survives_torch_failing_while_it_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    require_vllm()
    import torch

    caplog.set_level(logging.DEBUG, logger=cpu_amx.__name__)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", _raising(RuntimeError("no cpuid")))
    cpu_amx.request_amx_permission()
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")  # renamed in a later torch
    cpu_amx.request_amx_permission()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch._C._cpu, "_init_amx", _raising(OSError("arch_prctl failed")))
    cpu_amx.request_amx_permission()
    assert _records(caplog, cpu_amx) == [
        (logging.DEBUG, "AMX permission not requested: RuntimeError: no cpuid"),
        (
            logging.DEBUG,
            "AMX permission not requested: AttributeError: module 'torch.cpu' has no "
            "attribute '_is_amx_tile_supported'",
        ),
        (logging.DEBUG, "AMX permission not requested: OSError: arch_prctl failed"),
    ]
    caplog.clear()
    monkeypatch.setattr(torch._C._cpu, "_init_amx", lambda: False)  # the kernel says no
    cpu_amx.request_amx_permission()
    assert _records(caplog, cpu_amx) == [
        (
            logging.WARNING,
            "the kernel refused AMX tile state: vLLM-CPU's AMX kernels may fail",
        )
    ]


def test_vllms_plugin_loader_returns_when_both_plugins_meet_drift(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's own loader runs this package's entry points (they are installed) while vLLM
    and torch have drifted under them: it returns, and the warning shows they ran."""
    factory = _factory()
    import torch
    import vllm.envs
    import vllm.plugins

    renamed = _raising(AttributeError("registry renamed"))
    monkeypatch.setattr(factory.WeightTransferEngineFactory, "register_engine", renamed)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", _raising(RuntimeError("drift")))
    # Once per process: this test's call must run them again. Only this package's plugins:
    # the environment's others (smg's, vLLM's LoRA resolvers) are not this test's to rerun.
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(vllm.envs, "VLLM_PLUGINS", list(OURS), raising=False)
    caplog.set_level(logging.DEBUG, logger=cpu_amx.__name__)
    assert vllm.plugins.load_general_plugins() is None
    assert vllm.plugins.plugins_loaded is True
    warnings = [m for level, m in _records(caplog, file_weights) if level == logging.WARNING]
    assert len(warnings) == 1 and "AttributeError: registry renamed" in warnings[0]
    assert _records(caplog, cpu_amx) == [
        (logging.DEBUG, "AMX permission not requested: RuntimeError: drift")
    ]
    assert not [r for r in caplog.records if r.name == "vllm.plugins" and r.exc_info]


# -- vLLM's own server, in an environment drifted so ------------------------------------------

# Run first in every Python process started with its directory on PYTHONPATH (vLLM's API
# server, engine core and workers): once vLLM's factory module and torch.cpu are imported,
# the registry's method is replaced by one that fails, and torch's AMX check by one that fails
# when this package's plugin asks it.
SITECUSTOMIZE = textwrap.dedent(
    """
    import importlib.abc
    import logging
    import sys


    def _break_factory(module):
        def register_engine(*args, **kwargs):
            raise AttributeError("registry renamed")

        module.WeightTransferEngineFactory.register_engine = staticmethod(register_engine)
        print("drift: vLLM's weight-transfer registry broken", file=sys.stderr, flush=True)


    def _break_amx(module):
        # Failing for this package's plugin only: vLLM's CPU kernels ask torch the same.
        supported = module._is_amx_tile_supported

        def is_amx_tile_supported():
            if sys._getframe(1).f_globals.get("__name__") == "vllm_router.engine.vllm.cpu_amx":
                raise RuntimeError("AMX check drifted")
            return supported()

        module._is_amx_tile_supported = is_amx_tile_supported


    _DRIFT = {
        "vllm.distributed.weight_transfer.factory": _break_factory,
        "torch.cpu": _break_amx,
    }


    class _Drift(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            drift = _DRIFT.get(name)
            if drift is None:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            exec_module = spec.loader.exec_module

            def exec_then_drift(module):
                exec_module(module)
                drift(module)

            spec.loader.exec_module = exec_then_drift
            return spec


    sys.meta_path.insert(0, _Drift())
    # The AMX plugin tells its failure at DEBUG: shown, to prove it ran.
    _amx_log = logging.getLogger("vllm_router.engine.vllm.cpu_amx")
    _amx_log.setLevel(logging.DEBUG)
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    _amx_log.addHandler(_handler)
    """
)


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.read()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllms_server_starts_in_an_environment_where_both_plugins_fail(tmp_path: Path) -> None:
    require_vllm()
    model = tiny_model()
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    # Every plugin of the environment loads in it, as it would in any vLLM server here.
    assert "VLLM_PLUGINS" not in os.environ
    flags: dict[str, object] = {
        "max_model_len": 256,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.1,
    }
    log_name = "vllm-openai-plugin-drift.log"
    started = time.monotonic()
    with vllm_openai_server(
        model, flags, log_name=log_name, environment={"PYTHONPATH": path}
    ) as base:
        waited = time.monotonic() - started
        status, body = _get(base + "/v1/models")
        assert status == 200 and str(model).encode() in body
    log_path = model.parent / log_name
    text = log_path.read_text()
    assert "drift: vLLM's weight-transfer registry broken" in text
    warning = (
        f"{NOT_REGISTERED} (this vLLM's factory is not the one it was built for: "
        "AttributeError: registry renamed); vLLM runs without it"
    )
    assert warning in text, text[-5000:]
    amx = "vllm_router.engine.vllm.cpu_amx DEBUG AMX permission not requested: RuntimeError: "
    assert f"{amx}AMX check drifted" in text, text[-5000:]
    print(f"plugin warnings: {text.count(warning)}; started in {waited:.0f} s")
