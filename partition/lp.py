"""A solver-neutral mixed-integer linear model, solved by gurobipy or HiGHS.

The partition MIP is built once as a :class:`LinearModel` (variables with bounds and types,
linear rows, a linear objective) and handed to either backend, so both solve the *same*
formulation. Rows with a single variable are folded into that variable's bounds before solving,
which is also how the size is counted against the free gurobipy licence (2000 variables, 2000
linear constraints).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal

from mobius.errors import NotAvailableError

log = logging.getLogger(__name__)

SolverName = Literal["auto", "gurobi", "highs"]
GUROBI_SIZE_LIMIT = 2000  # variables and linear constraints of the size-limited licence
GUROBI_SIZE_ERRNO = 10010  # GRB_ERROR_SIZE_LIMIT_EXCEEDED: "Model too large for size-limited license"


class Lin:
    """A linear expression ``sum(coef * var) + const`` over model variables (by index)."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict[int, float] | None = None, const: float = 0.0):
        self.terms = terms or {}
        self.const = float(const)

    def __add__(self, other: "Lin | float") -> "Lin":
        if not isinstance(other, Lin):
            return Lin(dict(self.terms), self.const + other)
        terms = dict(self.terms)
        for k, v in other.terms.items():
            terms[k] = terms.get(k, 0.0) + v
        return Lin(terms, self.const + other.const)

    __radd__ = __add__

    def __neg__(self) -> "Lin":
        return Lin({k: -v for k, v in self.terms.items()}, -self.const)

    def __sub__(self, other: "Lin | float") -> "Lin":
        if not isinstance(other, Lin):
            return Lin(dict(self.terms), self.const - other)
        terms = dict(self.terms)
        for k, v in other.terms.items():
            terms[k] = terms.get(k, 0.0) - v
        return Lin(terms, self.const - other.const)

    def __rsub__(self, other: float) -> "Lin":
        return (-self) + other

    def __mul__(self, c: float) -> "Lin":
        return Lin({k: v * c for k, v in self.terms.items()}, self.const * c)

    __rmul__ = __mul__

    def __truediv__(self, c: float) -> "Lin":
        return self * (1.0 / c)

    def value(self, x: list[float]) -> float:
        return self.const + sum(v * x[k] for k, v in self.terms.items())


@dataclass
class LinearModel:
    """Variables, rows ``lo <= expr <= hi`` and a linear objective to minimise."""

    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    objective: Lin = field(default_factory=Lin)
    infeasible: bool = False  # a row without variables was violated

    def var(self, name: str, lb: float = 0.0, ub: float = math.inf, integer: bool = False) -> Lin:
        """Add a variable and return it as an expression."""
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.names.append(name)
        return Lin({len(self.lb) - 1: 1.0})

    def add(self, lhs: Lin | float, sense: str, rhs: Lin | float) -> None:
        """Add ``lhs (<=|>=|==) rhs``; a row with one variable becomes a bound."""
        expr = (lhs if isinstance(lhs, Lin) else Lin(const=lhs)) - rhs
        terms = {k: v for k, v in expr.terms.items() if v != 0.0}
        lo, hi = {"<=": (-math.inf, -expr.const), ">=": (-expr.const, math.inf),
                  "==": (-expr.const, -expr.const)}[sense]
        if len(terms) == 1:
            self._bound(*next(iter(terms.items())), lo, hi)
        elif terms:
            self.rows.append((terms, lo, hi))
        elif lo > 1e-9 or hi < -1e-9:
            self.infeasible = True

    def _bound(self, k: int, coef: float, lo: float, hi: float) -> None:
        a, b = (lo / coef, hi / coef) if coef > 0 else (hi / coef, lo / coef)
        if self.integer[k]:
            a = math.ceil(a - 1e-9) if math.isfinite(a) else a
            b = math.floor(b + 1e-9) if math.isfinite(b) else b
        self.lb[k], self.ub[k] = max(self.lb[k], a), min(self.ub[k], b)

    @property
    def num_vars(self) -> int:
        return len(self.lb)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def fits_free_gurobi(self) -> bool:
        return self.num_vars <= GUROBI_SIZE_LIMIT and self.num_rows <= GUROBI_SIZE_LIMIT

    def trivially_infeasible(self) -> bool:
        """True when a constant row is violated or a variable's bounds cross."""
        return self.infeasible or any(lo > hi + 1e-9 for lo, hi in zip(self.lb, self.ub))


@dataclass
class SolveResult:
    """What a backend returned."""

    status: str  # optimal | time_limit | infeasible | cutoff
    objective: float  # math.inf without a solution
    bound: float  # best lower bound proven
    values: list[float]
    solver: str
    solve_s: float

    @property
    def has_solution(self) -> bool:
        return bool(self.values) and math.isfinite(self.objective)

    @property
    def gap(self) -> float:
        if not self.has_solution:
            return math.inf
        return max(0.0, (self.objective - self.bound) / max(abs(self.objective), 1e-12))


def solve(model: LinearModel, solver: SolverName = "auto", time_limit_s: float = 30.0,
          cutoff: float | None = None, rel_gap: float = 1e-4) -> SolveResult:
    """Solve ``model``; ``auto`` tries gurobipy and falls back to HiGHS when it is missing or refuses."""
    if solver in ("auto", "gurobi"):
        try:
            return _solve_gurobi(model, time_limit_s, cutoff, rel_gap)
        except NotAvailableError as e:
            if solver == "gurobi":
                raise
            log.debug("gurobi unavailable (%s); solving with HiGHS", e)
    return _solve_highs(model, time_limit_s, cutoff, rel_gap)


