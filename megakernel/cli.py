"""`megakernel generate | serve | bench`."""

from __future__ import annotations

import argparse
import logging
import sys

from megakernel.errors import MegakernelError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "megakernel", "graph"],
                   help="decode backend: auto = megakernel on sm_90, CUDA graphs on other GPUs, torch on CPU")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--log-level", default="warning")


def _generate(args: argparse.Namespace) -> int:
    from megakernel import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, backend=args.backend,
              max_model_len=args.max_model_len)
    prompt: str | list[int] = args.prompt
    if not args.chat and llm.tokenizer is None:
        try:
            prompt = [int(t) for t in args.prompt.replace(",", " ").split()]
        except ValueError:
            raise MegakernelError("this model has no tokenizer: give --prompt as token ids, e.g. '1 17 42'") from None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop or [])
    if args.chat:       # the answer on stdout, the reasoning apart on stderr
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        if out.outputs[0].reasoning:
            print(f"[reasoning] {out.outputs[0].reasoning}\n", file=sys.stderr, flush=True)
        print(out.text)
        return 0
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    print(out.text if llm.tokenizer is not None else " ".join(map(str, out.token_ids)))
    return 0


def _serve(argv: list[str]) -> int:
    try:
        from megakernel.server.cli import main as serve_main
    except ImportError as e:
        raise MegakernelError(f"the server needs extra packages ({e.name}): pip install 'megakernel[server]'") from None
    return serve_main(argv)


def _bench(args: argparse.Namespace) -> int:
    import torch

    if args.random_north and not torch.cuda.is_available():
        raise MegakernelError("bench --random-north needs a CUDA GPU (North dimensions do not fit a CPU run)")
    from megakernel.bench import run_bench

    return run_bench(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="megakernel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the result")
    _engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")

    sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `megakernel serve --help`)", add_help=False)

    b = sub.add_parser("bench", help="decode throughput on random weights of a model's dimensions")
    _engine_args(b)
    from megakernel.bench import add_bench_args

    add_bench_args(b)

    if argv and argv[0] == "serve":
        return _run(lambda: _serve(argv[1:]), "warning")
    if argv[:2] == ["bench", "serve"]:           # `megakernel bench serve --help`: the serving benchmark
        from megakernel.bench_serve import main as bench_serve_main

        return _run(lambda: bench_serve_main(argv[2:]), "warning")
    args = parser.parse_args(argv)
    fn = {"generate": _generate, "bench": _bench}[args.command]
    return _run(lambda: fn(args), args.log_level)


def _run(fn, log_level: str) -> int:
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING), format="%(name)s: %(message)s")
    try:
        return fn()
    except MegakernelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
