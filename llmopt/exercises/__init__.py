"""Code exercises: pieces of the engine the learner writes, held against the engine's own code.

Each lesson from 01 to 15 asks for one real piece (the KV cache's write, the slot mapping, a
scheduling step, chained block hashes, the speculative accept/resample rule, group-wise RTN,
FP8 e4m3 rounding, an SSE parser, a linear's tensor-parallel shard, MoE routing, a circuit
breaker, GGUF Q4_1 blocks from their bytes, a grammar's token bitmask, int4 keys per channel, a
claim's verdict). `EXERCISES[name].check(fn)` runs the learner's function on the cases the
engine's implementation answers and returns a result that is true when all match, with a report
of the first that does not; `run_live(fn)` then puts the function into the engine and runs it.
`solution` is a reference answer.

    from llmopt.exercises import EXERCISES
    result = EXERCISES["slot_mapping"].check(my_slots_of)
    print(result)
    if result:
        print(EXERCISES["slot_mapping"].run_live(my_slots_of))
"""

from llmopt.exercises import (
    bitmask,
    breaker,
    fp8,
    int_kv,
    kv_cache,
    moe_route,
    paging,
    prefix,
    q4_1,
    rtn,
    scheduling,
    spec,
    sse,
    tp_shard,
    verdict,
)
from llmopt.exercises.base import CheckResult, Exercise

# in the order of the lessons
EXERCISES: dict[str, Exercise] = {m.EXERCISE.name: m.EXERCISE
                                  for m in (kv_cache, paging, scheduling, prefix, spec, rtn, fp8, sse,
                                            tp_shard, moe_route, breaker, q4_1, bitmask, int_kv, verdict)}

__all__ = ["EXERCISES", "CheckResult", "Exercise"]
