"""`LLM`: offline batch generation, the Python API users know from vLLM."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Sequence as Seq

from megakernel.engine.llm_engine import EngineArgs, LLMEngine
from megakernel.engine.outputs import RequestOutput
from megakernel.engine.sampling_params import SamplingParams
from megakernel.errors import RequestError
from megakernel.north_format import START_THINKING, reasoning_ban, special_strings_to_strip, split_reply

Prompt = str | list[int]


class LLM:
    """Load a model once, then `generate` for many prompts at a time.

    >>> llm = LLM()                                   # the embedded default model
    >>> llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))[0].text
    """

    def __init__(self, model: str | None = None, *, device: str | None = None, dtype: str | None = None,
                 backend: str = "auto", engine: LLMEngine | None = None, **kwargs) -> None:
        self.engine = engine or LLMEngine(EngineArgs(model=model, device=device, dtype=dtype, backend=backend,
                                                     **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model folder has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """Token ids of `messages` in the model's chat template, ending with the assistant's generation prompt."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError("this model folder has no chat template")
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                       **template_kwargs)
        return tok.encode(text, add_special_tokens=False)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             tools: list[dict] | None = None, use_tqdm: bool = True, **template_kwargs) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (OpenAI-style message dicts).

        Each output's `text` is the answer and `reasoning` the model's reasoning (North format). With
        `reasoning=False` (a template option) the model is kept from reasoning at all."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c, tools, **template_kwargs) for c in convs]
        think = self.tokenizer.convert_tokens_to_ids(START_THINKING)
        base = sampling_params or SamplingParams()
        params = []
        for ids in prompts:
            bias = {} if ids and ids[-1] == think else reasoning_ban(self.tokenizer)
            params.append(replace(base, skip_special_tokens=False, logit_bias={**bias, **base.logit_bias}))
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        specials = special_strings_to_strip(self.tokenizer)
        for ids, out in zip(prompts, outs):
            for o in out.outputs:
                reply = split_reply(o.text, bool(ids) and ids[-1] == think, specials)
                o.text, o.reasoning = reply.content, reply.reasoning or None
        return outs

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]     # validate every prompt before queueing any
        order: dict[str, int] = {}
        for i, (p, ids, sp) in enumerate(zip(prompts, encoded, params)):
            rid = f"gen-{next(self._ids)}"
            try:
                self.engine.add_request(rid, ids, sp, prompt=p if isinstance(p, str) else None)
            except Exception:
                for queued in order:
                    self.engine.abort_request(queued)
                raise
            order[rid] = i
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="Generating", unit="req", leave=False)
        while any(r is None for r in results):
            for out in self.engine.step():
                if out.finished:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]
