"""Proposers: who guesses the next k tokens that the target then checks in one forward.

Three kinds, chosen by `speculative_config["method"]` as in vLLM:

- `NgramProposer`: prompt lookup, no model; its guesses are one-hot.
- `DraftModelProposer`: a small model with the target's tokenizer runs k cheap
  autoregressive steps.
- `EagleProposer`: a one-layer head over the target's own features (llmopt/spec/eagle.py);
  with `speculative_config["tree"]`, `EagleTreeProposer` drafts EAGLE-2 trees (spec/tree.py).

The two model proposers keep KV caches of their own, but not block tables of their own:
their pools have as many blocks as the target's and use the *target's* block tables and
slots (as vLLM does), so allocation, prefix sharing, preemption and the rollback of
rejected drafts all happen once, in the block manager. Each remembers which token ids
it has written KV for; the next proposal starts where that record stops agreeing with
the sequence (after a rejection, a preemption, or for a new request), recomputing only
what is stale. Model proposals sample with the request's own temperature / top-k /
top-p, and hand their distributions q to the rejection sampler (greedy: the argmax).
"""

from __future__ import annotations

import torch

from llmopt.layers.attention import AttentionMetadata, slots_of
from llmopt.layers.sampler_cpu import draw_token, greedy_tokens, sampling_probs
from llmopt.sequence import Sequence
from llmopt.spec.ngram import propose_ngram
from llmopt.spec.tree import check_tree_config, draft_trees, max_tree_nodes
from llmopt.worker.kv_cache import PagedKVCache

Proposal = tuple[list[int], "torch.Tensor | None"]  # draft tokens, their q [k, V] (None = one-hot)


class NgramProposer:
    method = "ngram"
    writes_kv = False  # nothing to allocate before proposing

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max

    def bytes_per_block(self, block_size: int) -> int:
        return 0

    def bind(self, num_blocks: int, block_size: int, target_kv_cache, compiled: bool = False,
             kernels: bool = True) -> None:
        pass

    def propose(self, seqs: list[Sequence], ks: list[int], block_tables: dict[str, list[int]]) -> list[Proposal]:
        return [(propose_ngram(s.token_ids, k, self.lo, self.hi), None) for s, k in zip(seqs, ks)]

    def observe(self, step) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass


