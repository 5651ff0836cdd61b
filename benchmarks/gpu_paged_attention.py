"""PagedAttention on a CUDA GPU: the compiled Triton kernels against the torch reference.

First a correctness sweep (fp16 and bf16; block sizes 8, 16, 32; GQA groups 1, 3, 4, 8;
scattered blocks, chunked prefill, mixed batches, sliding window), then timings of
the decode and prefill kernels against `paged_attention_ref` at a few batch sizes and
context lengths, printed as a table. On a machine without CUDA it says so and exits 0.

    python benchmarks/gpu_paged_attention.py            # full table
    python benchmarks/gpu_paged_attention.py --quick    # a smaller one
"""

from __future__ import annotations

import argparse
import sys

import torch

from llmopt.kernels import paged_attention as pa

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_batch(seq_lens, query_lens, *, num_kv_heads, group, head_dim, block_size, dtype,
               seed=0):
    """Random pool, each sequence's blocks scattered over it, and the flat queries."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    order = torch.randperm(num_blocks, generator=g, device="cuda").int()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32,
                               device="cuda")
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = order[used:used + nb]
        used += nb
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g,
                    device="cuda").to(dtype)
    query_start_loc = torch.tensor([0] + list(query_lens), device="cuda").cumsum(0).int()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                query_start_loc=query_start_loc,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                scale=head_dim ** -0.5)


def reference(b, window=None):
    return pa.paged_attention_ref(**b, sliding_window=window)


def kernel(b, window=None):
    """The kernel the engine would call: decode when all queries are single tokens."""
    if b["q"].shape[0] == b["seq_lens"].shape[0]:
        return pa.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                         b["seq_lens"], b["scale"], window)
    return pa.paged_attention_prefill(**b, sliding_window=window)


def check() -> int:
    """Every kernel, compiled, against the reference; returns the number of failures."""
    batches = {
        "decode": ([1, 7, 32, 45, 300], [1, 1, 1, 1, 1]),
        "mixed": ([19, 33, 9, 1, 200], [19, 12, 1, 1, 150]),
    }
    # Each (dtype, block_size, group, head_dim) compiles its own kernels: a spread, not a product.
    shapes = [(8, 1, 128), (8, 3, 64), (16, 4, 128), (16, 8, 64), (32, 3, 128), (32, 1, 64)]
    failures = 0
    for dtype in (torch.float16, torch.bfloat16):
        for block_size, group, head_dim in shapes:
            for name, (seq_lens, query_lens) in batches.items():
                b = make_batch(seq_lens, query_lens, num_kv_heads=2, group=group,
                               head_dim=head_dim, block_size=block_size, dtype=dtype)
                for window in (None, 5, 64):
                    out, expected = kernel(b, window).float(), reference(b, window).float()
                    tol = TOL[dtype]
                    if not torch.allclose(out, expected, atol=tol, rtol=tol):
                        failures += 1
                        err = (out - expected).abs().max().item()
                        print(f"FAIL {name} {dtype} block_size={block_size} group={group} "
                              f"head_dim={head_dim} window={window}: max error {err:.2e}")
    print(f"correctness: {'all passed' if failures == 0 else f'{failures} FAILED'}\n")
    return failures


def bench(quick: bool) -> None:
    from triton.testing import do_bench

    # A Llama-3-8B-like layer: 32 query heads on 8 kv heads of 128.
    shape = dict(num_kv_heads=8, group=4, head_dim=128)
    decode_batches = [1, 16, 64] if quick else [1, 8, 32, 64, 128]
    decode_contexts = [1024, 4096] if quick else [512, 2048, 8192]
    prefill_cases = [  # (kind, num_seqs, tokens already cached, new tokens per sequence)
        ("prompt", 1, 0, 1024), ("prompt", 4, 0, 512),
        ("chunk", 2, 2048, 512), ("mixed", 16, 1024, 512),
    ] if quick else [
        ("prompt", 1, 0, 512), ("prompt", 1, 0, 2048), ("prompt", 8, 0, 512),
        ("chunk", 1, 4096, 512), ("chunk", 4, 2048, 256), ("mixed", 32, 2048, 512),
    ]

    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for block_size in (16,) if quick else (16, 32):
            for batch in decode_batches:
                for context in decode_contexts:
                    b = make_batch([context] * batch, [1] * batch, block_size=block_size,
                                   dtype=dtype, **shape)
                    rows.append(("decode", dtype, block_size, batch, f"{context}", b))
            for label, num_seqs, context, new in prefill_cases:
                if label == "mixed":  # one chunk of `new` tokens plus num_seqs - 1 decodes
                    seq_lens = [context + new] + [context] * (num_seqs - 1)
                    query_lens = [new] + [1] * (num_seqs - 1)
                    ctx_label = f"{context}+{new} & {num_seqs - 1} decodes"
                else:
                    seq_lens, query_lens = [context + new] * num_seqs, [new] * num_seqs
                    ctx_label = f"{context}+{new}"
                b = make_batch(seq_lens, query_lens, block_size=block_size, dtype=dtype,
                               **shape)
                rows.append((label, dtype, block_size, num_seqs, ctx_label, b))

    print(f"{'kind':7} {'dtype':9} {'block':>5} {'seqs':>5} {'context+new':>24} "
          f"{'torch ref ms':>13} {'triton ms':>10} {'speedup':>8} {'max err':>9}")
    for kind, dtype, block_size, batch, ctx_label, b in rows:
        err = (kernel(b).float() - reference(b).float()).abs().max().item()
        t_ref = do_bench(lambda: reference(b), warmup=5, rep=50)
        t_kernel = do_bench(lambda: kernel(b), warmup=25, rep=100)
        print(f"{kind:7} {str(dtype).removeprefix('torch.'):9} {block_size:>5} {batch:>5} "
              f"{ctx_label:>24} {t_ref:>13.3f} {t_kernel:>10.3f} {t_ref / t_kernel:>7.1f}x "
              f"{err:>9.1e}")
        del b
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller timing table")
    parser.add_argument("--check-only", action="store_true", help="correctness sweep only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_paged_attention.py needs a CUDA GPU (the CPU check is "
              "tests/test_paged_attention_kernels.py under TRITON_INTERPRET=1); skipping.")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    failures = check()
    if not args.check_only:
        bench(args.quick)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
