"""The engine, in the order a request meets it.

llm_engine (add_request / step / abort) -> scheduler (who runs, how many tokens) ->
block_manager (paged KV memory, prefix cache) -> model_runner (one flat forward, sampling)
-> kv_cache (where attention keeps keys and values). `generate` holds the two simple
loops (no cache, contiguous cache) that the lessons start from and the tests compare with.
"""
