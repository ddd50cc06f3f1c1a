"""The self-contained HTML report."""

from __future__ import annotations

from dlbricks.report.html import build_report, write_report

__all__ = ["build_report", "write_report"]
