"""Train north-nano (a tiny cohere2_moe model) with transformers' Cohere2MoeForCausalLM.

Reproducible: fixed seeds, deterministic data order; the loss is taken on assistant tokens only
(from the token after <|CHATBOT_TOKEN|> up to and including <|END_OF_TURN_TOKEN|>).
A small switch-style load-balancing loss on the router logits keeps all experts in use.

Inputs : training/build/train.jsonl (training/build_data.py), tokenizer files in --tokenizer
         (training/tokenizer.py writes them into megakernel/bundled/north_nano).
Outputs: --out/weights.safetensors (bf16 state dict), --out/config.json, --out/loss_log.json.
         training/finalize_north_nano.py then writes the shipped folder with save_pretrained.

Example (the command used for the shipped model is in training/README.md):
  python training/train_north_nano.py --device cuda --steps 6000 --out /tmp/nn
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL_DIR = os.path.join(REPO, "megakernel", "bundled", "north_nano")

CHATBOT_ID = 7  # <|CHATBOT_TOKEN|>
EOT_ID = 4      # <|END_OF_TURN_TOKEN|>
PAD_ID = 0


def model_config(vocab_size: int):
    from transformers import Cohere2MoeConfig

    n_layers = 8
    return Cohere2MoeConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=n_layers,
        intermediate_size=96,
        prefix_dense_intermediate_size=512,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=0,
        first_k_dense_replace=1,
        prefix_dense_sliding_window_pattern=1,
        layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n_layers)],
        mlp_layer_types=["dense" if i < 1 else "sparse" for i in range(n_layers)],
        sliding_window=128,
        rope_theta=50000.0,
        expert_selection_fn="sigmoid",
        norm_topk_prob=False,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        logit_scale=1.0,
        max_position_embeddings=4096,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=EOT_ID,
        pad_token_id=PAD_ID,
    )


def assistant_mask(ids: list[int]) -> list[bool]:
    mask, on = [], False
    for t in ids:
        mask.append(on)
        if t == CHATBOT_ID:
            on = True
        elif t == EOT_ID:
            on = False
    return mask


def tokenize_dataset(data_path: str, tok_dir: str, max_len: int, max_answer: int):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok.convert_tokens_to_ids("<|CHATBOT_TOKEN|>") == CHATBOT_ID
    assert tok.convert_tokens_to_ids("<|END_OF_TURN_TOKEN|>") == EOT_ID
    seqs, dropped = [], 0
    with open(data_path) as fh:
        for line in fh:
            d = json.loads(line)
            text = tok.apply_chat_template(d["messages"], tools=d.get("tools"), tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            m = assistant_mask(ids)
            if len(ids) > max_len or (d["kind"] == "code" and sum(m) > max_answer):
                dropped += 1
                continue
            seqs.append((ids, m))
    return seqs, dropped


def batches_for_epoch(lengths, batch_size, rng: random.Random):
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    chunk = batch_size * 50
    out = []
    for s in range(0, len(idx), chunk):
        part = sorted(idx[s:s + chunk], key=lambda i: lengths[i])
        out.extend(part[j:j + batch_size] for j in range(0, len(part), batch_size))
    rng.shuffle(out)
    return out


def collate(seqs, b, device):
    L = max(len(seqs[i][0]) for i in b)
    x = torch.full((len(b), L), PAD_ID, dtype=torch.long)
    y = torch.full((len(b), L), -100, dtype=torch.long)
    for r, i in enumerate(b):
        ids, m = seqs[i]
        x[r, :len(ids)] = torch.tensor(ids)
        y[r, :len(ids)] = torch.where(torch.tensor(m), torch.tensor(ids), torch.tensor(-100))
    return x.to(device), y.to(device)


def balance_loss(router_logits, top_k, n_exp):
    tot = 0.0
    for lg in router_logits:
        lg = lg.float()
        probs = torch.softmax(lg, dim=-1)
        sel = torch.topk(lg, top_k, dim=-1).indices
        frac = torch.zeros_like(probs).scatter_(1, sel, 1.0).mean(0) / top_k
        tot = tot + n_exp * (frac * probs.mean(0)).sum()
    return tot / len(router_logits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(HERE, "build", "train.jsonl"))
    ap.add_argument("--tokenizer", default=MODEL_DIR)
    ap.add_argument("--cache", default=os.path.join(HERE, "build", "tokens.pt"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="if > 0, choose --steps from a short speed measurement so training fits this many seconds")
    ap.add_argument("--hard-stop", type=float, default=0.0,
                    help="if > 0, stop training (and save) once this many seconds have passed since start")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-answer", type=int, default=180)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default="", help="start from this weights.safetensors (continued training)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--experts-impl", default="", help="transformers experts implementation (default: its own)")
    a = ap.parse_args()

    if a.threads:
        torch.set_num_threads(a.threads)
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    t_start = time.time()

    if os.path.exists(a.cache):
        blob = torch.load(a.cache)
        seqs, dropped, vocab = blob["seqs"], blob["dropped"], blob["vocab"]
    else:
        from transformers import AutoTokenizer

        seqs, dropped = tokenize_dataset(a.data, a.tokenizer, a.max_len, a.max_answer)
        vocab = len(AutoTokenizer.from_pretrained(a.tokenizer))
        os.makedirs(os.path.dirname(a.cache), exist_ok=True)
        torch.save({"seqs": seqs, "dropped": dropped, "vocab": vocab}, a.cache)
    n_tok = sum(len(s[0]) for s in seqs)
    n_tgt = sum(sum(s[1]) for s in seqs)
    print(f"data: {len(seqs)} sequences ({dropped} dropped), {n_tok} tokens, {n_tgt} target tokens, "
          f"prep {time.time() - t_start:.1f}s", flush=True)

    from transformers import Cohere2MoeForCausalLM

    cfg = model_config(vocab)
    torch.manual_seed(a.seed)
    model = Cohere2MoeForCausalLM(cfg).to(a.device)
    model.config._attn_implementation = "sdpa"
    if a.init:
        from safetensors.torch import load_file

        missing, unexpected = model.load_state_dict(
            {k: v.float() for k, v in load_file(a.init).items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
        print(f"initialised from {a.init}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters (tied embeddings counted once)", flush=True)

    dev = torch.device(a.device)
    use_amp = dev.type == "cuda"
    lengths = [len(s[0]) for s in seqs]

    def step_fn(x, y):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp):
            out = model(input_ids=x, labels=y, output_router_logits=True)
            aux = balance_loss(out.router_logits, cfg.num_experts_per_tok, cfg.num_experts)
        return out.loss, aux

    if a.experts_impl:
        model.config._experts_implementation = a.experts_impl
    # check that the default experts kernel runs forward+backward here; otherwise use the eager loop
    try:
        xb, yb = collate(seqs, list(range(min(4, len(seqs)))), dev)
        l0, a0 = step_fn(xb, yb)
        (l0 + a0).backward()
        assert torch.isfinite(l0).item()
    except Exception as e:  # noqa: BLE001
        print(f"experts implementation {model.config._experts_implementation!r} failed ({e!r}); using eager",
              flush=True)
        model.config._experts_implementation = "eager"
    model.zero_grad(set_to_none=True)
    print(f"experts implementation: {model.config._experts_implementation}", flush=True)

    if a.time_budget > 0:
        # measure speed on a few batches (no optimizer step; model unchanged), then choose --steps
        rng_b = random.Random(12345)
        bl = batches_for_epoch(lengths, a.batch_size, rng_b)
        times = []
        for k in range(30):
            x, y = collate(seqs, bl[k], dev)
            if use_amp:
                torch.cuda.synchronize()
            t0 = time.time()
            loss, aux = step_fn(x, y)
            (loss + a.aux_coef * aux).backward()
            model.zero_grad(set_to_none=True)
            if use_amp:
                torch.cuda.synchronize()
            times.append(time.time() - t0)
        warm = times[10:]  # the first steps pay one-off start-up costs
        per = sorted(warm)[len(warm) // 2] * 1.12  # median, plus optimizer/logging overhead
        a.steps = max(200, int((a.time_budget - (time.time() - t_start)) / per))
        print(f"speed: {per * 1000:.1f} ms/step -> --steps {a.steps}", flush=True)
        torch.manual_seed(a.seed)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        p = (s - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))

    rng = random.Random(a.seed)
    queue, epoch = [], 0
    log, acc_l, acc_a, acc_n = [], 0.0, 0.0, 0
    model.train()
    t_train = time.time()
    done_steps = 0
    for step in range(a.steps):
        if a.hard_stop and time.time() - t_start > a.hard_stop:
            print(f"hard stop at step {step}", flush=True)
            break
        if not queue:
            queue = batches_for_epoch(lengths, a.batch_size, rng)
            epoch += 1
        b = queue.pop()
        x, y = collate(seqs, b, dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss, aux = step_fn(x, y)
        (loss + a.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc_l += loss.item()
        acc_a += float(aux.detach())
        acc_n += 1
        done_steps = step + 1
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            rec = {"step": step + 1, "epoch": epoch, "loss": acc_l / acc_n, "aux": acc_a / acc_n,
                   "lr": lr_at(step), "time_s": round(time.time() - t_train, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
            acc_l, acc_a, acc_n = 0.0, 0.0, 0

    if acc_n:
        log.append({"step": done_steps, "epoch": epoch, "loss": acc_l / acc_n, "aux": acc_a / acc_n,
                    "lr": lr_at(done_steps - 1), "time_s": round(time.time() - t_train, 1)})
    train_time = time.time() - t_train
    os.makedirs(a.out, exist_ok=True)
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}
    save_file(sd, os.path.join(a.out, "weights.safetensors"))
    cfg.save_pretrained(a.out)
    meta = {"args": vars(a), "device": (torch.cuda.get_device_name(0) if use_amp else "cpu"),
            "torch": torch.__version__, "params": n_params, "sequences": len(seqs), "dropped": dropped,
            "tokens": n_tok, "target_tokens": n_tgt, "epochs": epoch, "steps_done": done_steps, "train_time_s": round(train_time, 1),
            "final_loss": log[-1]["loss"], "log": log}
    import transformers

    meta["transformers"] = transformers.__version__
    with open(os.path.join(a.out, "loss_log.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    print(f"done: {done_steps}/{a.steps} steps, {epoch} epochs, {train_time:.0f}s, final loss {log[-1]['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