class _ModelProposer:
    """Catch up on the tokens this proposer has not seen, then k autoregressive steps."""

    writes_kv = True

    def __init__(self, cfg, num_layers: int, dtype: torch.dtype, device):
        self.cfg, self.num_layers, self.dtype, self.device = cfg, num_layers, dtype, device
        self.fed: dict[str, tuple[int, list[int]]] = {}  # request -> (preemptions seen, tokens in KV)

    def lookahead_slots(self, k: int) -> int:
        """Slots to allocate after the last token before proposing k drafts: one per draft."""
        return k

    def bytes_per_block(self, block_size: int) -> int:
        c = self.cfg
        return PagedKVCache.bytes_per_block(self.num_layers, block_size, c.num_key_value_heads,
                                            c.head_dim, self.dtype)

    def bind(self, num_blocks: int, block_size: int, target_kv_cache, compiled: bool = False,
             kernels: bool = True) -> None:
        """A pool of as many blocks as the target's (its block tables index both); `compiled`:
        the engine runs its steps compiled, and so may this proposer's layers (enable_compiled);
        `kernels`: as the target's pool, attention through the kernels (False: enforce_eager,
        plain torch)."""
        c = self.cfg
        self.block_size = block_size
        self.kv_cache = PagedKVCache(self.num_layers, num_blocks, block_size,
                                     c.num_key_value_heads, c.head_dim, self.dtype, self.device, kernels=kernels)
        if compiled:
            self.enable_compiled()

    def forget(self, request_id: str) -> None:
        self.fed.pop(request_id, None)

    compiled = None  # the proposer's own layers in one C++ call, when the engine runs compiled

    def enable_compiled(self) -> str | None:
        """Draft through the compiled step (llmopt/worker/compiled_decode.py) where it can run
        this proposer's layers on its pool, as the target's decode steps do; returns why not."""
        from llmopt.worker.compiled_decode import CompiledLayers, why_not_layers

        stack = self._stack()
        if stack is None or not hasattr(stack, "layers"):
            return f"{type(self).__name__} drafts with a model that is not a decoder stack"
        reason = why_not_layers(stack.layers, self.dtype, self.kv_cache, self.device)
        if reason is None:
            self.compiled = CompiledLayers(stack.layers, stack.rotary_emb, self.kv_cache, self.dtype)
            self.compiled_stack = stack  # (a capture of these layers: not of a model swapped in later)
        return reason

    def _compiled_runs(self, meta: AttentionMetadata) -> bool:
        return (self.compiled is not None and self._stack() is self.compiled_stack
                and (meta.tree_masks is None or meta.tree_bits is not None))

    def _run_compiled(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The proposer's decoder layers on x, laid out by `meta`, in one C++ call."""
        h = x.contiguous().clone()
        self.compiled.run(h, meta)
        return h

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """The radix cache copied these blocks in the target's pool: the same here."""
        self.kv_cache.copy_blocks(pairs)

    def valid_prefix(self, seq: Sequence) -> int:
        """How many leading tokens of `seq` this proposer's KV still holds correctly."""
        seen, tokens = self.fed.get(seq.request_id, (-1, []))
        if seen != seq.num_preemptions:  # new request, or its blocks were freed by a preemption
            return 0
        ids, n = seq.token_ids, 0
        limit = min(len(tokens), len(ids) - 1)  # the newest token is always fed again
        while n < limit and tokens[n] == ids[n]:
            n += 1
        return n

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], block_tables: dict[str, list[int]]) -> list[Proposal]:
        """k drafts (and their q) per sequence, written into the lookahead slots of `block_tables`."""
        bs = self.block_size
        tables = [block_tables[s.request_id] for s in seqs]
        starts = [self.valid_prefix(s) for s in seqs]
        feeds = [s.token_ids[v:] for s, v in zip(seqs, starts)]
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        prev = None  # the head's own features from the previous round (EAGLE)
        while active:
            # round 1 feeds each sequence's unseen tokens; later rounds one draft token each
            meta = AttentionMetadata.paged([tables[i] for i in active], [starts[i] for i in active],
                                           [len(feeds[i]) for i in active], bs, self.device)
            ids = torch.tensor([t for i in active for t in feeds[i]], device=self.device)
            last = torch.cumsum(torch.tensor([len(feeds[i]) for i in active], device=self.device), 0) - 1
            logits, prev = self.draft_forward(ids, meta, [seqs[i] for i in active], starts, active, prev, last,
                                              block_tables)
            for row, i in enumerate(active):
                token, q = self._pick(logits[row], seqs[i])
                drafts[i].append(token)
                qs[i].append(q)
            keep = [row for row, i in enumerate(active) if len(drafts[i]) < ks[i]]
            prev = prev[keep] if prev is not None else None
            active = [active[row] for row in keep]
            for i in active:
                starts[i] += len(feeds[i])
                feeds[i] = [drafts[i][-1]]
        for s, d in zip(seqs, drafts):
            self.fed[s.request_id] = (s.num_preemptions, self._fed_after(s, d))
        return [(d, None if s.params.greedy else torch.stack(q)) for s, d, q in zip(seqs, drafts, qs)]

    def _pick(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        if seq.params.greedy:
            return int(greedy_tokens(logits)), None
        q = sampling_probs(logits[None], seq.params)[0]
        return draw_token(q, seq.generator), q

    def observe(self, step) -> None:
        pass


class DraftModelProposer(_ModelProposer):
    method = "draft_model"

    def __init__(self, draft_model, dtype, device):
        super().__init__(draft_model.config, draft_model.config.num_hidden_layers, dtype, device)
        self.model = draft_model

    def _stack(self):
        return getattr(self.model, "model", None)

    def draft_forward(self, ids, meta, seqs, starts, active, prev, last, block_tables):
        """One draft forward over `ids`, the new tokens of `seqs` laid out by `meta`; returns the
        logits at rows `last` and what the next call takes as `prev`."""
        if self._compiled_runs(meta):
            stack = self.model.model
            hidden = stack.norm(self._run_compiled(stack.embed_tokens(ids), meta))
        else:
            hidden = self.model(ids, meta, self.kv_cache)
        return self.model.compute_logits(hidden[last]), None

    def _fed_after(self, seq: Sequence, drafts: list[int]) -> list[int]:
        return seq.token_ids + drafts[:-1]  # the last draft was never fed


class EagleProposer(_ModelProposer):
    """The head reads, at position p, the embedding of token p and the target's feature at
    p-1. Features are kept per slot, in a pool beside the KV pools, written whenever the
    target computes a token: so they are shared and freed with the blocks, and a prefix
    cache hit brings its features along."""

    method = "eagle"

    def __init__(self, head, target, dtype, device):
        super().__init__(head.config, 1, dtype, device)
        self.head, self.target = head, target
        # a reduced draft vocabulary (spec/eagle.py): only its rows of the lm_head are read
        weight = getattr(target.lm_head, "weight", None)
        self.draft_weight = None
        if head.draft_vocab is not None and isinstance(weight, torch.Tensor):
            self.draft_weight = weight[head.draft_vocab].contiguous()

    def draft_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """The head's next-token logits over the full vocabulary (-inf outside its draft vocabulary)."""
        if self.draft_weight is None:
            return self.target.compute_logits(feats)
        out = torch.full((feats.shape[0], self.cfg.vocab_size), float("-inf"), device=feats.device)
        out[:, self.head.draft_vocab] = torch.nn.functional.linear(feats, self.draft_weight).float()
        return out

    def bytes_per_block(self, block_size: int) -> int:
        feature = block_size * self.cfg.hidden_size * torch.empty((), dtype=self.dtype).element_size()
        return super().bytes_per_block(block_size) + feature

    def bind(self, num_blocks: int, block_size: int, target_kv_cache, compiled: bool = False,
             kernels: bool = True) -> None:
        super().bind(num_blocks, block_size, target_kv_cache, compiled, kernels)
        self.features = torch.zeros(num_blocks * block_size, self.cfg.hidden_size,
                                    dtype=self.dtype, device=self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks(pairs)
        rows = self.features.view(-1, self.block_size, self.features.shape[-1])
        dev = self.features.device
        rows[torch.tensor([d for _, d in pairs], device=dev)] = rows[torch.tensor([s for s, _ in pairs], device=dev)]

    def observe(self, step) -> None:
        """After a target forward (a StepOutput): keep the features of every token it computed."""
        self.features[step.slot_mapping] = step.hidden.to(self.dtype)

    def draft_forward(self, ids, meta, seqs, starts, active, prev, last, block_tables):
        if prev is None:  # catch-up: true features of positions p-1, from their slots
            slots = []
            for s, i in zip(seqs, active):
                first = starts[i] - 1  # -1 before the first token: no feature (zeros)
                slots += [-1] * (first < 0) + slots_of(block_tables[s.request_id],
                                                        range(max(first, 0), len(s) - 1), self.block_size)
            slots = torch.tensor(slots, device=self.device)
            prev_features = self.features[slots.clamp_min(0)]
            prev_features[slots < 0] = 0
        else:  # drafting: the head's own predicted feature of the previous position
            prev_features = prev
        feats = self.head_forward(ids, prev_features, meta)[last]
        return self.draft_logits(feats), feats

    def head_forward(self, ids: torch.Tensor, prev_features: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The head's predicted features (spec/eagle.py's forward), its layer compiled when it can be."""
        head = self.head
        x = head.fc(torch.cat([self.target.model.embed_tokens(ids), prev_features], dim=-1))
        if self._compiled_runs(meta) and x.dtype == self.dtype:
            return head.norm(self._run_compiled(x, meta))
        return head.norm(head.layers[0](meta, x, head.rotary_emb, self.kv_cache))

    def _stack(self):
        return self.head

    def _fed_after(self, seq: Sequence, drafts: list[int]) -> list[int]:
        return list(seq.token_ids)  # draft positions saw predicted features: recompute them


class EagleTreeProposer(EagleProposer):
    """EAGLE-2: the same head drafts a tree per sequence (llmopt/spec/tree.py), verified in one
    target forward under a tree mask. Sequences whose logits rows are post-processed per
    position (a grammar, min_tokens not yet reached) decode plainly instead."""

    def __init__(self, head, target, dtype, device, depth: int, top_k: int, total_tokens: int):
        super().__init__(head, target, dtype, device)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens

    def budget(self, depth: int) -> int:
        return min(self.total_tokens, max_tree_nodes(self.top_k, depth))

    def lookahead_slots(self, k: int) -> int:
        """The target verifies budget(k) nodes there; the head drafts top_k per depth there first."""
        return max(self.budget(k), self.top_k * (k - 1))

    def observe(self, step) -> None:
        super().observe(step)
        src, dst = step.slot_moves
        if src:  # the accepted paths' features follow their KV into place
            dev = self.features.device
            self.features[torch.tensor(dst, device=dev)] = self.features[torch.tensor(src, device=dev)]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], block_tables: dict[str, list[int]]) -> list[Proposal]:
        """Sets each sequence's spec_tree (None where it decodes plainly); the engine then
        sets spec_token_ids to the returned drafts, the tree's tokens in flat order."""
        picked = [i for i, s in enumerate(seqs) if s.grammar is None and s.params.min_tokens <= len(s.output_token_ids)]
        out: list[Proposal] = [([], None)] * len(seqs)
        trees = draft_trees(self, [seqs[i] for i in picked], [ks[i] for i in picked], self.top_k,
                            [self.budget(ks[i]) for i in picked], block_tables) if picked else []
        for s in seqs:
            s.spec_tree = None
        for i, tree in zip(picked, trees):
            seqs[i].spec_tree = tree
            out[i] = (tree.tokens, None)
        return out


def make_proposer(sc: dict | None, model, model_config, model_path, dtype: torch.dtype, device: torch.device):
    """The proposer `speculative_config` asks for (None: plain decoding), for the target
    `model`; the draft models load here, checked against the target's vocabulary."""
    from llmopt.model.config import ModelConfig
    from llmopt.model.loader import load_model
    from llmopt.model.registry import resolve_model

    if sc is None:
        return None
    if sc["method"] == "ngram":
        return NgramProposer(sc.get("prompt_lookup_min", 1), sc.get("prompt_lookup_max", 4))
    if sc["method"] == "layer_skip":  # the target's own first layers draft (spec/layer_skip.py)
        from llmopt.spec.layer_skip import LayerSkipProposer

        layers = model_config.num_hidden_layers
        if not sc["exit_layer"] < layers:
            raise ValueError(f"speculative_config['exit_layer'] must be in 1..{layers - 1} (the "
                             f"model has {layers} layers), got {sc['exit_layer']}")
        return LayerSkipProposer(model, sc["exit_layer"], device)
    default = {"draft_model": "tiny-draft", "eagle": "tiny-eagle"}[sc["method"]]
    if "model" not in sc and model_path != resolve_model("tiny"):
        raise ValueError(f"speculative_config for method {sc['method']!r} needs 'model' (a draft "
                         f"sharing the target's tokenizer); {default!r} only fits the bundled 'tiny'")
    path = resolve_model(sc.get("model", default))
    if sc["method"] == "eagle":
        from llmopt.spec.eagle import load_eagle_head

        tree = None if sc.get("tree") is None else check_tree_config(sc["tree"], sc["num_speculative_tokens"])
        if tree is not None and any(w is not None for w in model_config.sliding_windows):
            raise ValueError("speculative_config['tree'] needs full attention in every layer; this model "
                             "has sliding-window layers (use a chain: leave out 'tree')")
        head = load_eagle_head(path, model_config, dtype, device)
        if tree is None:
            return EagleProposer(head, model, dtype, device)
        return EagleTreeProposer(head, model, dtype, device, sc["num_speculative_tokens"], **tree)
    draft_cfg = ModelConfig.from_pretrained(path)
    if draft_cfg.vocab_size != model_config.vocab_size:
        raise ValueError(f"draft model {path} has vocab_size {draft_cfg.vocab_size}, the target "
                         f"{model_config.vocab_size}; a draft must share the target's tokenizer")
    return DraftModelProposer(load_model(path, dtype, device), dtype, device)
