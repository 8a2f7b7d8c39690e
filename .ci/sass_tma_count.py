#!/usr/bin/env python3
"""Count TMA loads, cp.async loads and warpgroup MMAs in a cubin without cuobjdump (not installed here).

Reads the ELF sections `.text.<kernel>` of a cubin and looks at each 128-bit SASS
word. On sm_90/sm_100 the TMA load (UTMALDG) has opcode 0x5b4 in the low 12 bits;
the gather4 form differs from a plain tile load by one mode bit (bit 84 of the
word, i.e. bit 20 of the high 64 bits), as measured in shared/notes/TMA.md (1.4)
by diffing a gather4 kernel against an otherwise identical 2-D tile kernel.
cp.async (LDGSTS, every width) has opcode 0xfae on sm_80, sm_90a and sm_100a.
Both opcodes were cross-checked against `cuobjdump --dump-sass` (13.2, from the
nvidia-cuda-cuobjdump wheel) on the nvcc 13.0 cubins of debug_tile.cu and
flash_attn_paged_sparse.cu: the same counts per kernel. The warpgroup MMA (HGMMA, sm_90a) has opcode
0xdf0, checked the same way (cuobjdump 13.5) on flash_attn_paged.cu's sm_90a cubin: every HGMMA word
and no other instruction.

usage: sass_tma_count.py FILE.cubin [kernel-name-substring]...
prints one line per kernel whose name holds every substring:
<tma loads> <of which gather4> <cp.async loads> <warpgroup MMAs> <name>
"""
import struct
import sys

UTMALDG = 0x5B4
GATHER4_BIT = 1 << 20  # in the high 64 bits
LDGSTS = 0xFAE
HGMMA = 0xDF0


def sections(path):
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise SystemExit(f"{path}: not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    for h in heads:
        name = names[h[0]:names.index(b"\0", h[0])].decode()
        yield name, data[h[4]:h[4] + h[5]] if h[1] != 8 else b""  # 8 = SHT_NOBITS


def main():
    path = sys.argv[1]
    wants = sys.argv[2:]
    totals = [0, 0, 0, 0]
    for name, blob in sections(path):
        if not name.startswith(".text.") or not all(w in name for w in wants):
            continue
        counts = [0, 0, 0, 0]  # TMA loads, of which gather4, cp.async loads, warpgroup MMAs
        for i in range(0, len(blob) - 15, 16):
            lo, hi = struct.unpack_from("<QQ", blob, i)
            if (lo & 0xFFF) == UTMALDG:
                counts[0] += 1
                counts[1] += bool(hi & GATHER4_BIT)
            elif (lo & 0xFFF) == LDGSTS:
                counts[2] += 1
            elif (lo & 0xFFF) == HGMMA:
                counts[3] += 1
        totals = [t + c for t, c in zip(totals, counts)]
        print("".join(f"{c:6d} " for c in counts) + name[6:])
    print("".join(f"{c:6d} " for c in totals) + "TOTAL")


if __name__ == "__main__":
    main()
