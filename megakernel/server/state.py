"""What every request handler shares: the engine, the served names and key, the tokenizers (one per thread) and
the prep threads that render and tokenise requests off the event loop."""

from __future__ import annotations

import asyncio
import copy
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megakernel.north_format import special_strings_to_strip
from megakernel.server.async_engine import AsyncEngine
from megakernel.server.metrics import ServerMetrics

PREP_THREADS = 2


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    created: int = 0


class ServerState:
    def __init__(self, engine: AsyncEngine, cfg: ServerConfig, metrics: ServerMetrics,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.metrics = metrics
        eng = engine.engine
        tok = engine.tokenizer
        path = getattr(eng, "model_path", None)
        # Each thread that touches a tokenizer has its own copy (a Rust tokenizer shared across threads can fail
        # with "Already borrowed"): the engine thread decodes with the engine's, the event loop decodes logprob
        # tokens with `tokenizer`, and the prep threads render and tokenise requests off the event loop, so a
        # huge prompt never stalls other requests (or /health).
        self.tokenizer = _clone_tokenizer(tok, path)
        if self.tokenizer is not None:
            if chat_template is not None:
                self.tokenizer.chat_template = chat_template
            self.tokenizer.model_max_length = 1 << 62     # we check lengths ourselves: no transformers warning
        clones = [_clone_tokenizer(self.tokenizer, path) for _ in range(PREP_THREADS)]
        self._local = threading.local()
        self.prep = ThreadPoolExecutor(PREP_THREADS, "megakernel-prep", initializer=self._init_prep, initargs=(clones,))
        self.grammar = getattr(eng, "grammar", None)    # structured outputs; None: not supported by this engine
        self.vocab_size = int(eng.config.vocab_size)
        self.eos_ids = set(getattr(eng, "eos_token_ids", ()) or ())
        self.specials = special_strings_to_strip(self.tokenizer)
        self._decode_cache: dict[int, str] = {}

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _init_prep(self, clones: list) -> None:
        self._local.tok = clones.pop()
        try:    # a lower priority for prep threads: a CPU-bound tokenisation must not starve the event loop
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass

    @property
    def worker_tokenizer(self):
        """The calling prep thread's tokenizer."""
        return self._local.tok

    async def off_loop(self, fn, *args):
        """Run fn(*args) on a prep thread (rendering, tokenising, grammar compiling) and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def token_str(self, tid: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{tid}"
        s = self._decode_cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer is not None else \
                f"token_id:{tid}"
            if len(self._decode_cache) < 1_000_000:
                self._decode_cache[tid] = s
        return s


def _clone_tokenizer(tok, path):
    if tok is None:
        return None
    try:
        return copy.deepcopy(tok)
    except Exception:
        if path is not None:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path))
        return tok