def _solve_gurobi(model: LinearModel, time_limit_s: float, cutoff: float | None, rel_gap: float) -> SolveResult:
    try:
        import gurobipy as gp
    except ImportError:
        raise NotAvailableError("gurobipy is not installed (pip install gurobipy)") from None
    t0 = time.perf_counter()
    try:
        m = gp.Model(env=_gurobi_env(gp))
        xs = m.addVars(model.num_vars, lb=model.lb, ub=model.ub,
                       vtype=[gp.GRB.INTEGER if i else gp.GRB.CONTINUOUS for i in model.integer])
        for terms, lo, hi in model.rows:
            expr = gp.LinExpr(list(terms.values()), [xs[k] for k in terms])
            if lo == hi:
                m.addLConstr(expr, gp.GRB.EQUAL, lo)
            else:
                if hi < math.inf:
                    m.addLConstr(expr, gp.GRB.LESS_EQUAL, hi)
                if lo > -math.inf:
                    m.addLConstr(expr, gp.GRB.GREATER_EQUAL, lo)
        obj = model.objective
        m.setObjective(gp.LinExpr(list(obj.terms.values()), [xs[k] for k in obj.terms]) + obj.const, gp.GRB.MINIMIZE)
        m.Params.TimeLimit = max(time_limit_s, 0.01)
        m.Params.MIPGap = rel_gap
        m.Params.Threads = os.cpu_count() or 1
        if cutoff is not None:
            m.Params.Cutoff = cutoff
        m.optimize()
    except gp.GurobiError as e:
        if getattr(e, "errno", None) == GUROBI_SIZE_ERRNO or "size-limited" in str(e):
            raise NotAvailableError(f"gurobipy refused the model ({model.num_vars} variables, {model.num_rows} "
                                    f"constraints): {e}") from None
        raise NotAvailableError(f"gurobipy failed: {e}") from None
    try:
        return _gurobi_result(m, gp, [xs[k] for k in range(model.num_vars)], time.perf_counter() - t0)
    finally:
        m.dispose()


_ENVS: dict[int, object] = {}  # process id -> its silent gurobipy environment (one per model costs milliseconds)


def _gurobi_env(gp):
    """This process's gurobipy environment (not one a parent process forked with)."""
    env = _ENVS.get(os.getpid())
    if env is None:
        env = gp.Env(empty=True)
        env.setParam("OutputFlag", 0)
        env.start()
        _ENVS[os.getpid()] = env
    return env


def _gurobi_result(m, gp, xs: list, solve_s: float) -> SolveResult:
    status = {gp.GRB.OPTIMAL: "optimal", gp.GRB.TIME_LIMIT: "time_limit", gp.GRB.INFEASIBLE: "infeasible",
              gp.GRB.CUTOFF: "cutoff", gp.GRB.INF_OR_UNBD: "infeasible"}.get(m.Status, f"status {m.Status}")
    if m.SolCount > 0:
        values = [v.X for v in xs]
        return SolveResult(status, m.ObjVal, m.ObjBound, values, "gurobi", solve_s)
    bound = m.ObjBound if status in ("time_limit",) else math.inf
    return SolveResult(status, math.inf, bound, [], "gurobi", solve_s)


def _solve_highs(model: LinearModel, time_limit_s: float, cutoff: float | None, rel_gap: float) -> SolveResult:
    try:
        import highspy
    except ImportError:
        raise NotAvailableError("neither gurobipy nor highspy can solve the partition MIP (pip install highspy)"
                                ) from None
    t0 = time.perf_counter()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", max(float(time_limit_s), 0.01))
    h.setOptionValue("mip_rel_gap", rel_gap)
    if cutoff is not None:
        h.setOptionValue("objective_bound", float(cutoff))
    h.passModel(_highs_lp(highspy, model))
    h.run()
    return _highs_result(h, highspy, model, time.perf_counter() - t0)


def _highs_lp(highspy, model: LinearModel):
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_vars, model.num_rows
    inf = highspy.kHighsInf
    lp.col_cost_ = [model.objective.terms.get(k, 0.0) for k in range(model.num_vars)]
    lp.offset_ = model.objective.const
    lp.col_lower_ = [max(v, -inf) for v in model.lb]
    lp.col_upper_ = [min(v, inf) for v in model.ub]
    lp.row_lower_ = [max(lo, -inf) for _, lo, _ in model.rows]
    lp.row_upper_ = [min(hi, inf) for _, _, hi in model.rows]
    starts, index, value = [0], [], []
    for terms, _, _ in model.rows:
        index.extend(terms.keys())
        value.extend(terms.values())
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = model.num_vars, model.num_rows
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = starts, index, value
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in model.integer]
    return lp


def _highs_result(h, highspy, model: LinearModel, solve_s: float) -> SolveResult:
    st = h.getModelStatus()
    ms = highspy.HighsModelStatus
    status = {ms.kOptimal: "optimal", ms.kTimeLimit: "time_limit", ms.kInfeasible: "infeasible",
              ms.kObjectiveBound: "cutoff", ms.kUnboundedOrInfeasible: "infeasible"}.get(st, str(st))
    info = h.getInfo()
    sol = h.getSolution()
    values = list(sol.col_value) if sol.value_valid else []
    if values and status in ("optimal", "time_limit"):
        bound = info.mip_dual_bound if any(model.integer) else info.objective_function_value
        return SolveResult(status, info.objective_function_value, bound, values, "highs", solve_s)
    bound = info.mip_dual_bound if status == "time_limit" else math.inf
    return SolveResult(status, math.inf, bound, [], "highs", solve_s)
