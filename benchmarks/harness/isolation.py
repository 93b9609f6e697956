"""Process isolation of the benchmark runs: an object living in a child process, driven by method calls.

Each run (one method on one workload) gets its own process, so that its peak memory is its own (`memory.PeakMemory`),
and several stay alive side by side so that their steps can be interleaved. [`start_method`] says how a child starts
(`fork`, a fork server, `spawn`); [`run_isolated`] and [`start_isolated`] run one function in a child.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable, Sequence

import torch


def _serve(conn, factory, args, kwargs):
    """Child side of `Worker`: build the object, then answer method calls until told to stop."""
    try:
        obj = factory(*args, **kwargs)
        conn.send(("ok", None))
    except BaseException as e:  # report any failure to the parent, with its traceback
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        conn.close()
        return
    while True:
        try:
            name, call_args = conn.recv()
        except EOFError:
            break
        if name is None:
            break
        try:
            conn.send(("ok", getattr(obj, name)(*call_args)))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    conn.close()


START_METHODS = ("fork", "forkserver", "spawn")


def start_method() -> str:
    """How `Worker` starts its child: `$DTA_BENCH_START_METHOD` if set, else `fork` with a CPU-only torch build and
    `forkserver` with a CUDA build.

    A forked child inherits the imported modules (no import time per run) but cannot use CUDA once the parent has
    touched it: `torch.cuda.is_available()` alone makes later forks fail with "Cannot re-initialize CUDA in forked
    subprocess". A fork server is a fresh interpreter (started by exec, so the parent's CUDA state does not reach it)
    that imports the preloaded modules once and forks every child from itself: CUDA-safe, and no import per run.
    `spawn` imports everything per child.
    """
    method = os.environ.get("DTA_BENCH_START_METHOD")
    if method is None:
        return "fork" if torch.version.cuda is None else "forkserver"
    if method not in START_METHODS:
        raise ValueError(f"DTA_BENCH_START_METHOD must be one of {START_METHODS}, got {method!r}")
    return method


def _context(method: str, preload: Sequence[str]):
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":  # the server imports these once; its children fork from it (the first call starts it)
        ctx.set_forkserver_preload(["torch", "transformers", __name__, *(m for m in preload if m != "__main__")])
    return ctx


class Worker:
    """An object living in a child process, driven by method calls from the parent.

    Each benchmark run (one method on one workload) gets its own process, so that its peak memory is its own, and
    several of them can stay alive side by side so that their steps can be interleaved (round-robin), which spreads
    interference from other processes on a shared machine evenly over the methods. The child starts as
    [`start_method`] says (or `start`): with `fork` the parent must not have run any torch computation before
    (OpenMP thread pools do not survive a fork) nor touched CUDA; `forkserver` and `spawn` need the factory and its
    arguments picklable (a fork server imports the factory's module and the `preload` modules once). With
    `isolate=False` the object lives in-process (debugging).

    Raises:
        `RuntimeError`: with the child's traceback when construction or a call failed, or the child died or timed
            out.
    """

    def __init__(self, factory: Callable, *args, isolate: bool = True, timeout: float | None = None,
                 start: str | None = None, preload: Sequence[str] = (), **kwargs):
        self.isolate, self.timeout, self.proc, self.obj = isolate, timeout, None, None
        if not isolate:
            self.obj = factory(*args, **kwargs)
            return
        ctx = _context(start or start_method(), (factory.__module__, *preload))
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, factory, args, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self._answer()

    def _answer(self):
        if not self.conn.poll(self.timeout):
            self.close(wait=0)  # busy past its time: killed at once (a deadline is near)
            raise RuntimeError(f"benchmark worker timed out after {self.timeout} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(1)
            code = self.proc.exitcode
            self.close()
            raise RuntimeError(f"benchmark worker died (exit code {code}; -9 is usually out of memory)") from None
        if status == "error":
            self.close()
            raise RuntimeError(value)
        return value

    def submit(self, name: str, *args) -> None:
        """Start the call `name(*args)` without waiting; [`result`] returns its answer (workers run side by side)."""
        if not self.isolate:
            self._pending = getattr(self.obj, name)(*args)
            return
        if self.proc is None:
            raise RuntimeError("benchmark worker is closed")
        try:
            self.conn.send((name, args))
        except OSError:  # the child is gone (killed: often the kernel's OOM killer)
            self.proc.join(1)
            code = self.proc.exitcode
            self.close(wait=0)
            raise RuntimeError(f"benchmark worker died (exit code {code}; -9 is usually out of memory)") from None

    def result(self):
        """The answer of the call [`submit`] started (raises as [`call`] does)."""
        return self._pending if not self.isolate else self._answer()

    def call(self, name: str, *args):
        self.submit(name, *args)
        return self.result()

    def close(self, wait: float = 10) -> None:
        """Stop the child: ask it to end, and kill it if it has not within `wait` seconds."""
        if self.proc is None:
            self.obj = None
            return
        try:
            self.conn.send((None, ()))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(wait)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        self.proc = None


def start_isolated(fn: Callable, *args, isolate: bool = True, timeout: float | None = None, **kwargs) -> Worker:
    """Start `fn(*args, **kwargs)` in a child process (see [`Worker`]); `.result()` waits for its picklable result,
    then `.close()` the worker. Several started at once run side by side."""
    worker = Worker(_Call, fn, args, kwargs, isolate=isolate, timeout=timeout, preload=(fn.__module__,))
    worker.submit("run")
    return worker


def run_isolated(fn: Callable, *args, isolate: bool = True, timeout: float | None = None, **kwargs):
    """Run `fn(*args, **kwargs)` in a child process (see [`Worker`]) and return its picklable result."""
    worker = start_isolated(fn, *args, isolate=isolate, timeout=timeout, **kwargs)
    try:
        return worker.result()
    finally:
        worker.close()


class _Call:
    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def run(self):
        return self.fn(*self.args, **self.kwargs)

