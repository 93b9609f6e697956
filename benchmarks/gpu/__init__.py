"""The GPU check (`bash benchmarks/gpu/check.sh`, `--dry-run` on a CPU): the wheels the GPU machine lacks (`wheels.sh`,
`requirements.txt`, `image.txt`), the environment and correctness steps (`check.py`), the measuring steps (`bench.py`)
of the plan (`plan.py`), the summary and completeness check (`summary.py`), and the Triton variants compiled offline
(`triton_variants.py`)."""
