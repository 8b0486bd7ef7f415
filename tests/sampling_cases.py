"""Prompts for the embedded model and sampling parameters that exercise every option whose state crosses engine
steps: shared by the pipelined-vs-synchronous tests on CPU and GPU."""

from __future__ import annotations

from megakernel import SamplingParams

PROMPTS = ["def add(a, b):", "Write a function that reverses a list.", "import os\n", "class Stack:",
           "# sort numbers\n", "def fib(n):"]


def stateful_params() -> list[SamplingParams]:
    """One request per sampling option whose state crosses steps (stops, seeds, penalties, n, min_tokens, ...)."""
    return [
        SamplingParams(temperature=0, max_tokens=40, stop=["\n\n"]),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=11, max_tokens=30, logprobs=3),
        SamplingParams(temperature=0.8, seed=5, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                       max_tokens=30, n=2),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=1.0, min_p=0.1, seed=3, min_tokens=8, max_tokens=12, logprobs=0),
        SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[10], logit_bias={32: 3.0}),
    ]
