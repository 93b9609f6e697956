"""Two-part attention kernels (`trl_dta/kernels/`) against a float64 reference, per backend, dtype and mask kind.

Not named `tests/kernels`: pytest puts `tests/` on `sys.path`, where a package `kernels` would shadow Hugging Face's
`kernels` package, which transformers (5.25 and later) depends on and imports when it loads.
"""
