"""Hadamard matrices: the orthogonal rotations that spread outliers before rounding.

A Hadamard matrix H of order n has entries +-1 and H H^T = n I, so H / sqrt(n) is orthogonal:
it rotates a vector without changing its length or any dot product, while every output is a
sum over all inputs with equal weight. A channel far larger than the rest, rotated, lands in
every channel at 1 / sqrt(n) of its size, and a rounding grid fitted to the largest value fits
all of them. Random signs first (H diag(+-1)) keep a structured input from lining up with H.

Two users: llmopt.quant.rotation folds such rotations into the weights before quantizing them
(QuaRot, SpinQuant), and the FP8 KV cache turns queries, keys and values by one of order
head_dim at run time (`PagedKVCache.rotate`).
"""

from __future__ import annotations

import torch


def _paley(q: int) -> torch.Tensor:
    """Paley's construction I: a Hadamard matrix of order q + 1, for a prime q = 3 (mod 4)."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if i in residues else -1 for i in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jacobsthal
    return s + torch.eye(q + 1, dtype=torch.float64)


def hadamard_matrix(n: int) -> torch.Tensor:
    """An n x n matrix of +-1 with H H^T = n I, for n = 2^a * 12^b * 20^c (Sylvester's doubling,
    Kronecker products of Paley's orders 12 and 20); SmolLM2's 576 = 4 * 12 * 12."""
    h, m = torch.ones(1, 1, dtype=torch.float64), n
    for order, q in ((20, 19), (12, 11)):
        while m % order == 0 and m > 1:
            h, m = torch.kron(h, _paley(q)), m // order
    if m < 1 or m & (m - 1):
        raise ValueError(f"no Hadamard matrix of order {n} is built here: the order must be 2^a * 12^b * 20^c")
    while m > 1:
        h, m = torch.kron(h, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)), m // 2
    return h


def random_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """H diag(s) / sqrt(n) with random signs s: orthogonal, float64."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    return hadamard_matrix(n) * signs[None, :] / n ** 0.5
