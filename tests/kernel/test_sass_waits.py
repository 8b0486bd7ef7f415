"""benchmarks/sass_waits.py on real SASS (CPU): the control bits decode to the scoreboards the paged loader's claim
sets and waits on. The snippet is the default build's loader (e9af8e8, text sha1 20203ad360f1; cuobjdump -sass):
each page's branch around the claim's atomic waits on the atomic's scoreboard (the previous lap's claim: the stall the
loader's two page loops, the claim between them, removed in session 23), and the claim is next waited for where `take` moves it into the shuffle's register."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SNIPPET = """\
        /*fbc70*/              @!P4 IADD3 R12, -R12, RZ, RZ ;                                      /* 0x000000ff0c0cc210 */
                                                                                                   /* 0x000fe40007ffe1ff */
        /*fbc80*/                   ISETP.GE.AND P4, PT, R0, R37, PT ;                             /* 0x000000250000720c */
                                                                                                   /* 0x000fe20003f86270 */
        /*fbc90*/               @P0 BRA 0xfbcc0 ;                                                  /* 0x0000000000080947 */
                                                                                                   /* 0x020fd80003800000 */
        /*fbca0*/                   IMAD.MOV.U32 R17, RZ, RZ, 0x1 ;                                /* 0x00000001ff117424 */
                                                                                                   /* 0x000fca00078e00ff */
        /*fbcb0*/                   ATOM.E.ADD.STRONG.GPU PT, R24, desc[UR20][R4.64], R17 ;        /* 0x000000110418798a */
                                                                                                   /* 0x00036400081ee1d4 */
        /*fc6c0*/                   IMAD.MOV.U32 R20, RZ, RZ, R24 ;                                /* 0x000000ffff147224 */
                                                                                                   /* 0x020fe200078e0018 */
"""


def _tool():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_waits.py"
    spec = importlib.util.spec_from_file_location("sass_waits", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # (its dataclass looks its module up)
    spec.loader.exec_module(mod)
    return mod


def test_the_claims_scoreboard_and_its_waits():
    tool = _tool()
    instrs = tool.parse(SNIPPET)
    assert [i.addr for i in instrs] == [0xFBC70, 0xFBC80, 0xFBC90, 0xFBCA0, 0xFBCB0, 0xFC6C0]
    atom = instrs[4]
    assert atom.text.startswith("ATOM.E.ADD.STRONG.GPU") and atom.write_bar == 5
    assert [i.waits_on(5) for i in instrs] == [False, False, True, False, False, True]
    assert all(i.write_bar == 7 for i in instrs if i is not atom)      # (no other result is tracked here)
    (r,) = tool.waiters(instrs, r"ATOM\.E\.ADD")
    assert r["addr"] == 0xFBCB0 and r["bar"] == 5
    assert r["before"] == [(0xFBC90, "@P0 BRA 0xfbcc0")]
    assert r["after"] == [(0xFC6C0, "IMAD.MOV.U32 R20, RZ, RZ, R24")]
    assert tool.waiters(instrs, r"ATOM\.E\.ADD", lo=0xFC000) == []
