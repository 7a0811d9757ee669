"""Small drivers the notebooks call: connectivity ablations (ablation.py), FCSD recovery runs
(conversion.py) and their plots/tables (plots.py). Everything runs through the library's trainer,
distillation loop, eval sweep and overlap tool; nothing here defines model code."""
