"""An attention split's Q and merge layouts in shared memory (csrc/mk_attn_layout.cuh, MK_ATTN_PAD), checked on the
CPU: the header's own functions, compiled as host code, print every mapping; this test checks that Q's 16-byte copies,
its 32-bit stores and the MMA fragment reads agree, that no two words share a place and all fit what
plan.attn_smem_bytes reserves, and how many shared-memory wavefronts a warp's fragment load and a merge store cost
(the 8- and 4-way conflicts the padding removes)."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter

import pytest

from megakernel.kernel import build
from megakernel.kernel import opcodes as O

HEAD_DIMS = tuple(range(16, 129, 16))   # task_attn's instantiations: KS = 1..8
ROWS = 8                                # query heads per kv head the MMA tile serves (opcodes.ATTN_MAX_GROUP)

PROGRAM = r"""
#include <cstdio>
#include "mk_attn_layout.cuh"
template <int D, int PAD, int MPAD>
void dump() {
    for (int r = 0; r < %(rows)d; r++) {
        for (int j = 0; j < D / 8; j++) std::printf("C %%d %%d %%d %%d %%d\n", D, PAD, r, j, q_chunk<D, PAD>(r, j));
        for (int w = 0; w < D / 2; w++) std::printf("W %%d %%d %%d %%d %%d\n", D, PAD, r, w, q_word<D, PAD>(r, w));
    }
    for (int r = 0; r < %(mrows)d; r++)
        for (int c = 0; c < D; c++)
            std::printf("M %%d %%d %%d %%d %%d\n", D, MPAD, r, c, (int)merge_float<D, MPAD>(r, c));
}
template <int D>
void both() { dump<D, 0, 0>(); dump<D, %(pad)d, %(mpad)d>(); }
void pending() {
    for (int stages = 2; stages <= 4; stages++)
        for (int chunks = 1; chunks <= 7; chunks++)
            for (int q_async = 0; q_async <= 1; q_async++)
                for (int c = 0; c < chunks; c++)
                    for (int n_issued = c + 1; n_issued <= chunks; n_issued++)
                        for (int nbq = 1; nbq <= n_issued; nbq++)
                            std::printf("P %%d %%d %%d %%d %%d\n", c, n_issued, nbq, q_async,
                                        attn_pending_groups(c, n_issued, nbq, q_async != 0));
}
int main() { %(calls)s pending(); return 0; }
"""


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> tuple[dict, dict, dict]:
    """Q's {(D, pad, r, j): chunk} and {(D, pad, r, w): word} (pad 0 and ATTN_ROW_PAD) and the merge's
    {(D, pad, r, c): float} (pad 0 and ATTN_MERGE_PAD), from the header compiled by the host's C++ compiler."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    tmp = tmp_path_factory.mktemp("attn_q")
    src = tmp / "dump.cpp"
    src.write_text(PROGRAM % {"rows": ROWS, "mrows": O.ATTN_WARPS * ROWS, "pad": O.ATTN_ROW_PAD,
                              "mpad": O.ATTN_MERGE_PAD, "calls": " ".join(f"both<{d}>();" for d in HEAD_DIMS)})
    res = subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(build.CSRC), str(src), "-o", str(tmp / "dump")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = subprocess.run([str(tmp / "dump")], capture_output=True, text=True, check=True).stdout
    tables: dict[str, dict] = {"C": {}, "W": {}, "M": {}, "P": {}}
    for line in out.splitlines():
        kind, *key, v = line.split()
        tables[kind][tuple(int(k) for k in key)] = int(v)
    PENDING.update(tables["P"])
    return tables["C"], tables["W"], tables["M"]


PENDING: dict[tuple, int] = {}   # (c, n_issued, n_before_q, q_async) -> attn_pending_groups, filled by `layouts`


