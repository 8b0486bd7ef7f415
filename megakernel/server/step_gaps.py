"""Engine idle share: how much of the device's time, while requests are in the engine, falls between one step's
work and the next step's launch (a host-side-launched proxy for "the GPU's idle share between decode steps").

Each launch of an engine step (`LLMEngine._launch`: the model forward, sampling and the token copy-back) is
bracketed with two markers on the device's stream: `start` just before the launch begins, `end` right after its
last queued operation. On CUDA the markers are timing events, so their times are the GPU's own: `start` of step t+1
completes either right after `end` of step t (the host queued step t+1 in time) or later, when the host got to it
(the GPU had nothing queued in between). Within a busy stretch (requests in the engine from one step to the next)
the device's time is tiled exactly:

    busy  += end(t) - start(t)           the step's span: its kernels, and any stall inside them
    gap   += start(t+1) - end(t)         nothing of the engine's was queued: the host was late

and the idle share over an interval is gap / (gap + busy). It is a lower bound on the GPU's idle time between
steps: host preparation inside `_launch` before its first kernel counts as busy, and so does idle time inside a
step (the PyTorch prefill's mid-forward reads). On CPU the markers are the host clock (the CPU is the device and
runs each step inside `_launch`). A stretch ends when the engine has no request left (after a step or an abort);
the time until the next request arrives is not counted.

Exported on /metrics as counters `megakernel_engine_step_busy_seconds_total`, `megakernel_engine_step_gap_seconds_
total` and `megakernel_engine_steps_launched_total` (`megakernel bench serve` reads them before and after a run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger("megakernel.server")

BUSY = "megakernel_engine_step_busy_seconds"
GAP = "megakernel_engine_step_gap_seconds"
STEPS = "megakernel_engine_steps_launched"


class _HostMark:
    """A CPU marker: the host clock when it was recorded."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_s(self, later: "_HostMark") -> float:
        return later.t - self.t


class _CudaMark:
    """A CUDA timing event recorded on the current stream of `device`."""

    __slots__ = ("ev",)

    def __init__(self, device) -> None:
        import torch

        self.ev = torch.cuda.Event(enable_timing=True)
        self.ev.record(torch.cuda.current_stream(device))

    def query(self) -> bool:
        return self.ev.query()

    def synchronize(self) -> None:
        self.ev.synchronize()

    def elapsed_s(self, later: "_CudaMark") -> float:
        return self.ev.elapsed_time(later.ev) / 1e3


class StepGapMeter:
    """Busy and gap seconds of an engine's steps (see the module docstring). Markers are recorded and read on the
    engine's thread; `totals()` may be called from any thread."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        device = getattr(engine, "device", None)
        cuda = getattr(device, "type", "cpu") == "cuda"
        self._mark: Callable[[], Any] = (lambda: _CudaMark(device)) if cuda else _HostMark
        self._lock = threading.Lock()
        self._busy = 0.0
        self._gap = 0.0
        self._steps = 0
        self._pending: deque[tuple[Any, Any, Any]] = deque()   # (previous end or None, start, end), unread
        self._prev_end: Any = None                             # end marker of the last launch, within a stretch

    # ---- wrapped engine methods (the engine thread) -----------------------------------------------------------
    def launch(self, fn: Callable, *args, **kwargs):
        start = self._mark()
        try:
            return fn(*args, **kwargs)
        finally:
            end = self._mark()
            self._pending.append((self._prev_end, start, end))
            self._prev_end = end
            self._read(block=False)

    def after(self) -> None:
        """After a step or an abort: if the engine has nothing left, the busy stretch ends here."""
        if not self.engine.has_unfinished_requests():
            self._prev_end = None
            self._read(block=True)

    def _read(self, block: bool) -> None:
        while self._pending:
            prev, start, end = self._pending[0]
            if not end.query():
                if not block:
                    return
                end.synchronize()
            self._pending.popleft()
            busy = start.elapsed_s(end)
            gap = max(0.0, prev.elapsed_s(start)) if prev is not None else 0.0
            with self._lock:
                self._busy += busy
                self._gap += gap
                self._steps += 1

    # ---- readers ------------------------------------------------------------------------------------------------
    def totals(self) -> dict[str, float]:
        with self._lock:
            return {"busy_s": self._busy, "gap_s": self._gap, "steps": float(self._steps)}


def watch_step_gaps(engine: Any, registry=None) -> StepGapMeter | None:
    """Bracket `engine`'s step launches with a StepGapMeter and export its counters to `registry` (a
    prometheus_client CollectorRegistry). Returns None, changing nothing, for an engine without `_launch`."""
    if not all(callable(getattr(engine, name, None)) for name in ("_launch", "step", "abort_request",
                                                                  "has_unfinished_requests")):
        log.debug("engine idle share not measured: %s has no _launch/step", type(engine).__name__)
        return None
    meter = StepGapMeter(engine)
    launch, step, abort = engine._launch, engine.step, engine.abort_request

    def _launch(*args, **kwargs):
        return meter.launch(launch, *args, **kwargs)

    def _step(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        finally:
            meter.after()

    def _abort(*args, **kwargs):
        try:
            return abort(*args, **kwargs)
        finally:
            meter.after()

    engine._launch, engine.step, engine.abort_request = _launch, _step, _abort
    if registry is not None:
        registry.register(_Collector(meter))
    return meter


class _Collector:
    """prometheus_client collector of a StepGapMeter's counters."""

    def __init__(self, meter: StepGapMeter) -> None:
        self.meter = meter

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        t = self.meter.totals()
        yield CounterMetricFamily(BUSY, "Device time of engine steps, launch start to the end of their queued work "
                                  "(while requests were in the engine)", value=t["busy_s"])
        yield CounterMetricFamily(GAP, "Device time between one step's queued work and the next step's launch "
                                  "(while requests were in the engine): the engine idle share is gap/(gap+busy)",
                                  value=t["gap_s"])
        yield CounterMetricFamily(STEPS, "Engine steps launched and timed", value=t["steps"])
