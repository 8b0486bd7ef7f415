"""AsyncEngine: the synchronous LLMEngine driven by one background thread, fed from asyncio.

The engine thread owns the engine: it takes new requests and aborts from a lock-protected inbox between steps
(so requests join and leave the running batch at step boundaries), runs `step()`, and hands each request's
cumulative snapshot to that request's asyncio queue with `loop.call_soon_threadsafe`. It never waits on the event
loop, so a slow client can only lag its own stream (consumers keep just the newest snapshot) and never stalls
the batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from megakernel.engine.outputs import RequestOutput
from megakernel.engine.sampling_params import SamplingParams
from megakernel.errors import RequestError

log = logging.getLogger("megakernel.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; the server cannot generate any more."""


class RequestFailed(RuntimeError):
    """The engine could not finish this request (it was dropped); the message says why."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None
    num_tokens: int = 0
    last: RequestOutput | None = None


@dataclass
class EngineSnapshot:
    """Scheduler and cache figures, refreshed by the engine thread (read by /metrics without locking)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    num_requests_in_engine: int = 0
    extra: dict = field(default_factory=dict)


class AsyncEngine:
    def __init__(self, engine, metrics=None, stats_interval: float = 0.25, log_interval: float = 10.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stats_interval = stats_interval
        self.log_interval = log_interval         # seconds between throughput/queue log lines (0: none)
        self._log_window = _LogWindow(time.monotonic())
        self._cv = threading.Condition()
        self._adds: deque = deque()
        self._aborts: deque[str] = deque()
        self._sinks: dict[str, _Sink] = {}      # engine-thread only
        self._stop = False
        self._error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self._last_stats = 0.0
        self._thread = threading.Thread(target=self._run, name="megakernel-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._refresh_stats()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop after the current step: every open request ends with EngineDeadError("the server is shutting
        down"), so open streams get an error event and [DONE] instead of being cut."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive() and timeout > 0:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- the asyncio side ------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative snapshots of the request until it finishes; abort it if the consumer stops early."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sink = _Sink(loop, queue, time.monotonic(), len(prompt_token_ids))
        with self._cv:
            self._adds.append((request_id, list(prompt_token_ids), params, prompt, sink))
            self._cv.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                # snapshots are cumulative: only the newest matters (nothing follows a final one or an error)
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    item = queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    # ---- the engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._adds or self._aborts or eng.has_unfinished_requests()):
                        self._refresh_stats()
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        break
                    adds, self._adds = self._adds, deque()
                    aborts, self._aborts = self._aborts, deque()
                for rid in aborts:
                    self._abort_now(rid)
                for rid, ids, params, prompt, sink in adds:
                    try:
                        eng.add_request(rid, ids, params, prompt=prompt)
                    except Exception as e:  # RequestError mostly: validated earlier, but never kill the loop
                        self._deliver(sink, e if isinstance(e, RequestError) else RequestFailed(str(e)))
                        continue
                    self._sinks[rid] = sink
                    self._log_window.prompt_tokens += len(ids)
                if eng.has_unfinished_requests():
                    self._step()
                now = time.monotonic()
                if now - self._last_stats >= self.stats_interval:
                    self._refresh_stats()
                if self.log_interval and now - self._log_window.start >= self.log_interval:
                    self._log_throughput(now)
        except BaseException as e:  # noqa: BLE001 - report and fail every open request
            log.exception("the engine thread died")
            self._error = e
        finally:
            err = EngineDeadError(f"the engine stopped ({self._error!r})" if self._error else "the server is "
                                  "shutting down")
            for rid, sink in list(self._sinks.items()):
                self._deliver(sink, err)
            self._sinks.clear()
            with self._cv:
                for item in self._adds:
                    self._deliver(item[4], err)
                self._adds.clear()

    def _abort_now(self, rid: str) -> None:
        self.engine.abort_request(rid)
        sink = self._sinks.pop(rid, None)
        if sink is not None and self.metrics is not None:
            self.metrics.request_finished("abort", sink, None)

    def _step(self) -> None:
        eng = self.engine
        t0 = time.monotonic()
        try:
            outputs = eng.step()
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving (a broken engine fails again)
            log.exception("engine step failed; failing the %d requests in flight", len(self._sinks))
            self._fail_all(RequestFailed(f"the engine failed: {type(e).__name__}: {e}", status=500))
            return
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.step(now - t0)
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            n = sum(len(o.token_ids) for o in out.outputs)
            new = n - sink.num_tokens
            if self.metrics is not None and new > 0:
                if sink.last_token_time is None:
                    self.metrics.first_token(now - sink.arrival)
                else:
                    self.metrics.inter_token(now - sink.last_token_time, new)
            if new > 0:
                sink.last_token_time = now
                self._log_window.generation_tokens += new
            sink.num_tokens = n
            sink.last = out
            error = getattr(out, "error", None)       # the engine failed the request (e.g. a hung decode step)
            self._deliver(sink, RequestFailed(f"the engine failed this request: {error}", status=500)
                          if out.finished and error else out)
            if out.finished:
                del self._sinks[out.request_id]
                if self.metrics is not None:
                    self.metrics.request_finished("error" if error else _finish_label(out), sink, out)

    def _fail_all(self, err: BaseException) -> None:
        for rid in list(getattr(self.engine, "requests", {}) or {}):
            self.engine.abort_request(rid)
        for rid, sink in list(self._sinks.items()):
            self.engine.abort_request(rid)
            self._deliver(sink, err)
            if self.metrics is not None:
                self.metrics.request_finished("error", sink, None)
        self._sinks.clear()

    @staticmethod
    def _deliver(sink: _Sink, item) -> None:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:   # the consumer's loop is closed
            pass

    def _log_throughput(self, now: float) -> None:
        """One line of throughput and queue figures per log_interval, while there is anything to report."""
        w, s = self._log_window, self.snapshot
        dt = max(1e-9, now - w.start)
        if w.prompt_tokens or w.generation_tokens or s.num_running or s.num_waiting:
            log.info("prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, prefix "
                     "cache hits %.1f%%", w.prompt_tokens / dt, w.generation_tokens / dt, s.num_running,
                     s.num_waiting, 100 * s.kv_usage, 100 * s.prefix_cache_hit_rate)
        self._log_window = _LogWindow(now)

    def _refresh_stats(self) -> None:
        eng = self.engine
        self._last_stats = time.monotonic()
        try:
            st = eng.stats()
            s = self.snapshot
            s.num_running = int(st.get("num_running", 0))
            s.num_waiting = int(st.get("num_waiting", 0))
            s.kv_usage = float(st.get("kv_usage", 0.0))
            s.prefix_cache_hit_rate = float(st.get("prefix_cache_hit_rate", 0.0))
            s.num_preemptions = int(st.get("num_preemptions", 0))
            s.kv_blocks_in_use = int(eng.num_kv_blocks_in_use())
            s.kv_blocks_total = int(sum(p.num_blocks for p in eng.blocks.pools)) if hasattr(eng, "blocks") else 0
            s.num_requests_in_engine = len(getattr(eng, "requests", {}))
        except Exception:  # stats must never break serving
            log.debug("stats refresh failed", exc_info=True)


@dataclass
class _LogWindow:
    start: float
    prompt_tokens: int = 0
    generation_tokens: int = 0


def _finish_label(out: RequestOutput) -> str:
    reasons = {o.finish_reason for o in out.outputs}
    return next(iter(reasons)) if len(reasons) == 1 else "mixed"
