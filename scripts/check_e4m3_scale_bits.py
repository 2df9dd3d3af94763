#!/usr/bin/env python3
"""Every non-negative fp32 bit pattern (2^31 of them: zero, subnormals, normals, inf, NaN) through two
forms of the FP8 block scale, in numpy, compared bit for bit (scale and its reciprocal):

- the division form the kernels used until 2026-12-06: ratio = amax / 448 (correctly rounded), the
  exponent of ratio rounded up, the floor 2^-126, then one doubling where amax / s still exceeded 448;
- the bit form `kernels.common.e4m3_scale` uses now: the exponent of amax less 8, plus one where the
  mantissa exceeds 1.75 (0x600000), the floor 2^-126, exponent 128 for inf.

`tests/test_e4m3_scale.py` runs the jitted function against `quant.power_of_two_scale` at every
exponent; this covers all inputs of the numpy forms (about two minutes on two cores). Exits 1 on any
difference."""

import sys
import time

import numpy as np


def _from_k(k, amax):
    scale = ((k + 127).astype(np.uint32) << np.uint32(23)).view(np.float32)
    inv = ((127 - k).astype(np.uint32) << np.uint32(23)).view(np.float32)
    return scale, inv


def division_form(amax):
    ratio = (amax / np.float32(448.0)).astype(np.float32)
    bits = ratio.view(np.uint32)
    k = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + ((bits & 0x7FFFFF) != 0).astype(np.int32)
    scale, inv = _from_k(np.maximum(k, -126), amax)
    over = (amax * inv) > np.float32(448.0)
    return np.where(over, scale * np.float32(2), scale), np.where(over, inv * np.float32(0.5), inv)


def bit_form(amax):
    bits = amax.view(np.uint32)
    e = ((bits >> 23) & 0xFF).astype(np.int32)
    k = e - 135 + ((bits & 0x7FFFFF) > 0x600000).astype(np.int32)
    return _from_k(np.where(e == 255, 128, np.maximum(k, -126)), amax)


def main() -> int:
    start_time, bad, step = time.time(), 0, 1 << 26
    for start in range(0, 1 << 31, step):
        amax = np.arange(start, start + step, dtype=np.uint32).view(np.float32)
        with np.errstate(all="ignore"):
            forms = [tuple(np.where(amax > 0, v, np.float32(1)).astype(np.float32).view(np.uint32) for v in f(amax))
                     for f in (division_form, bit_form)]
        diff = (forms[0][0] != forms[1][0]) | (forms[0][1] != forms[1][1])
        bad += int(diff.sum())
        if diff.any():
            print(f"differ from {start:#x}: amax {amax[diff][:4]}", flush=True)
        print(f"\r{(start + step) / 2**31:6.1%} checked, {bad} differences", end="", flush=True)
    print(f"\n{2**31} bit patterns, {bad} differences, {time.time() - start_time:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
