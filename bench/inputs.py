"""Benchmark inputs: random q1, k1, q2, k2, v (and do) per shape, rotated among several sets
when one set is smaller than 4x L2, and a strided slice of a set for the spot checks."""
from __future__ import annotations

import math

import torch


class InputSet:
    def __init__(self, B, H, Hkv, M, N, D, dtype, device, requires_grad, gen):
        def r(*shape):
            t = torch.randn(*shape, dtype=torch.float32, device=device, generator=gen).to(dtype)
            return t.requires_grad_(requires_grad)
        self.q1 = r(B, H, M, D)
        self.k1 = r(B, Hkv, N, D)
        self.q2 = r(B, H, M, D)
        self.k2 = r(B, Hkv, N, D)
        self.v = r(B, Hkv, N, D)
        self.do = torch.randn(B, H, M, D, dtype=torch.float32, device=device, generator=gen).to(dtype)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.q1, self.k1, self.q2, self.k2, self.v))


def n_sets_for(bytes_per_set, l2_bytes, max_sets=8):
    """Rotate among >= 2 input sets when one set is smaller than 4x L2."""
    if bytes_per_set >= 4 * l2_bytes:
        return 1
    return int(min(max_sets, max(2, math.ceil(4 * l2_bytes / max(bytes_per_set, 1)))))


def make_sets(shape, dtype, env, requires_grad=True, seed=0):
    B, H, Hkv, M, N, D = shape
    gen = torch.Generator(device=env.device)
    gen.manual_seed(seed)
    first = InputSet(B, H, Hkv, M, N, D, dtype, env.device, requires_grad, gen)
    n = n_sets_for(first.nbytes(), env.l2_bytes)
    return [first] + [InputSet(B, H, Hkv, M, N, D, dtype, env.device, requires_grad, gen) for _ in range(n - 1)]


class _Slice:
    """First batch and first h heads of an InputSet (strided views, no copy)."""

    def __init__(self, s, h):
        for n in ("q1", "k1", "q2", "k2", "v"):
            setattr(self, n, getattr(s, n).detach()[:1, :h])

