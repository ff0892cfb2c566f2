"""The kit's table: one row per declared feature with its worst outcome."""

from __future__ import annotations

from ..cli._common import table
from .kit import KitReport


def format_report(report: KitReport, verbose: bool = False) -> str:
    rows = []
    for f in report.features():
        err = "" if f["error"] is None else f"{f['error']:.2e}"
        allowed = "" if f["allowed"] is None else f"{f['allowed']:.2e}"
        rows.append((f["feature"], f["status"].upper() if f["status"] in ("fail", "crash")
                     else f["status"], err, allowed, f["detail"][:110]))
    ran = any(r.status != "skip" for r in report.results)
    verdict = ("FAIL" if not report.ok else "PASS" if ran
               else "NOTHING RAN (every case skipped or deselected)")
    head = f"{report.backend} (plugin {report.plugin}) on {report.device}: {verdict}"
    lines = [head, table(rows, ("feature", "result", "worst error", "allowed", "detail"))]
    for f in report.features():  # the budget verdict in full: metric, error, budget, case
        # (the gradient budget's too: which of dq, dk, dv broke it, and the fix, came after
        # the table's 110 characters)
        if f["feature"].startswith(("error budget", "gradient budget")):
            lines.append(f"{f['feature']}: {f['status'].upper()}: {f['detail']} "
                         f"[case: {f['case']}]")
    if verbose:
        for r in report.results:
            lines.append(f"  {r.status:5} {r.seconds * 1e3:7.1f} ms  {r.case.describe()}"
                         + (f"  -- {r.detail}" if r.detail else ""))
    return "\n".join(lines)
