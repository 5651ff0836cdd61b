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
    parallel region then waits for its descheduled thread. The processes a test starts (the GPU
    check's dry run, a CLI, a server without --threads) get the same share through OMP_NUM_THREADS
    and MKL_NUM_THREADS: with the lessons' environment (the repository's conftest.py) they ran two
    MKL threads each, and the dry run took 5 to 7 times its CPU alone. Notebook kernels get the share
    too (tests/browser/lab_server.py), which the lessons' two-thread sections keep to."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        import torch

        share = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(share)


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


@pytest.hookimpl(optionalhook=True)  # without xdist (gpu_check.py's in-process `pytest -m cuda`) it is unknown
def pytest_xdist_make_scheduler(config, log):
    """On two workers (`.ci/run`: `-n 2 --dist loadfile`), the lessons run beside the rest of the
    suite, each lesson a unit of its own (tests/schedule.py)."""
    if config.getvalue("dist") == "loadfile":
        from schedule import LessonsBesideTheRest

        return LessonsBesideTheRest(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.cuda` tests need a CUDA device: skipped without one, so the marker alone says
    it (benchmarks/gpu_check.py runs `pytest -m cuda` first)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The installs of a learner's environments (minutes of pip in fresh venvs) start once the tests
    are collected, when tests that use them are among them, in one background thread: first the
    wheel the browser suite serves the lessons from (tests/fresh_install.py), then Binder's and
    Colab's (tests/test_binder_colab.py). On two workers only the lessons' worker starts them
    (tests/schedule.py sends it both files first); a test that lands elsewhere makes its own, or
    waits for the learner's install under its lock. A failure here is left to the tests: their
    fixtures ask again and fail with the install's output."""
    import threading

    from schedule import LESSONS_WORKER

    config = session.config
    if config.option.collectonly or getattr(config, "workerinput", {}).get("workerid", LESSONS_WORKER) != LESSONS_WORKER:
        return
    uses = lambda name: [i for i in session.items if name in getattr(i, "fixturenames", ())]  # noqa: E731
    learner = bool(uses("learner_env")) and not os.environ.get("LLMOPT_LEARNER_PYTHON")
    if learner:
        from browser.browser_env import unavailable

        learner = unavailable() is None
    installs = next((i.module for i in uses("installs") if hasattr(i.module, "start_installs")), None)
    if not (learner or installs):
        return

    def install() -> None:
        if learner:
            from fresh_install import run_dir, shared_learner_env

            try:
                shared_learner_env(run_dir(config))
            except Exception:  # noqa: BLE001 - the browser fixtures ask again and report it
                pass
        if installs:
            installs.start_installs()

    threading.Thread(target=install, name="learner-installs", daemon=True).start()
