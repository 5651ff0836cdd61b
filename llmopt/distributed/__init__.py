"""Tensor and pipeline parallelism: one model split over several processes.

- `parallel_state`: the ranks, their process groups (gloo on CPU, NCCL on CUDA) and where
  each rank sits in the grid of `tensor_parallel_size` x `pipeline_parallel_size`;
- `sharding`: Megatron-style tensor parallelism, the decoder's matrices cut by heads, by
  the MLP's intermediate dimension and by vocabulary, one all-reduce per row-parallel layer;
- `pipeline`: the layers cut into stages, activations passed from stage to stage;
- `worker`: one rank's shard of the model and of the paged KV pool, and its step loop;
- `executor`: the driver's side: spawning the workers, sending them each step, shutting
  them down.
"""
