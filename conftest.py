"""Repository-wide pytest setup: whatever is collected (tests/, lessons/ alone, one notebook),
nbval's kernels get the environment the lessons' stored outputs were made in."""

import os


def pytest_configure(config):
    """nbval's kernels (when the browser suite does not run the lessons) get the environment the
    stored outputs were made in (scripts/run_lessons.py: same arithmetic on every machine)."""
    if getattr(config.option, "nbval", False):
        import importlib.util
        from pathlib import Path

        path = Path(__file__).resolve().parent / "scripts" / "run_lessons.py"
        spec = importlib.util.spec_from_file_location("run_lessons", path)
        run_lessons = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run_lessons)
        for key, value in run_lessons.KERNEL_ENV.items():
            os.environ.setdefault(key, value)
