"""Speculative decoding: cheap proposers guess k tokens, the target checks them in one pass.

- proposers: `ngram` (prompt lookup, no model), `proposers` (a draft model, an EAGLE head, its
  EAGLE-2 trees drafted in `tree`), `layer_skip` (the target's own first layers), `eagle` (the head);
- verification: `rejection_sampler` (a chain) and `tree_sampler` (a tree) keep the target's output
  distribution exact whatever was guessed; `draft_tree` lays a tree out for the target's step;
- `step`: the engine's side, how many drafts a sequence may take and what verification kept.
"""
