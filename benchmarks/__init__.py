"""Benchmarks of trl-dta against dense and packed tree-mask training (the figures: benchmarks/RESULTS.md).

Folders by role, each importing only the ones before it: `baselines/` (the peers DTA is measured against),
`reporting/` (CSV schema, tables, charts), `harness/` (models, isolation, memory, the oracle check), `workloads/`
(the rollout batches), `suites/` (one script per thing measured: `python -m benchmarks.suites.<name>`), `gpu/` (the
GPU check: `bash benchmarks/gpu/check.sh`). Results go to `results/`.
"""
