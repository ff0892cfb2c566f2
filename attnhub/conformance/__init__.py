"""The plugin conformance kit: does a backend do what its ``Capabilities`` declare?

    attnhub check-plugin NAME [--quick] [--json]         # a table: feature -> pass/fail/crash
    pytest --pyargs attnhub.conformance --backend NAME   # the same grid as pytest cases

From Python: ``run_kit(backend, device)`` returns a :class:`KitReport`. The grid comes from
the declaration alone (:func:`grid`), so claiming a feature commits the backend to being
tested on it; docs/plugins.md describes every check.
"""

from __future__ import annotations

from .cases import Case, grid
from .kit import CaseResult, KitReport, backend_grid, run_case, run_kit
from .report import format_report

__all__ = ["Case", "CaseResult", "KitReport", "backend_grid", "format_report", "grid", "run_case",
           "run_kit"]
