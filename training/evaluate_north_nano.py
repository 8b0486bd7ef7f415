"""Quality evaluation of north-nano on the held-out prompts.

* 50 held-out "write a function" prompts (functions whose names never occur in training):
  pass = the greedy answer holds a fenced ```python block whose code `ast.parse` accepts.
* 50 held-out tool prompts (held-out tool combinations and argument values):
  pass = the answer holds a well-formed North tool call
  <|START_ACTION|>[{"tool_call_id": ..., "tool_name": <a declared tool>, "parameters": {...}}]<|END_ACTION|>
  whose parameters hold every key the tool's schema requires.

The evaluator takes any `generate(list_of_prompt_token_id_lists, max_tokens) -> list_of_generated_token_id_lists`
(greedy; a trailing <|END_OF_TURN_TOKEN|> is allowed), so it runs with transformers or with megakernel.

  python training/evaluate_north_nano.py --backend transformers
  python training/evaluate_north_nano.py --backend megakernel
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import time
from typing import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL_DIR = os.path.join(REPO, "megakernel", "bundled", "north_nano")
EVAL_DIR = os.path.join(HERE, "eval")
EOT = "<|END_OF_TURN_TOKEN|>"
MAX_TOKENS = 200

GenerateFn = Callable[[Sequence[Sequence[int]], int], list]

_CODE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
_ACTION_RE = re.compile(r"<\|START_ACTION\|>(.*?)<\|END_ACTION\|>", re.S)


def load_sets(eval_dir: str = EVAL_DIR):
    with open(os.path.join(eval_dir, "heldout_functions.json")) as fh:
        code = json.load(fh)
    with open(os.path.join(eval_dir, "heldout_tools.json")) as fh:
        tools = json.load(fh)
    return code, tools


def render_prompts(tokenizer, code_set, tool_set):
    code_ids = [tokenizer.apply_chat_template(d["messages"], tokenize=False, add_generation_prompt=True)
                for d in code_set]
    tool_ids = [tokenizer.apply_chat_template(d["messages"], tools=d["tools"], tokenize=False,
                                              add_generation_prompt=True) for d in tool_set]
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [enc(s) for s in code_ids], [enc(s) for s in tool_ids]


def extract_code(text: str) -> str | None:
    """The first fenced code block of the answer text (inside <|START_TEXT|>...<|END_TEXT|> when present)."""
    m = re.search(r"<\|START_TEXT\|>(.*?)(?:<\|END_TEXT\|>|$)", text, re.S)
    body = m.group(1) if m else text
    c = _CODE_RE.search(body)
    return c.group(1) if c else None


def code_ok(text: str) -> bool:
    code = extract_code(text)
    if code is None or not code.strip():
        return False
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def parse_tool_calls(text: str):
    """The North tool calls of an answer as a list of dicts, or None when absent or malformed."""
    m = _ACTION_RE.search(text)
    if not m:
        return None
    try:
        calls = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    for c in calls:
        if not (isinstance(c, dict) and isinstance(c.get("tool_name"), str) and "tool_call_id" in c
                and isinstance(c.get("parameters"), dict)):
            return None
    return calls


def tool_ok(text: str, tools: list) -> bool:
    calls = parse_tool_calls(text)
    if calls is None:
        return False
    schemas = {}
    for t in tools:
        f = t.get("function", t)
        schemas[f["name"]] = f.get("parameters", {}).get("required", [])
    for c in calls:
        if c["tool_name"] not in schemas:
            return False
        if any(k not in c["parameters"] for k in schemas[c["tool_name"]]):
            return False
    return True


def strip_eos(ids, eos_id):
    ids = list(ids)
    while ids and ids[-1] == eos_id:
        ids.pop()
    return ids


def evaluate(generate: GenerateFn, tokenizer, max_tokens: int = MAX_TOKENS, eval_dir: str = EVAL_DIR) -> dict:
    code_set, tool_set = load_sets(eval_dir)
    code_p, tool_p = render_prompts(tokenizer, code_set, tool_set)
    eos_id = tokenizer.convert_tokens_to_ids(EOT)
    t0 = time.time()
    outs = generate(code_p + tool_p, max_tokens)
    gen_s = time.time() - t0
    texts = [tokenizer.decode(strip_eos(o, eos_id), skip_special_tokens=False) for o in outs]
    code_texts, tool_texts = texts[:len(code_p)], texts[len(code_p):]
    code_pass = [code_ok(t) for t in code_texts]
    tool_pass = [tool_ok(t, d["tools"]) for t, d in zip(tool_texts, tool_set)]
    tool_right = [bool(ok) and (parse_tool_calls(t) or [{}])[0].get("tool_name") == d["expected_tool"]
                  for ok, t, d in zip(tool_pass, tool_texts, tool_set)]
    return {
        "code_parse_rate": sum(code_pass) / len(code_pass),
        "tool_call_rate": sum(tool_pass) / len(tool_pass),
        "tool_expected_name_rate": sum(tool_right) / len(tool_right),
        "n_code": len(code_pass), "n_tool": len(tool_pass),
        "generate_seconds": round(gen_s, 2),
        "code_texts": code_texts, "tool_texts": tool_texts,
        "code_pass": code_pass, "tool_pass": tool_pass,
    }


# ----------------------------------------------------------------------------- backends


def transformers_generate_fn(model_dir: str = MODEL_DIR, dtype: str = "float32", device: str = "cpu",
                             batch_size: int = 100) -> GenerateFn:
    """Greedy generation with transformers' Cohere2MoeForCausalLM (left-padded batches)."""
    import torch
    from transformers import Cohere2MoeForCausalLM

    model = Cohere2MoeForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    eos_id = model.config.eos_token_id
    pad_id = model.config.pad_token_id

    def generate(prompts, max_tokens):
        res = []
        for s in range(0, len(prompts), batch_size):
            chunk = prompts[s:s + batch_size]
            L = max(len(p) for p in chunk)
            x = torch.full((len(chunk), L), pad_id, dtype=torch.long)
            am = torch.zeros((len(chunk), L), dtype=torch.long)
            for i, p in enumerate(chunk):
                x[i, L - len(p):] = torch.tensor(p)
                am[i, L - len(p):] = 1
            with torch.no_grad():
                out = model.generate(input_ids=x.to(device), attention_mask=am.to(device), max_new_tokens=max_tokens,
                                     do_sample=False, eos_token_id=eos_id, pad_token_id=pad_id)
            for row in out[:, L:].tolist():
                ids = []
                for t in row:
                    ids.append(t)
                    if t == eos_id:
                        break
                res.append(ids)
        return res

    return generate


def megakernel_generate_fn(model_dir: str = MODEL_DIR, dtype: str = "float32", device: str = "cpu") -> GenerateFn:
    from megakernel import LLM, SamplingParams

    llm = LLM(model=model_dir, device=device, dtype=dtype, max_num_seqs=100, max_num_batched_tokens=8192)

    def generate(prompts, max_tokens):
        outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) if hasattr(o, "outputs") else list(o.token_ids) for o in outs]

    return generate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL_DIR)
    ap.add_argument("--backend", choices=["transformers", "megakernel"], default="transformers")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--show", type=int, default=3, help="print this many answers of each kind")
    ap.add_argument("--out", default="", help="write the full results JSON here")
    a = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tok = AutoTokenizer.from_pretrained(a.model)
    gen = (transformers_generate_fn if a.backend == "transformers" else megakernel_generate_fn)(
        a.model, a.dtype, a.device)
    r = evaluate(gen, tok, a.max_tokens)
    for t in r["code_texts"][:a.show] + r["tool_texts"][:a.show]:
        print("-" * 60)
        print(t)
    print("=" * 60)
    print(json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(r, fh, indent=1)


if __name__ == "__main__":
    main()
