"""Speculative decoding: cheap proposers guess k tokens, the target checks them in one pass.

`rejection_sampler` keeps the target's output distribution exact whatever the proposer
guessed; `ngram` is the proposer that needs no model (prompt lookup).
"""
