"""Every float32 of a range through the tree kernel's vector expf and through libm's, bit for bit.

    .venv/bin/python scripts/check_vector_expf.py [--low -104] [--high 89]

The AVX2 tree-row kernel (``vllm_treespec.attn.cpu_kernel``) computes libm's ``expf`` 16 lanes at a time with a
replica of glibc's; at start-up it checks a million samples (``vector_expf_agrees``). This walks every float in
[--low, --high] instead (2.2 billion for the default range, about a minute on one core) and prints how many differ
and the first few. Exit status 1 if any does.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

CHUNK = 1 << 24


def bit_ranges(low: float, high: float) -> list[tuple[int, int]]:
    """[start, stop) ranges of float32 bit patterns covering [low, high] (negatives and positives apart)."""
    def bits(x: float) -> int:
        return int(np.float32(x).view(np.uint32))

    ranges = []
    if low < 0:
        ranges.append((0x80000000, bits(low) + 1))  # -0.0 down to low: the bits grow with the magnitude
    if high >= 0:
        ranges.append((0, bits(high) + 1))
    return ranges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--low", type=float, default=-104.0)
    parser.add_argument("--high", type=float, default=89.0)
    args = parser.parse_args()
    from vllm_treespec.attn import cpu_kernel

    started, checked, differ, shown = time.perf_counter(), 0, 0, 0
    for start, stop in bit_ranges(args.low, args.high):
        for first in range(start, stop, CHUNK):
            x = np.arange(first, min(first + CHUNK, stop), dtype=np.uint64).astype(np.uint32).view(np.float32)
            pad = -x.size % 16  # the vector loop takes 16 at a time
            x = np.concatenate([x, np.zeros(pad, np.float32)])
            vector, libm = np.empty_like(x), np.empty_like(x)
            cpu_kernel._vector_and_libm_expf(x, vector, libm)
            bad = np.flatnonzero(vector.view(np.uint32) != libm.view(np.uint32))
            differ += bad.size
            checked += x.size - pad
            for i in bad[: max(0, 5 - shown)]:
                print(f"differs at {x[i]!r}: vector {vector[i]!r}, libm {libm[i]!r}")
                shown += 1
    print(f"{checked} floats in [{args.low}, {args.high}], {differ} differ ({time.perf_counter() - started:.0f} s)")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
