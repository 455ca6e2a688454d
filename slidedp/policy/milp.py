"""How many decoder layers get each activation policy: the MILP of method.md section 7, step 5.

Sets
  J            candidate activation policies (spec/segments.py names), j in J
Data
  L            decoder layers
  tau_j        seconds per step one layer with policy j costs (marginal cost, policy/activations.py)
  m_j          GPU bytes one layer with policy j retains until its backward ((1 - r) x tokens per
               GPU step x retained bytes per token)
  p_j          peak transient GPU bytes of one micro-batch's recompute + backward under policy j
  h_j          GPU reload-buffer bytes under policy j (reload_ahead_layers x r x tokens x retained)
  B            GPU bytes available to activations: the cap minus every other term of
               model/memory.py gpu_footprint (window, resident units, gradient buffers, loss,
               runtime)
Variables
  n_j in Z, 0 <= n_j <= L     layers with policy j
  y_j in {0, 1}               policy j is used (y_j >= [n_j > 0])
  P >= 0, H >= 0              the max_j p_j and max_j h_j over the used policies
Objective
  minimize  sum_j tau_j n_j
Constraints
  (1) sum_j n_j = L                          every layer has one policy
  (2) n_j <= L y_j                 for all j  a used policy is flagged
  (3) P >= p_j y_j                 for all j  linearizes max_j p_j over used policies
  (4) H >= h_j y_j                 for all j  linearizes max_j h_j over used policies
  (5) sum_j m_j n_j + P + H <= B             the activation memory fits
Minimizing never pushes P, H above the maxima, so (3)-(5) are exact. Ties (equal tau, common when
the step is host-bound) are broken towards less memory by a secondary term eps x sum_j m_j n_j / B
with eps far below any tau difference that matters (TIE_EPS_S). Solved with SCIP through
pywraplp under a time limit and a fixed seed; brute_force() enumerates every count vector for the
tests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

TIME_LIMIT_S = 10.0
SEED = 0
TIE_EPS_S = 1e-9  # seconds: the whole memory tie-break is worth at most this much


@dataclass(frozen=True)
class PolicyData:
    """One column of the MILP: a policy's name, marginal cost and memory terms."""

    name: str
    tau_s: float
    retained_bytes: float  # m_j
    transient_bytes: float  # p_j
    reload_bytes: float  # h_j


def memory_bytes(data: list[PolicyData], counts: list[int]) -> float:
    """Left side of constraint (5) for a count vector."""
    used = [d for d, n in zip(data, counts, strict=True) if n > 0]
    return (
        sum(d.retained_bytes * n for d, n in zip(data, counts, strict=True))
        + max((d.transient_bytes for d in used), default=0.0)
        + max((d.reload_bytes for d in used), default=0.0)
    )


def step_cost_s(data: list[PolicyData], counts: list[int]) -> float:
    """The objective sum_j tau_j n_j."""
    return sum(d.tau_s * n for d, n in zip(data, counts, strict=True))


def solve(
    data: list[PolicyData], n_layers: int, budget_bytes: float, time_limit_s: float = TIME_LIMIT_S
) -> list[int] | None:
    """Optimal counts n_j (in the order of `data`), or None when no count vector fits B.
    OR-Tools is imported here, so the commands that never solve (profile, train, validate) run
    without it."""
    from ortools.linear_solver import pywraplp

    s = pywraplp.Solver.CreateSolver("SCIP")
    s.SetTimeLimit(int(time_limit_s * 1000))
    s.SetSolverSpecificParametersAsString(f"randomization/randomseedshift = {SEED}\n")
    L, B = n_layers, budget_bytes
    n = [s.IntVar(0, L, f"n_{d.name}") for d in data]
    y = [s.BoolVar(f"y_{d.name}") for d in data]
    p_max, h_max = s.NumVar(0, s.infinity(), "P"), s.NumVar(0, s.infinity(), "H")
    s.Add(sum(n) == L)  # (1)
    for j, d in enumerate(data):
        s.Add(n[j] <= L * y[j])  # (2)
        s.Add(p_max >= d.transient_bytes * y[j])  # (3)
        s.Add(h_max >= d.reload_bytes * y[j])  # (4)
    s.Add(sum(d.retained_bytes * n[j] for j, d in enumerate(data)) + p_max + h_max <= B)  # (5)
    scale = TIE_EPS_S / (L * max(B, 1.0))  # tie-break: fewer bytes, worth <= TIE_EPS_S in total
    s.Minimize(sum((d.tau_s + scale * d.retained_bytes) * n[j] for j, d in enumerate(data)))
    status = s.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None
    return [round(v.solution_value()) for v in n]


def brute_force(data: list[PolicyData], n_layers: int, budget_bytes: float) -> float | None:
    """The optimal objective by enumerating every count vector with sum L (tests; small L, J)."""
    best = None
    for counts in itertools.product(range(n_layers + 1), repeat=len(data)):
        if sum(counts) != n_layers or memory_bytes(data, list(counts)) > budget_bytes:
            continue
        cost = step_cost_s(data, list(counts))
        best = cost if best is None else min(best, cost)
    return best
