"""Q's shared-memory layout in an attention split (csrc/mk_attn_q.cuh, MK_ATTN_Q_PAD), checked on the CPU: the
header's own functions, compiled as host code, print every mapping; this test checks that the 16-byte copies, the
32-bit stores and the MMA fragment reads agree, that no two of Q's words share a place and all fit the bytes
q_bytes reserves (and schedule.attn_smem_bytes with it), and how many shared-memory wavefronts a warp's fragment load
costs (the 8-way conflict the padding removes)."""

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
#include "mk_attn_q.cuh"
template <int D, int PAD>
void dump() {
    std::printf("B %%d %%d 0 0 %%d\n", D, PAD, q_bytes<D, PAD>(%(rows)d));
    for (int r = 0; r < %(rows)d; r++) {
        for (int j = 0; j < D / 8; j++) std::printf("C %%d %%d %%d %%d %%d\n", D, PAD, r, j, q_chunk<D, PAD>(r, j));
        for (int w = 0; w < D / 2; w++) std::printf("W %%d %%d %%d %%d %%d\n", D, PAD, r, w, q_word<D, PAD>(r, w));
    }
}
template <int D>
void both() { dump<D, 0>(); dump<D, %(pad)d>(); }
int main() { %(calls)s return 0; }
"""


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> tuple[dict, dict, dict]:
    """{(D, pad, r, j): chunk}, {(D, pad, r, w): word} and {(D, pad, 0, 0): bytes of ROWS rows}, pad 0 and
    ATTN_ROW_PAD, from the header compiled by the host's C++ compiler."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    tmp = tmp_path_factory.mktemp("attn_q")
    src = tmp / "dump.cpp"
    src.write_text(PROGRAM % {"rows": ROWS, "pad": O.ATTN_ROW_PAD,
                              "calls": " ".join(f"both<{d}>();" for d in HEAD_DIMS)})
    res = subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(build.CSRC), str(src), "-o", str(tmp / "dump")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = subprocess.run([str(tmp / "dump")], capture_output=True, text=True, check=True).stdout
    tables: dict[str, dict] = {"C": {}, "W": {}, "B": {}}
    for line in out.splitlines():
        kind, d, pad, r, i, v = line.split()
        tables[kind][(int(d), int(pad), int(r), int(i))] = int(v)
    return tables["C"], tables["W"], tables["B"]


@pytest.mark.parametrize("pad", [0, O.ATTN_ROW_PAD])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_copies_stores_and_reads_agree_on_one_layout(layouts, d, pad):
    """Every row's words land on distinct words inside the bytes q_bytes reserves (nothing overwritten, nothing
    outside; schedule.attn_smem_bytes reserves the padded size in every build), and row r's word w lies in the chunk
    q_chunk gives its 16-byte copy: the cp.async path (chunks), the register path (words) and the fragment reads
    (words) see one layout. Unpadded, it is the plain [rows][d] one."""
    chunks, words, nbytes = layouts
    placed = [words[(d, pad, r, w)] for r in range(ROWS) for w in range(d // 2)]
    assert len(set(placed)) == len(placed) and min(placed) >= 0
    assert 4 * (max(placed) + 1) <= nbytes[(d, pad, 0, 0)] == ROWS * (d + pad) * 2
    for r in range(ROWS):
        for w in range(d // 2):
            assert words[(d, pad, r, w)] == 4 * chunks[(d, pad, r, w // 4)] + w % 4
            if not pad:
                assert words[(d, pad, r, w)] == r * d // 2 + w
    # the host reserves the kernel's ring (csrc/mk_attention.cuh `ring`) with Q at its padded size
    from megakernel.kernel.schedule import attn_smem_bytes
    ring = O.ATTN_MAX_STAGES * 2 * O.ATTN_CHUNK * (d + O.ATTN_ROW_PAD) * 2 + nbytes[(d, pad, 0, 0)] + \
        O.ATTN_TABLE_SLOTS * 4
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
    fragment load is an 8-way conflict: what MK_ATTN_Q_PAD=0 builds pay, 2 * d / 16 times per warp per chunk."""
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
