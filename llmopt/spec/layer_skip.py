"""Self-speculative decoding by early exit (LayerSkip, Elhoushi et al. 2024, arXiv:2404.16710;
also Draft & Verify, Zhang et al. 2023, arXiv:2309.08168): the draft is the target itself,
cut after its first `exit_layer` layers and read out through the target's own final norm
and LM head. No second model, no second tokenizer, no extra weights.

The draft's KV for layers 0..exit_layer-1 is exactly what the target computes for those
layers (same weights, same inputs), so the draft needs no cache of its own: it writes into
the target's pool, in the lookahead slots the engine allocated for the drafts, and every
token the target has verified already has all its layers cached. Verification then
recomputes the draft positions through every layer, overwriting those slots; rejected
positions are overwritten later like any stale slot. (LayerSkip's paper reuses the draft's
KV and exit-layer state in verification too; recomputing keeps the target's path unchanged,
so greedy output is the plain engine's by construction.)

It only pays if the first layers' guess often matches the whole model's: LayerSkip trains
for that (layer dropout plus an early-exit loss); a model trained without it, like SmolLM2,
mostly disagrees with itself after a few layers, which `llmopt bench`-style measurements
in lesson 10 show honestly.
"""

from __future__ import annotations

import torch

from llmopt.layers.attention import AttentionMetadata
from llmopt.layers.sampler_cpu import draw_token, greedy_tokens, sampling_probs
from llmopt.sequence import Sequence


class LayerSkipProposer:
    method = "layer_skip"
    writes_kv = True  # into the target's own pool: the lookahead slots must exist first

    def __init__(self, target, exit_layer: int, device):
        self.target, self.exit_layer, self.device = target, exit_layer, device
        self.kv_cache = None  # the target's pool, handed over by bind()

    def lookahead_slots(self, k: int) -> int:
        return k

    def bytes_per_block(self, block_size: int) -> int:
        return 0  # no pool of its own

    def bind(self, num_blocks: int, block_size: int, target_kv_cache, compiled: bool = False,
             kernels: bool = True) -> None:
        self.block_size, self.kv_cache = block_size, target_kv_cache

    def observe(self, step) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass  # its KV lives in the target's pool, copied already

    def _draft_logits(self, ids: torch.Tensor, meta: AttentionMetadata, last: torch.Tensor) -> torch.Tensor:
        """The first exit_layer layers, then the target's final norm and head."""
        m = self.target.model
        x = m.embed_tokens(ids)
        for layer in m.layers[:self.exit_layer]:
            x = layer(meta, x, m.rotary_emb, self.kv_cache)
        return self.target.compute_logits(m.norm(x[last]))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], block_tables: dict[str, list[int]]):
        bs = self.block_size
        tables = [block_tables[s.request_id] for s in seqs]
        # the target has cached every token but the newest, which it has not yet seen
        starts = [len(s) - 1 for s in seqs]
        feeds = [[s.token_ids[-1]] for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:
            meta = AttentionMetadata.paged([tables[i] for i in active], [starts[i] for i in active],
                                           [1] * len(active), bs, self.device)
            ids = torch.tensor([feeds[i][0] for i in active], device=self.device)
            logits = self._draft_logits(ids, meta, torch.arange(len(active), device=self.device))
            for row, i in enumerate(active):
                seq = seqs[i]
                if seq.params.greedy:
                    token, q = int(greedy_tokens(logits[row])), None
                else:
                    q = sampling_probs(logits[row][None], seq.params)[0]
                    token = draw_token(q, seq.generator)
                drafts[i].append(token)
                qs[i].append(q)
                starts[i] += 1
                feeds[i] = [token]
            active = [i for i in active if len(drafts[i]) < ks[i]]
        return [(d, None if s.params.greedy else torch.stack(q)) for s, d, q in zip(seqs, drafts, qs)]
