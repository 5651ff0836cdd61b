import os

# Triton kernels run on CPU through the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """name -> folder of a random-weight HF checkpoint (see tests/checkpoints.py)."""
    from checkpoints import write_checkpoint

    made = {}

    def get(name):
        if name not in made:
            made[name] = write_checkpoint(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_llm():
    from llmopt import LLM

    return LLM(model="tiny")


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's steps are too small to gain from threads; with other jobs on the CPU,
    a second thread mostly waits (the lessons run on one thread for the same reason)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.cuda` tests need a CUDA device: skipped without one, so the marker alone
    says it (benchmarks/gpu_check.py runs `pytest -m cuda` first on a GPU machine)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
