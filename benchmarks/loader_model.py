"""A discrete-event model of one paged MoE worker (mk_moe_pages.cuh) streaming gate/up items: the rate its loader's
serial costs allow, from per-step costs measured by the page stats (benchmarks/page_stats.py), so a change's
prediction can be written down before the device time (SPEED_NOTES).

    python benchmarks/loader_model.py                       # the H200 one-row figures (session 34), and each cost's share
    python benchmarks/loader_model.py --pages 4 --decode 0.70 --issue 0.16 --flight 1.14 --math 1.45   # the H100's

What it models, in the kernel's order: the loader takes item j's index (its claim's result, back `claim_rt` after
the claim), decodes it (before the item slot's wait: MK_PG_DECODE_EARLY; else after), waits for the slot (freed by
item j - slots' epilogue), publishes it, then issues its pages one after another, each once its ring page is free (ring
page s % npg, computed by warp s % npg), paying `issue` per page; it claims the next item once the pages before
`claim_at` (`lead` pages before the end; half the item at lead 0) are issued, before page claim_at's ring wait. A page
lands `flight` after its issue; its warp computes it in `math` once idle, then frees the page; the warp that computes
an item's last page then writes the epilogue (`epilogue`, the counter's release included: the warp stays busy, the
page is already free) and frees the slot.
Not modelled: the input warp (gate/up items share the layer's x rows), HBM contention (the flight is a constant), the
layer's ramp and tail (a worker's first item starts from an empty ring; a b1 layer gives each worker ~5 items).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Costs:
    """Per-step costs in microseconds (the H200's one-row gate/up items, speed_20261206s34 call 3's page stats)."""
    decode: float = 0.74       # the loader's item decode (moe_item)
    publish: float = 0.51      # from the item's publish to its first page's issue
    issue: float = 0.18        # the loader's time inside one page's issue
    flight: float = 1.05       # a page's issue to its landing
    math: float = 1.48         # one warp's product of a page
    epilogue: float = 1.28     # the last page's warp: SiLU * up, stores, the counter's release
    claim_rt: float = 2.0      # the claim's atomic round trip under load (mem_latency.cu: 1.4-3.2)
    pages: int = 8             # pages per item (16 KB each)
    npg: int = 12              # ring pages (one computing warp each)
    slots: int = 3             # item slots (MK_PAGE_SLOTS)
    lead: int = 4              # MK_PG_CLAIM_LEAD
    decode_early: bool = True  # MK_PG_DECODE_EARLY
    page_kb: int = 16


def rate_gb_per_s(c: Costs, n_items: int = 400) -> float:
    """Steady-state GB/s of one worker (the first quarter of the items left out as warm-up)."""
    t = 0.0                                     # the loader's clock
    page_free = [0.0] * c.npg                   # ring page w is free from then on
    warp_idle = [0.0] * c.npg                   # warp w (ring page w's) is idle from then on
    slot_free = [0.0] * c.slots
    claim_ready = 0.0
    claim_at = c.pages // 2 if c.lead == 0 else max(c.pages - c.lead, 0)
    ends: list[float] = []
    s = 0
    for j in range(n_items):
        q = j % c.slots
        t = max(t, claim_ready)                 # `take`: the claim's result, before the item's decode
        if c.decode_early:
            t += c.decode
        if j >= c.slots:
            t = max(t, slot_free[q])
        if not c.decode_early:
            t += c.decode
        t += c.publish
        last_fin, last_warp = 0.0, 0
        for p in range(c.pages):
            w = s % c.npg
            if p == claim_at:
                claim_ready = t + c.claim_rt    # (after the pages before claim_at, before this page's ring wait)
            if s >= c.npg:
                t = max(t, page_free[w])
            t += c.issue
            fin = max(t + c.flight, warp_idle[w]) + c.math
            page_free[w] = warp_idle[w] = fin
            if fin >= last_fin:
                last_fin, last_warp = fin, w
            s += 1
        end = last_fin + c.epilogue
        warp_idle[last_warp] = end
        slot_free[q] = end
        ends.append(end)
    k = n_items // 4
    return (n_items - 1 - k) * c.pages * c.page_kb * 1024 / ((ends[-1] - ends[k]) * 1e-6) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base = Costs()
    for name, value in vars(base).items():     # (a bool switch as 0 / 1)
        kind = (lambda text: bool(int(text))) if isinstance(value, bool) else type(value)
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    c = Costs(**vars(ap.parse_args()))
    r = rate_gb_per_s(c)
    print(f"model: {r:.1f} GB/s per worker ({c.pages}-page items, ring {c.npg}, {c.slots} slots)")
    print("one cost changed at a time:")
    for name, value in (("decode", 0.0), ("publish", 0.0), ("issue", 0.05), ("issue", 0.4), ("issue", 0.6),
                        ("flight", 2.0), ("math", 0.76), ("epilogue", 3.0), ("claim_rt", 4.0), ("slots", 4),
                        ("decode_early", False)):
        print(f"  {name} = {value}: {rate_gb_per_s(replace(c, **{name: value})):.1f} GB/s")


if __name__ == "__main__":
    main()
