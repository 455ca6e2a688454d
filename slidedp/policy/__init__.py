"""AutoPolicy (method.md section 7): search plans, scoring them with model/ and sim/ (ortools for
the MILP); probe.py alone runs the real executor (torch) to confirm them.
Entry point: auto_plan(hardware, workload, cap_bytes) -> (Plan, PolicyReport)."""

from slidedp.policy.auto import PolicyReport, auto_plan

__all__ = ["PolicyReport", "auto_plan"]
