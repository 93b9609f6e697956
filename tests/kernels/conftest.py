"""Kernel tests run the Triton kernels under the interpreter on machines without CUDA (set before triton loads)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
