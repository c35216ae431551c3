"""The allocation advisor: predicts, by discrete-event simulation, the trained samples/s, idle
fractions and realised staleness of splits of devices between generation and training and values
of η, and recommends one (docs/advise.md). `python -m areal_flow.advise --help`."""

from areal_flow.advise.cost_file import load_cost_file
from areal_flow.advise.costs import AdviseError, Costs
from areal_flow.advise.fit import fit_runs
from areal_flow.advise.prediction import Candidate, Prediction
from areal_flow.advise.report import recommend
from areal_flow.advise.simulate import simulate

__all__ = ["AdviseError", "Candidate", "Costs", "Prediction", "fit_runs", "load_cost_file", "recommend", "simulate"]
