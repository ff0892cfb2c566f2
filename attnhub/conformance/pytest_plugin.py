"""The pytest plugin of the conformance kit (entry point ``pytest11``, so an installed attnhub
adds the options to every pytest; ``-p attnhub.conformance.pytest_plugin`` loads it by hand):

    pytest --pyargs attnhub.conformance --backend NAME [--backend NAME2] [--quick]

One test per (backend, grid case), named by feature. A case the backend declines on this
device is skipped with its reasons; a failure shows the kit's verdict. Without ``--backend``
the plugin adds nothing."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnhub conformance")
    group.addoption("--backend", action="append", default=[], metavar="NAME",
                    help="backend (or plugin) to check; repeat for several")
    group.addoption("--quick", action="store_true", help="the smaller CI grid")
    group.addoption("--case-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="fail a case whose call has not returned after this long")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kit_case" not in metafunc.fixturenames:
        return
    from attnhub.cli.check_plugin import selected
    from attnhub.conformance import backend_grid
    from attnhub.core.device import probe
    from attnhub.core.registry import Registry

    names = metafunc.config.getoption("--backend")
    if names:
        import torch

        if not torch.cuda.is_available():  # Triton backends on a CPU run interpreted
            os.environ.setdefault("TRITON_INTERPRET", "1")
    reg = Registry.load()
    params, ids = [], []
    for name in selected(reg, names, all_available=False):
        for i, case in enumerate(backend_grid(reg.get(name), probe(),
                                              metafunc.config.getoption("--quick"),
                                              metafunc.config.getoption("--case-timeout"))):
            params.append((name, case))
            ids.append(f"{name}-{case.feature.replace(' ', '_')}-{i}")
    metafunc.parametrize("kit_case", params, ids=ids)
