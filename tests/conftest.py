import os

# Triton kernels run on CPU through the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_configure(config):
    """On pytest-xdist's workers (`-n 2`), each worker's torch gets its share of the cores: two
    workers of two threads each on a 2-core machine put four busy threads on two cores, and every
    parallel region then waits for its descheduled thread. What a worker starts (servers, parallel
    workers, notebook kernels) keeps its own setting."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


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
    """The lessons in the browser go first: they are the longest file by far (every lesson, one
    kernel at a time), so on two workers (`-n 2 --dist loadfile`) one worker starts them at once
    while the other takes everything else. `@pytest.mark.cuda` tests need a CUDA device: skipped
    without one, so the marker alone says it (benchmarks/gpu_check.py runs `pytest -m cuda` first)."""
    import torch

    lessons = [i for i in items if i.nodeid.startswith("tests/browser/test_browser_lessons.py::")]
    if lessons:
        items[:] = lessons + [i for i in items if not i.nodeid.startswith("tests/browser/test_browser_lessons.py::")]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The Binder and Colab installs (minutes of pip in fresh venvs, tests/test_binder_colab.py)
    start once the tests are collected, when they are among them, and run beside the others.
    Not on pytest-xdist's workers: each collects every test and does not know which one will run
    that file (there the other worker keeps the CPU busy while this file's installs wait)."""
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return
    for item in session.items:
        module = getattr(item, "module", None)
        if "installs" in getattr(item, "fixturenames", ()) and hasattr(module, "start_installs"):
            module.start_installs()
            return
