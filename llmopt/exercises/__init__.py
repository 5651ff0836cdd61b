"""Code exercises: pieces of the engine the learner writes, held against the engine's own code.

Each lesson from 01 to 08 asks for one real piece (the KV cache's write, the slot mapping, a
scheduling step, chained block hashes, the speculative accept/resample rule, group-wise RTN,
FP8 e4m3 rounding, an SSE parser). `EXERCISES[name].check(fn)` runs the learner's function on the
cases the engine's implementation answers and returns a result that is true when all match,
with a report of the first that does not; `run_live(fn)` then puts the function into the engine
and runs it. `solution` is a reference answer.

    from llmopt.exercises import EXERCISES
    result = EXERCISES["slot_mapping"].check(my_slots_of)
    print(result)
    if result:
        print(EXERCISES["slot_mapping"].run_live(my_slots_of))
"""

from llmopt.exercises import fp8, kv_cache, paging, prefix, rtn, scheduling, spec, sse
from llmopt.exercises.base import CheckResult, Exercise

EXERCISES: dict[str, Exercise] = {m.EXERCISE.name: m.EXERCISE
                                  for m in (kv_cache, paging, scheduling, prefix, spec, rtn, fp8, sse)}

__all__ = ["EXERCISES", "CheckResult", "Exercise"]
