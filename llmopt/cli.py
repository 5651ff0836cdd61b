"""`llmopt` on the command line: generate, chat, bench and serve (engine flags spelled as vLLM's).

    llmopt generate "def fibonacci(n):" --max-tokens 64 --temperature 0
    llmopt chat --model smollm2
    llmopt bench --workload kv-cache --lengths 128 1024
    llmopt serve --model tiny --port 8000
    llmopt quantize --method gguf --qtype Q4_K_M --model tiny --out tiny-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import sys

from llmopt.bench.flags import add_bench_flags, check_bench_flags
from llmopt.engine_args import add_engine_flags, engine_kwargs
from llmopt.quant.gguf_write import QTYPES as GGUF_QTYPES
from llmopt.server.security import Security, add_security_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmopt", description="llmopt inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_flags(gen)

    chat = sub.add_parser("chat", help="a conversation in the terminal, through the model's chat template")
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    chat.add_argument("--max-tokens", type=int, default=256, help="per reply")
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.9)
    chat.add_argument("--sampling-seed", type=int, default=None, help="per-reply seed")
    add_engine_flags(chat)
    chat.set_defaults(model="smollm2")

    bench = sub.add_parser("bench", help="measure speed, side by side with the baseline")
    add_bench_flags(bench)
    add_engine_flags(bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (llmopt.server)")
    serve.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    serve.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGINT/SIGTERM, then aborted")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="refuse new requests with 503 + Retry-After while this many wait (default: no bound)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may take from arrival to its last token, then aborted "
                            "(504; default: no deadline)")
    add_security_flags(serve)
    add_engine_flags(serve)

    router = sub.add_parser("router", help="one endpoint in front of a prefill and a decode server "
                                           "(disaggregated prefill / decode)")
    router.add_argument("--prefill", required=True, help="the prefill server's URL (kv_role kv_producer)")
    router.add_argument("--decode", required=True, help="the decode server's URL (kv_role kv_consumer)")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    quant = sub.add_parser("quantize", help="quantize a model's weights (RTN, GPTQ, AWQ, FP8, NF4, GGUF) into a checkpoint")
    quant.add_argument("--model", default="tiny", help="bundled name, shape (gguf with --load-format dummy) or HF folder (full precision)")
    quant.add_argument("--out", required=True, help="folder to write the quantized checkpoint to (gguf: a .gguf file)")
    quant.add_argument("--method", default="gptq", choices=["rtn", "gptq", "awq", "fp8", "nf4", "gguf"])
    quant.add_argument("--qtype", default=None, choices=list(GGUF_QTYPES),
                       help="gguf: the file's type (default Q4_K_M)")
    quant.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="gguf: dummy writes random weights of a shape (e.g. --model llama-3.2-1b), for speed")
    quant.add_argument("--bits", type=int, default=None, help="default 4 (8 for fp8)")
    quant.add_argument("--group-size", type=int, default=None, help="default 128; -1: per output channel")
    quant.add_argument("--format", default=None, choices=["gptq", "awq"],
                       help="checkpoint layout (default: awq for awq, gptq otherwise)")
    quant.add_argument("--calibration-file", default=None, help="calibration text (default: bundled held-out)")
    quant.add_argument("--num-samples", type=int, default=32, help="calibration windows")
    quant.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    quant.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None, help="rtn, gptq")
    quant.add_argument("--desc-act", action=argparse.BooleanOptionalAction, default=None, help="gptq act-order")
    quant.add_argument("--damp-percent", type=float, default=None, help="gptq (default 0.01)")
    quant.add_argument("--static-groups", action=argparse.BooleanOptionalAction, default=None, help="gptq")
    quant.add_argument("--true-sequential", action=argparse.BooleanOptionalAction, default=None, help="gptq")
    quant.add_argument("--zero-point", action=argparse.BooleanOptionalAction, default=None, help="awq")
    quant.add_argument("--version", default=None, help="awq: GEMM")
    quant.add_argument("--rotation", default=None, choices=["hadamard"],
                       help="fold Hadamard rotations into the weights first (QuaRot-style; unties a tied head)")
    quant.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=None,
                       help="nf4: quantize the absmax constants too (default on)")
    quant.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "bench":
            check_bench_flags(args)
            if args.url:
                from llmopt.bench.load import bench_url

                print(bench_url(args))
                return 0
            from llmopt.bench import run_bench

            print(run_bench(args))
            return 0
        if args.command == "serve":
            from llmopt.server import serve

            return serve(engine_kwargs(args), args.host, args.port, args.served_model_name, args.threads,
                         args.shutdown_timeout, security=Security.from_args(args),
                         max_waiting_requests=args.max_waiting_requests, request_timeout=args.request_timeout)
        if args.command == "router":
            from llmopt.server.disagg_router import run_router

            return run_router(args.prefill, args.decode, args.host, args.port)
        if args.command == "quantize":
            return _quantize(args)
    except (ValueError, TypeError) as e:
        print(f"llmopt {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1


def _generate(args) -> int:
    from llmopt import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.sampling_seed, max_tokens=args.max_tokens,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    llm = LLM(**engine_kwargs(args))
    outs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1 or args.max_tokens > 64)
    for o in outs:
        c = o.outputs[0]
        if args.json:
            print(json.dumps({"prompt": o.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason, "ttft_s": o.metrics.ttft,
                              "tpot_s": o.metrics.tpot}))
        else:
            print(o.prompt + c.text)
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr)
    return 0


def _chat(args) -> int:
    """Read a user turn per line, answer it with the whole conversation so far as the prompt,
    streaming the reply as the engine steps. /reset forgets the conversation, /exit (or end of
    input) leaves; Ctrl-C stops the reply being written, not the program."""
    from llmopt import LLM, SamplingParams
    from llmopt.chat import render_chat

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    llm = LLM(**engine_kwargs(args))
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.model} (/reset forgets, /exit leaves)", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(opening)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        text, ids = render_chat(llm.tokenizer, history)
        while len(ids) >= llm.max_model_len and len(history) > len(opening) + 1:
            del history[len(opening):len(opening) + 2]  # forget the oldest exchange to fit the context
            text, ids = render_chat(llm.tokenizer, history)
        reply = _stream_reply(llm, text, ids, params)
        history.append({"role": "assistant", "content": reply})


def _stream_reply(llm, text: str, ids: list[int], params) -> str:
    from llmopt.server.detokenizer import IncrementalDetokenizer

    engine = llm.llm_engine
    rid = f"chat-{llm._counter}"
    llm._counter += 1
    engine.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, params)
    detok = IncrementalDetokenizer(llm.tokenizer, params.skip_special_tokens)
    reply = ""
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                c = out.outputs[0]
                delta = detok.step(c.token_ids, c.text if out.finished else None)
                reply += delta
                print(delta, end="", flush=True)
    except KeyboardInterrupt:
        engine.abort_request(rid)
    print(flush=True)
    return reply


def _quantize(args) -> int:
    from pathlib import Path

    from llmopt.quant import quantize

    if args.method == "gguf":
        return _quantize_gguf(args)
    if args.qtype is not None or args.load_format != "auto":
        flag = "--qtype" if args.qtype is not None else "--load-format"
        raise ValueError(f"{flag} is for --method gguf, not --method {args.method}")
    calibration = None
    if args.calibration_file is not None:
        path = Path(args.calibration_file)
        if not path.is_file():
            raise ValueError(f"--calibration-file {path} does not exist")
        calibration = path.read_text(encoding="utf-8")
    knobs = {k: getattr(args, k) for k in ("sym", "desc_act", "damp_percent", "static_groups",
                                          "true_sequential", "zero_point", "version", "rotation", "double_quant")
             if getattr(args, k) is not None}
    r = quantize(args.model, args.method, args.bits, args.group_size, args.out, calibration=calibration,
                 num_samples=args.num_samples, seq_len=args.seq_len, format=args.format,
                 progress=args.progress, **knobs)
    group = "per channel" if r.group_size == -1 else f"group {r.group_size}"
    print(f"{r.path}: {r.method} {r.bits}-bit, {group}, {r.format} layout; linear weights "
          f"{r.linear_bytes / 2**20:.2f} MiB = {r.linear_bytes_ratio:.1%} of fp16; quantized in {r.seconds:.1f} s")
    return 0


def _quantize_gguf(args) -> int:
    from llmopt.quant.gguf_write import write_gguf

    given = [f"--{k.replace('_', '-')}" for k in ("bits", "group_size", "format", "calibration_file", "sym",
                                                  "desc_act", "damp_percent", "static_groups",
                                                  "true_sequential", "zero_point", "version")
             if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} do not apply to --method gguf; it takes --qtype "
                         f"({', '.join(GGUF_QTYPES)})")
    r = write_gguf(args.model, args.qtype or "Q4_K_M", args.out, progress=args.progress,
                   load_format=args.load_format)
    types = ", ".join(f"{n} {t}" for t, n in sorted(r.tensor_types.items()))
    print(f"{r.path}: GGUF {r.qtype} ({types} tensors), {r.file_bytes / 2**20:.2f} MiB; written in {r.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
