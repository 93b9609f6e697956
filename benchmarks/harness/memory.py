"""Peak memory of a benchmark run: the CUDA allocator's peak on GPU, the resident set's high-water mark on CPU.

Each run measures in a fresh process (`isolation.Worker`: a child that has imported everything but run nothing), as
the peak above the memory after the model and optimizer state were built: on CPU `/proc/self/status` VmHWM after a
reset through `/proc/self/clear_refs`, on GPU `torch.cuda.max_memory_allocated` above the allocation at that point.
"""

from __future__ import annotations

import gc

import torch


class PeakMemory:
    """Peak memory above a baseline, in MiB: CUDA allocator peak on GPU, resident-set high-water mark on CPU.

    Call `reset()` at the baseline; `peak_mb()` afterwards returns the peak since then minus the baseline.
    """

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.base = 0

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} missing from /proc/self/status")

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self.base = self._status("VmRSS")

    def peak_mb(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        return (self._status("VmHWM") - self.base) / 2**20


def trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that the next peak is measured from a clean baseline."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

