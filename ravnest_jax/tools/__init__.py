"""Tools around a run: the round planner (``ravnest-jax plan``) and the plots of a run
(``ravnest-jax report``)."""

from ._round_plan import CALIBRATION, Calibration, PlanRow, RoundPlan, calibrate, plan_rounds, validate

__all__ = ["CALIBRATION", "Calibration", "PlanRow", "RoundPlan", "calibrate", "plan_rounds", "validate"]
