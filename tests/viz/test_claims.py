"""The helper lessons say their measurements with: the machine named, the sentence the numbers pick."""

import torch

from llmopt.bench.common import cpu_name, isa
from llmopt.viz.claims import machine, measured, quoted


def test_isa_lists_what_the_flags_offer_best_first():
    assert isa("flags : fpu sse avx2 avx512f avx512_vnni amx_bf16") == "AMX, AVX512_VNNI, AVX-512, AVX2"
    assert isa("flags : fpu sse avx2 fma") == "AVX2"
    assert isa("Features : fp asimd") == "NEON"
    assert isa("flags : fpu sse") == ""


def test_machine_names_the_cpu_and_threads():
    m = machine()
    if torch.cuda.is_available():
        assert torch.cuda.get_device_name(0) in m
    else:
        assert m.startswith(cpu_name()) and m.endswith(f"{torch.get_num_threads()} thread"
                                                       + "s" * (torch.get_num_threads() != 1))


def test_measured_prints_the_sentence_the_numbers_pick(capsys):
    fast, slow = 12.0, 30.0
    said = measured(fast < slow, f"the cache cut a step from {slow:.0f} to {fast:.0f} ms",
                    f"the cache did not cut the step ({slow:.0f} -> {fast:.0f} ms)")
    assert said == f"Measured here ({machine()}): the cache cut a step from 30 to 12 ms"
    assert capsys.readouterr().out == said + "\n"
    assert measured(False, "yes", "no").endswith(": no")


def test_quoted_tables_say_where_they_were_made(capsys):
    said = quoted("| a | b |\n|---|---|", "Intel Xeon (AMX), 2 threads")
    assert said.startswith("Quoted from a run on Intel Xeon (AMX), 2 threads; this notebook runs on ")
    assert said.endswith("| a | b |\n|---|---|") and machine() in said
