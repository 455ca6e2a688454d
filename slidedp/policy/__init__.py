"""AutoPolicy (method.md section 7): search plans, scoring them with model/ and sim/ (ortools here
only). Entry point: auto_plan(hardware, workload, cap_bytes) -> (Plan, PolicyReport)."""

from slidedp.policy.auto import PolicyReport, auto_plan

__all__ = ["PolicyReport", "auto_plan"]
