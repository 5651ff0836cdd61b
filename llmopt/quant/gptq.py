"""GPTQ (Frantar et al., 2022): quantize a layer's weight one input column at a time, and
push each column's rounding error onto the columns not yet quantized.

For a linear layer with inputs X, the goal is integers Q minimizing ||W X - Q X||^2. Its
curvature is the Hessian H = 2 X X^T / N, the same for every output row, so the rows are
independent and all of them are quantized together, column by column. After column i is
rounded, the error it leaves is spread over the remaining columns j > i in proportion to
H^-1[i, j] / H^-1[i, i] (the Optimal Brain Surgeon update), so that later columns absorb
what earlier ones lost. The details that make it fast and stable, as in the paper:

- dampening: H += damp_percent * mean(diag H) * I, so the inverse exists;
- the upper Cholesky factor of H^-1 supplies the update rows, computed once;
- lazy batches: errors are applied inside a block of `block_size` columns at once, and to
  the columns after the block in one matmul (the same result, far fewer memory passes);
- mse (the authors' option): each group's grid range is shrunk where that lowers the
  group's own rounding error (`search_params`), rather than spanning its min and max;
- act-order (desc_act): columns go in order of decreasing diag(H), the inputs with the
  largest activations first, while many columns are still left to absorb their error.
  A group is then a set of columns in that order, so its members are scattered over the
  input dimension: `g_idx[k]` records each column's group. With static_groups, the group
  grids are fixed up front on the original column order instead, keeping g_idx monotonic.
"""

from __future__ import annotations

import torch

from llmopt.layers.quant.formats import QuantizedWeight
from llmopt.quant.rtn import quant_params, quantize_to_grid, search_params


class GPTQ:
    """One linear layer: gathers its input Hessian, then quantizes its weight."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        k = weight.shape[1]
        self.H = torch.zeros(k, k, dtype=torch.float32, device=weight.device)
        self.num_samples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate H = 2 X X^T / N over calibration inputs x [tokens, in] (running mean)."""
        x = x.reshape(-1, x.shape[-1]).float()
        n = x.shape[0]
        self.H *= self.num_samples / (self.num_samples + n)
        self.num_samples += n
        x = x * (2 / self.num_samples) ** 0.5
        self.H += x.t() @ x

    @torch.no_grad()
    def quantize(self, bits: int, group_size: int, sym: bool = True, damp_percent: float = 0.01,
                 desc_act: bool = False, static_groups: bool = False, block_size: int = 128,
                 min_zero: int = 0, mse: float = 0.0) -> QuantizedWeight:
        W = self.weight.float().clone()              # [out, in]
        n_out, K = W.shape
        G = K if group_size == -1 else group_size
        H = self.H.clone()
        dead = torch.diag(H) == 0                    # inputs that were always 0: their weights do nothing
        H[dead, dead] = 1
        W[:, dead] = 0

        def params(w):   # a group's grid: its min to max, or (mse > 0) the clipped range that rounds best
            return search_params(w, bits, sym, min_zero, mse) if mse else quant_params(w, bits, sym, min_zero)

        if static_groups:                            # every group's grid, from the original column order
            static = params(W.reshape(n_out, K // G, G))
        perm = torch.arange(K, device=W.device)
        if desc_act:
            perm = torch.argsort(torch.diag(H), descending=True)
            W, H = W[:, perm], H[perm][:, perm]

        H += damp_percent * torch.mean(torch.diag(H)) * torch.eye(K, device=W.device)
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

        Q = torch.zeros_like(W, dtype=torch.int32)
        scales = torch.zeros(K // G, n_out, device=W.device)
        zeros = torch.zeros(K // G, n_out, dtype=torch.int32, device=W.device)
        g_idx = torch.zeros(K, dtype=torch.int32, device=W.device)
        for i1 in range(0, K, block_size):
            i2 = min(i1 + block_size, K)
            W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
            Err1 = torch.zeros_like(W1)
            for i in range(i2 - i1):
                col = i1 + i
                if static_groups:
                    g = int(perm[col]) // G
                    scale, zero = static[0][:, g], static[1][:, g]
                elif col % G == 0:
                    # a new group: its grid from the columns' current values, already
                    # updated by the error of every column quantized before them
                    g = col // G
                    current = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :G]
                    scale, zero = params(current)
                scales[g], zeros[g] = scale, zero
                g_idx[perm[col]] = g
                w, d = W1[:, i], Hinv1[i, i]
                q = quantize_to_grid(w, scale, zero, bits)
                Q[:, col] = q
                err = (w - scale * (q - zero)) / d
                W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]  # spread over the block's rest
                Err1[:, i] = err
            W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]                   # ... and, lazily, everything after

        inv = torch.argsort(perm)
        return QuantizedWeight(Q[:, inv], scales.half(), zeros, g_idx, bits, group_size)
