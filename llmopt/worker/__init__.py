"""What runs the model for the engine: the KV pools and the model runner.

They sit below both the engine (one process) and llmopt.distributed (each rank of many), so
that both drive the same pieces: `ModelRunner` turns a scheduled step into one flat forward
and samples; `PagedKVCache` is where its keys and values stay.
"""
