"""Benchmarks of trl-dta against dense and packed tree-mask training (see benchmarks/RESULTS.md)."""
