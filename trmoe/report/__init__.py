"""Sweep and run reports: `python -m trmoe.report <run dir | multirun dir ...>`.

One table row per run, paired comparisons against a control arm across seeds, a comparability check
against the reproducible-comparison checklist, and PNG plots when matplotlib is installed (the `report`
extra: `pip install 'trmoe[report]'`).
The Hydra callback in `trmoe.report.callback` writes the same report at the end of a local sweep.
Importing this package is cheap: the callback is instantiated by every Hydra run.
"""
