"""The engine, in the order a request meets it.

llm_engine (add_request / step / abort) -> scheduler (who runs, how many tokens) ->
block_manager (paged KV memory, prefix cache) -> the model runner (llmopt.worker: one flat
forward, sampling; the KV pools) -> stats (trace, metrics). `reference_loops` holds the two
simple loops (no cache, contiguous cache) that the lessons start from and the tests compare with.
"""
