"""The check every engine makes of the plan it is given, before anything else: that the plan was made for the
run's configuration (a plan kept in ``plan.json`` or handed over by torchrun may be another run's)."""

from __future__ import annotations

from mobius.config import TrainSection
from mobius.errors import MobiusError
from partition.request import update_name


def check_plan(what: str, delayed: bool, states: str, train: TrainSection) -> None:
    """Stop where ``what`` (a plan) was made for another update rule (``delayed``) or other optimizer states
    (``states``) than the run's ``train``: an engine runs the rule and keeps the moments its plan carries, and its
    stores are sized by them, so a plan made for another configuration is planned again, not run."""
    if delayed != train.delayed:
        raise _stale(what, "train.update", update_name(delayed), train.update)
    if states != train.optimizer_states:
        raise _stale(what, "train.optimizer_states", states, train.optimizer_states)


def _stale(what: str, key: str, planned: str, runs: str) -> MobiusError:
    return MobiusError(f"{what} was made for {key}={planned}, but the run has {key}={runs}; plan again for this "
                       f"configuration")