@pytest.mark.parametrize("pad", [0, O.ATTN_ROW_PAD])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_copies_stores_and_reads_agree_on_one_layout(layouts, d, pad):
    """Every row's words land on distinct words inside ROWS rows of d + ATTN_ROW_PAD elements, the Q bytes
    plan.attn_smem_bytes reserves in every build (nothing overwritten, nothing outside), and row r's word w lies
    in the chunk q_chunk gives its 16-byte copy: the cp.async path (chunks), the register path (words) and the
    fragment reads (words) see one layout. Unpadded, it is the plain [rows][d] one."""
    chunks, words, _ = layouts
    placed = [words[(d, pad, r, w)] for r in range(ROWS) for w in range(d // 2)]
    assert len(set(placed)) == len(placed) and min(placed) >= 0
    q_reserved = ROWS * (d + O.ATTN_ROW_PAD) * 2
    assert 4 * (max(placed) + 1) <= q_reserved
    for r in range(ROWS):
        for w in range(d // 2):
            assert words[(d, pad, r, w)] == 4 * chunks[(d, pad, r, w // 4)] + w % 4
            if not pad:
                assert words[(d, pad, r, w)] == r * d // 2 + w
    # the host reserves the kernel's ring (csrc/mk_attention.cuh `ring`) with Q at its padded size
    from megakernel.kernel.plan import attn_smem_bytes
    ring = O.ATTN_MAX_STAGES * 2 * O.ATTN_CHUNK * (d + O.ATTN_ROW_PAD) * 2 + q_reserved + O.ATTN_TABLE_SLOTS * 4
    assert attn_smem_bytes(d, ROWS) >= ring


def wavefronts(words: dict, d: int, pad: int, ks: int, half: int) -> int:
    """Shared-memory wavefronts of one warp's 32-bit A-fragment load at k-step ks (half 1: the word 4 further): lane
    (g, t4) reads row g's word ks * 8 + 4 * half + t4; a load takes as many wavefronts as the most distinct words any
    one of the 32 banks is asked for."""
    per_bank: dict[int, set] = {}
    for g in range(ROWS):
        for t4 in range(4):
            word = words[(d, pad, g, ks * 8 + 4 * half + t4)]
            per_bank.setdefault(word % 32, set()).add(word)
    return max(len(s) for s in per_bank.values())


@pytest.mark.parametrize("d", [64, 128])
def test_unpadded_rows_cost_eight_wavefronts_per_fragment_load(layouts, d):
    """At head_dim 64 and 128 (rows 128 or 256 bytes apart, a multiple of the banks' 128-byte span) each unpadded
    fragment load is an 8-way conflict: what MK_ATTN_PAD=0 builds pay, 2 * d / 16 times per warp per chunk."""
    _, words, _ = layouts
    loads = [(ks, half) for ks in range(d // 16) for half in (0, 1)]
    assert Counter(wavefronts(words, d, 0, ks, h) for ks, h in loads) == {8: len(loads)}


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_padded_rows_load_in_one_wavefront(layouts, d):
    """At every head_dim task_attn instantiates (16..128), every padded fragment load is one wavefront."""
    _, words, _ = layouts
    for ks in range(d // 16):
        for half in (0, 1):
            assert wavefronts(words, d, O.ATTN_ROW_PAD, ks, half) == 1


@pytest.mark.parametrize("pad", [0, O.ATTN_MERGE_PAD])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_the_merge_layout_fits_its_reservation(layouts, d, pad):
    """The merge's ATTN_WARPS x ROWS rows of d floats land on distinct floats inside what plan.attn_smem_bytes
    reserves for them in every build (rows of d + ATTN_MERGE_PAD), before the warps' maxima and sums; unpadded, the
    plain [rows][d] layout."""
    from megakernel.kernel.plan import attn_smem_bytes
    _, _, merge = layouts
    rows = O.ATTN_WARPS * ROWS
    placed = [merge[(d, pad, r, c)] for r in range(rows) for c in range(d)]
    assert len(set(placed)) == len(placed) and min(placed) >= 0
    assert max(placed) + 1 <= rows * (d + O.ATTN_MERGE_PAD)
    assert attn_smem_bytes(d, ROWS) >= 4 * (rows * (d + O.ATTN_MERGE_PAD) + 2 * O.ATTN_WARPS * O.ATTN_MAX_GROUP)
    if not pad:
        assert all(merge[(d, 0, r, c)] == r * d + c for r in range(rows) for c in range(d))


def store_wavefronts(merge: dict, d: int, pad: int, slice_: int, col: int) -> int:
    """Shared-memory wavefronts of one warp's float2 store of its outputs at column col + 2 t (task_attn_d's merge:
    lane (g, t) writes row slice * ROWS + g). 8-byte accesses go out a half-warp (16 lanes, 128 bytes) at a time; in
    each, a bank asked for several distinct words serialises them."""
    total = 0
    for lanes in (range(0, 16), range(16, 32)):
        per_bank: dict[int, set] = {}
        for lane in lanes:
            g, t4 = lane >> 2, lane & 3
            f = merge[(d, pad, slice_ * ROWS + g, col + 2 * t4)]
            for word in (f, f + 1):
                per_bank.setdefault(word % 32, set()).add(word)
        total += max(len(s) for s in per_bank.values())
    return total


@pytest.mark.parametrize("d", [64, 128])
def test_the_padding_takes_the_merge_stores_from_eight_wavefronts_to_two(layouts, d):
    """Each of a computing warp's 2 * d / 16 output stores: 8 wavefronts unpadded (rows 256 or 512 bytes apart),
    2 padded (the minimum for 256 bytes)."""
    _, _, merge = layouts
    cols = range(0, d, 8)
    assert {store_wavefronts(merge, d, 0, 1, c) for c in cols} == {8}
    assert {store_wavefronts(merge, d, O.ATTN_MERGE_PAD, 1, c) for c in cols} == {2}


def split_groups(stages: int, chunks: int, q_async: bool):
    """task_attn_d's cp.async path, as far as its groups go: before the loop it issues up to stages - 1 chunks (the
    ring's depth less the stage the loop refills first), then Q's rows as a group of their own (q_async); each lap c
    first issues the next chunk if any is left, then waits for chunk c. Yields, per lap, (c, n_issued, n_before_q,
    the groups in commit order)."""
    groups, n_issued = [], 0
    while n_issued < stages - 1 and n_issued < chunks:
        groups.append(f"chunk{n_issued}")
        n_issued += 1
    n_before_q = n_issued
    if q_async:
        groups.append("q")
    for c in range(chunks):
        if n_issued < chunks:
            groups.append(f"chunk{n_issued}")
            n_issued += 1
        yield c, n_issued, n_before_q, list(groups)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_each_chunk_wait_covers_its_chunk_and_q(layouts, stages):
    """The wait of lap c leaves attn_pending_groups groups in flight: chunk c and every older group have landed, Q's
    rows at lap 0 too, at most 3 are left (cp_async_wait_pending's range), and no group is waited for that is not
    needed and had not landed already (Q's rows, newer than chunk 1 in a ring of three, are waited for at lap 0).
    With two stages it equals the chunk count the kernel uses there (n_issued - c - 1); with three, that count would
    have left Q's rows in flight at lap 0 for every split of at least two chunks (the bug this function fixed)."""
    for chunks in range(1, 8):
        for q_async in (False, True):
            landed: set[str] = set()
            for c, n_issued, nbq, groups in split_groups(stages, chunks, q_async):
                pending = PENDING[(c, n_issued, nbq, int(q_async))]
                done = groups[:len(groups) - pending]
                need = {f"chunk{c}"} | ({"q"} if q_async and c == 0 else set())
                assert need <= set(done) and 0 <= pending <= 3, (stages, chunks, q_async, c, pending, groups)
                last_needed = max(groups.index(g) for g in need)
                assert set(done[last_needed + 1:]) <= landed, (stages, chunks, q_async, c, groups)
                landed |= set(done)
                if stages == 2:
                    assert pending == n_issued - c - 1
                elif q_async and c == 0 and chunks >= 2:
                    old = n_issued - c - 1                          # what the kernel waited for before
                    assert "q" not in groups[:len(groups) - old]
