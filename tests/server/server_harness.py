"""Helpers of the server tests: a live `megakernel serve` subprocess on 127.0.0.1 (free port), its clients and
its Prometheus metrics."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "sk-megakernel-test"
MODEL_NAME = "north-test"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = API_KEY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "megakernel", "serve", "--port", str(self.port), "--served-model-name",
               MODEL_NAME, "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        self._wait()

    def _wait(self, timeout: float = 180) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server did not start in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 300), **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=kw.pop("timeout", 600), **kw)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def metric(self, name: str) -> float:
        return self.metric_of(self.metrics(), name)

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Wait until the engine is idle (no running or waiting sequences) and return the metrics."""
        t0 = time.time()
        while True:
            m = self.metrics()
            busy = sum(v for k, v in m.items() if k.startswith(("megakernel_num_requests_running{",
                                                               "megakernel_num_requests_waiting{")))
            if busy == 0 and self.metric_of(m, "megakernel_kv_blocks_in_use") == 0:
                return m
            if time.time() - t0 > timeout:
                return m
            time.sleep(0.3)

    @staticmethod
    def metric_of(m: dict[str, float], name: str) -> float:
        """Sum of a metric over its label sets."""
        return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def first_streamed_call(stream) -> tuple[str | None, str, int, str | None]:
    """(name, arguments, number of deltas, finish reason) of the first tool call of choice 0 in a chat stream."""
    name, arguments, n_deltas, finish = None, "", 0, None
    for chunk in stream:
        for d in chunk.choices:
            finish = d.finish_reason or finish
            for t in d.delta.tool_calls or []:
                if t.index == 0 and d.index == 0:
                    name = name or t.function.name
                    arguments += t.function.arguments or ""
                    n_deltas += 1
    return name, arguments, n_deltas, finish


# A KV budget so small that 16 running sequences cannot all fit: the scheduler preempts and recomputes.
TIGHT_ARGS = ["--block-size", "16", "--max-model-len", "192", "--max-batch-size", "16",
              "--max-num-batched-tokens", "64", "--num-kv-blocks", "24,40"]
