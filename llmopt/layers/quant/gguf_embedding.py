"""The token embedding read from a GGUF file's blocks: each looked-up row dequantized when asked.

A decode step looks up one row per sequence, so the table never needs to exist in float: kept
as the file stores it, Llama 3.2 1B's 128,256 x 2,048 embedding is 279 MB in Q8_0 where a float32
copy is 1 GB. When the embedding is tied to the output head (Llama 3.2, SmolLM2) the head's
`GGUFLinear` and this lookup share one set of blocks.
"""

from __future__ import annotations

import torch
from torch import nn


class GGUFEmbedding(nn.Module):
    """ids -> rows of W in `dtype`, with W a `GGUFBlockWeight` or `KQuantWeight` [vocab, hidden]."""

    def __init__(self, weight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight_blocks, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def extra_repr(self) -> str:
        return f"GGUFEmbedding({self.num_embeddings}, {self.embedding_dim}, {self.weight_blocks.type_name})"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_blocks.rows(ids.reshape(-1).cpu()).dequantize(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim).to(ids.device)
