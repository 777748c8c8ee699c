"""``kvsieve tune``: search the compositions of parts for the best cache policy at a memory budget.

:mod:`~kvsieve.tune.space` (what a trial may choose), :mod:`~kvsieve.tune.calibration` (the samples it is
scored on, disjoint from any evaluation), :mod:`~kvsieve.tune.study` (the Optuna search), and
:mod:`~kvsieve.tune.report` (the Pareto frontier of every trial against the seed methods and baselines).
"""
