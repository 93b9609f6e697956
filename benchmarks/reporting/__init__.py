"""Results as data: the CSV schema, ratios and markdown tables (`results.py`), the charts drawn from the CSV files
(`plots.py`), and the plotters of recorded training runs (`grpo_runs.py`, `agent_curves.py`) for `RESULTS.md`."""
