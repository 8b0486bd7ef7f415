"""An engine stand-in whose "model" replays scripted North-format text, for end-to-end tests of the chat paths
(reasoning, tool calls) through the real app, AsyncEngine thread, HTTP and the official client.

It implements the part of LLMEngine's interface the server uses; one token per step per sequence.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Callable

from megakernel.engine.grammar import GrammarCompiler
from megakernel.engine.outputs import CompletionOutput, RequestOutput


class ScriptedEngine:
    def __init__(self, tokenizer, script: Callable[[str], str], max_model_len: int = 2048,
                 step_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.config = SimpleNamespace(vocab_size=len(tokenizer))
        self.max_model_len = max_model_len
        self.eos_token_ids = (tokenizer.eos_token_id,)
        self.model_path = None
        self.requests: dict[str, dict] = {}
        self.prompts: list[str] = []
        self.step_delay = step_delay
        self.lock = threading.Lock()
        self.grammar = GrammarCompiler(tokenizer, len(tokenizer))   # checks grammars as the real engine does

    def add_request(self, request_id, prompt_token_ids, params, prompt=None) -> None:
        text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        self.prompts.append(text)
        reply = self.tokenizer.encode(self.script(text), add_special_tokens=False) + [self.eos_token_ids[0]]
        if params.structured_outputs is not None:       # a scripted reply must be one the grammar allows
            m = self.grammar.matcher(params.structured_outputs)
            assert all(m.accept(t) for t in reply[:-1]), f"the script broke the grammar: {m.error}"
        self.requests[request_id] = dict(params=params, prompt_ids=list(prompt_token_ids), reply=reply,
                                         seqs=[dict(ids=[], reason=None) for _ in range(params.n)])

    def abort_request(self, request_id) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        outs = []
        for rid, r in list(self.requests.items()):
            p = r["params"]
            comps = []
            for i, s in enumerate(r["seqs"]):
                if s["reason"] is None:
                    tok = r["reply"][min(len(s["ids"]), len(r["reply"]) - 1)]
                    s["ids"].append(tok)
                    if tok in self.eos_token_ids:
                        s["reason"] = "stop"
                    elif p.max_tokens is not None and len(s["ids"]) >= p.max_tokens:
                        s["reason"] = "length"
                ids = s["ids"][:-1] if s["reason"] == "stop" else s["ids"]
                text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
                comps.append(CompletionOutput(i, list(s["ids"]), text, s["reason"]))
            finished = all(s["reason"] for s in r["seqs"])
            outs.append(RequestOutput(rid, None, r["prompt_ids"], comps, finished=finished))
            if finished:
                del self.requests[rid]
        return outs

    def stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "kv_usage": 0.0, "num_preemptions": 0,
                "prefix_cache_hit_rate": 0.0}

    def num_kv_blocks_in_use(self) -> int:
        return 0


class InProcessServer:
    """uvicorn in a thread around an app built from any engine (used with ScriptedEngine)."""

    def __init__(self, engine, api_key: str | None = None, name: str = "scripted") -> None:
        import uvicorn

        from server_harness import free_port
        from megakernel.server.app import create_app
        from megakernel.server.async_engine import AsyncEngine

        self.app = create_app(AsyncEngine(engine), [name], api_key=api_key)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 30:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.05)

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
