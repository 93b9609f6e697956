"""The benchmark scripts, one per thing measured (`python -m benchmarks.suites.<name>`): `run` (every workload x every
method), `bench_engine`, `bench_trainer`, `bench_attention`, `bench_balance`, `bench_hybrid`, `bench_rollouts`,
`bench_side_by_side`, `bench_sharded`, `bench_zero3`, `bench_tree_rollouts`, `bench_tree_memory`, `bench_vllm`; the
methods they compare (`providers.py`), the grid runner (`grid.py`) and the trainer steps (`trainer_steps.py`,
`agent_steps.py`) they share."""
