"""The timing process of a device: trials run in-process, or in one persistent child process
per device (:func:`_worker_main`), restarted when it dies, hangs or reports a CUDA fault;
:class:`_PacedMeasurer` leaves the device idle for a share of the time."""
from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from typing import Any

import torch

from .compile_pool import _preload_compiler
from .trial import run_trial


# -----------------------------------------------------------------------------------------
# the timing process: in-process, or a persistent child per device
# -----------------------------------------------------------------------------------------
def _worker_main(conn: Any, device: str, sys_path: list[str]) -> None:  # pragma: no cover - child
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)
    from .. import formats, weights  # noqa: F401  (imported before the first trial's clock starts)
    from ..backends import reference  # noqa: F401

    if dev.type == "cuda":
        _preload_compiler()

    conn.send("ready")
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        if req is None:
            return
        conn.send(run_trial(req))


class _Measurer:
    """Runs trials; ``isolate`` puts them in a child process restarted after a fault or hang."""

    def __init__(self, device: torch.device, isolate: bool, timeout_s: float) -> None:
        self.device = device
        self.isolate = isolate
        self.timeout_s = timeout_s
        self.proc: Any = None
        self.conn: Any = None
        self.restarts = 0
        self._starting: Any = None  # (process, pipe) launched and not ready yet

    def _start(self) -> None:
        self._launch()
        self._await_ready()

    def _launch(self) -> None:
        """Spawn the timing process (it starts on its own: imports, CUDA context, compiler)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker_main, args=(child, str(self.device), list(sys.path)), daemon=True)
        p.start()
        child.close()
        self._starting = (p, parent)

    def _await_ready(self) -> None:
        """Wait for the process :meth:`_launch` spawned to say it is ready."""
        p, parent = self._starting
        self._starting = None
        if not parent.poll(max(120.0, self.timeout_s)):
            p.kill()
            raise RuntimeError(f"the timing worker for {self.device} did not start")
        try:
            if parent.recv() != "ready":
                raise RuntimeError("unexpected handshake")
        except EOFError:
            raise RuntimeError(f"the timing worker for {self.device} died while starting (exit code {p.exitcode})") from None
        self.proc, self.conn = p, parent

    def _stop(self) -> None:
        if self._starting is not None:  # launched, never awaited
            p, parent = self._starting
            self._starting = None
            p.kill()
            p.join(10)
            parent.close()
        if self.proc is None:
            return
        try:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
        finally:
            try:
                self.conn.close()
            except OSError:
                pass
            self.proc, self.conn = None, None

    def launch(self) -> None:
        """Begin starting the timing process (isolated trials only) and return: it starts while
        its owner does other setup (the compile workers'); :meth:`start` waits for it."""
        if self.isolate and self.proc is None and self._starting is None:
            self._launch()

    def start(self) -> None:
        """Start the timing process now (isolated trials only), so that no job's time pays for it."""
        if self.isolate and self.proc is None:
            if self._starting is None:
                self._launch()
            self._await_ready()

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        if not self.isolate:
            return run_trial(req)
        start_s = 0.0
        if self.proc is None or not self.proc.is_alive():
            self._stop()
            t0 = time.perf_counter()
            self._start()
            start_s = time.perf_counter() - t0  # a one-off: the trial reports it as setup
        try:
            self.conn.send(req)
            if not self.conn.poll(self.timeout_s):
                self._stop()
                self.restarts += 1
                return {"outcome": "timeout", "error": f"no answer within {self.timeout_s:.0f} s; worker restarted"}
            res = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.exitcode if self.proc is not None else None
            if self.proc is not None:
                self.proc.join(5)
                code = self.proc.exitcode
            self._stop()
            self.restarts += 1
            return {"outcome": "runtime_fault", "error": f"the timing worker process died (exit code {code}); restarted"}
        if res.get("fatal"):
            self._stop()
            self.restarts += 1
        if start_s:
            res["setup_s"] = res.get("setup_s", 0.0) + start_s
        return res

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (OSError, BrokenPipeError):
                pass
        self._stop()


#: the smallest share of the wall time a paced measurer may measure: below it a job's trials
#: would be spread over hours
MIN_DUTY = 0.01


class _PacedMeasurer(_Measurer):
    """A :class:`_Measurer` that measures at most ``duty`` of the wall time (``MIN_DUTY`` <= duty
    <= 1): after each trial it rests as long as the trial took times ``(1 - duty) / duty``,
    leaving the device to the workload that shares it. Setting ``wake`` (the workload has gone)
    ends the rests: what is left runs at full speed."""

    def __init__(self, device: torch.device, isolate: bool, timeout_s: float, duty: float = 1.0) -> None:
        if not MIN_DUTY <= duty <= 1:
            raise ValueError(f"duty must be in [{MIN_DUTY}, 1], got {duty}")
        super().__init__(device, isolate, timeout_s)
        self.duty = duty
        self.wake = threading.Event()

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        res = super().run(req)
        if self.duty < 1:
            self.wake.wait((time.perf_counter() - t0) * (1 - self.duty) / self.duty)
        return res
