"""Calibration: the activations GPTQ and AWQ look at, gathered one decoder block at a time.

Calibration text (by default the first part of the bundled held-out text, never the part
perplexity is measured on) is cut into `num_samples` windows of `seq_len` tokens. Their
hidden states walk through the decoder one block at a time: a block's inputs are the
outputs of the blocks before it, so with GPTQ each block sees the errors of the already
quantized ones and can correct for them. Only one block's activations live in memory.
"""

from __future__ import annotations

from numbers import Integral

import torch

from llmopt.layers.attention import AttentionMetadata
from llmopt.worker.kv_cache import NoKVCache


def calibration_windows(tokenizer, calibration, num_samples: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """[num_samples, seq_len] token ids from text(s) or token id lists, cut into consecutive windows."""
    if calibration is None:
        from llmopt.model.registry import heldout_text

        calibration = heldout_text("calibration")
    if isinstance(calibration, str):
        calibration = [calibration]
    if isinstance(calibration, torch.Tensor):
        calibration = calibration.tolist() if calibration.dim() > 1 else [calibration.tolist()]
    if not isinstance(calibration, (list, tuple)) or not calibration:
        raise ValueError("calibration must be a text, a list of texts or a list of token id lists, "
                         f"and not empty; got {calibration!r:.80}")
    ids: list[int] = []
    for item in calibration:
        if isinstance(item, str):
            ids += tokenizer(item, add_special_tokens=False, verbose=False)["input_ids"]
        elif isinstance(item, (list, tuple)) and all(isinstance(t, Integral) and not isinstance(t, bool)
                                                      for t in item):
            ids += [int(t) for t in item]
        else:
            raise ValueError(f"calibration items must be texts or lists of token ids, got {item!r:.80}")
    if not ids:
        raise ValueError("the calibration set is empty (no tokens)")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"calibration token ids must lie in [0, {vocab_size})")
    have = len(ids) // seq_len
    if have < num_samples:
        raise ValueError(f"the calibration set is too short: {len(ids)} tokens make {have} windows of "
                         f"seq_len={seq_len}, and num_samples={num_samples} were asked; give more text "
                         "or lower num_samples / seq_len")
    return torch.tensor(ids[:num_samples * seq_len]).view(num_samples, seq_len)


class BlockInputs:
    """The calibration windows' hidden states at the input of the current decoder block."""

    def __init__(self, model, windows: torch.Tensor):
        n, seq_len = windows.shape
        self.model = model
        device = model.model.embed_tokens.weight.device
        self.cache = NoKVCache()          # every window is a whole sequence: no cache needed
        self.seq_len, self.meta = seq_len, AttentionMetadata.uncached([seq_len] * n, device)
        with torch.no_grad():
            self.hidden = model.model.embed_tokens(windows.flatten().to(device))

    @torch.no_grad()
    def run(self, layer, x: torch.Tensor | None = None) -> torch.Tensor:
        return layer(self.meta, self.hidden if x is None else x, self.model.model.rotary_emb, self.cache)

    @torch.no_grad()
    def attention(self, layer, normed: torch.Tensor) -> torch.Tensor:
        """The block's attention (q/k/v, attention, o) on already-normed inputs of the first
        len(normed) / seq_len windows."""
        n = normed.shape[0] // self.seq_len
        meta = AttentionMetadata.uncached([self.seq_len] * n, normed.device)
        return layer.self_attn(meta, normed, self.model.model.rotary_emb, NoKVCache())

    @torch.no_grad()
    def capture(self, layer, names: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Run the block once; return the inputs each named linear saw, and the block's output."""
        seen: dict[str, torch.Tensor] = {}
        hooks = [layer.get_submodule(n).register_forward_pre_hook(
            lambda _m, args, n=n: seen.__setitem__(n.rsplit(".", 1)[-1], args[0].detach()))
            for n in names]
        try:
            out = self.run(layer)
        finally:
            for h in hooks:
                h.remove()
        return seen, out
