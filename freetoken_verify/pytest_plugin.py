"""The pytest plugin of FreeToken (entry point `pytest11`, or `-p freetoken_verify.pytest_plugin`).

- fixture `freetoken_verify`: `freetoken_verify(models=..., tp=[...], checks=[...], **options)`
  runs `verify.run` and returns its `Report`; `report.assert_ok()` fails the test with the
  failing rows.
- marker `gpu`: skip the test without a CUDA device.
- marker `multi_gpu(n)`: skip the test with fewer than n CUDA devices.
- option `--require-gpus`: such a test fails instead (a GPU gate must not pass on skips).

Nothing here imports torch until a marked test is collected, so installing FreeToken costs other
projects' test sessions nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import pytest

from freetoken_verify.api import Report, run
from freetoken_verify.running.options import DEFAULT_TP


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require-gpus", action="store_true", default=False,
                     help="freetoken: a `gpu` / `multi_gpu(n)` test without its GPUs fails "
                          "instead of skipping (a GPU gate on a runner whose GPUs vanished)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers",
                            "multi_gpu(n): needs at least n CUDA devices (skipped with fewer)")
    config.addinivalue_line("markers", "freetoken_missing_gpus(reason): set by the plugin")


@lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """CUDA devices torch can use; 0 without CUDA (or without a working driver)."""
    # torch only when asked: the plugin is loaded in every pytest session of the project.
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _required_gpus(marker: pytest.Mark) -> int:
    n = marker.args[0] if marker.args else marker.kwargs.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"multi_gpu marker needs a positive GPU count, got {n!r}")
    return n


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `gpu` and `multi_gpu(n)` tests skipped, with the reason, where the GPUs are
    missing: a skip marker set at collection is reported at the test's own file and line (a
    skip raised from a setup hook is reported at the hook)."""
    for item in items:
        needs = [1] if item.get_closest_marker("gpu") else []
        needs += [_required_gpus(m) for m in item.iter_markers("multi_gpu")]
        if not needs:
            continue
        have, want = cuda_device_count(), max(needs)
        if have < want:
            reason = f"needs {want} CUDA device(s), found {have or 'no'} CUDA device(s)"
            if config.getoption("require_gpus"):
                item.add_marker(pytest.mark.freetoken_missing_gpus(reason))
            else:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """With --require-gpus, a test whose GPUs are missing fails (at its own line)."""
    marker = item.get_closest_marker("freetoken_missing_gpus")
    if marker is not None:
        pytest.fail(f"--require-gpus: {marker.args[0]}", pytrace=False)


@pytest.fixture
def freetoken_verify() -> Callable[..., Report]:
    """A callable `(models=(), tp=[1, 2], checks=(), **options) -> Report` running
    `freetoken_verify.run` with the same keywords: `models` bundled case names, checkpoint
    folders or cached hub ids (a string is one model; every bundled case when empty);
    `model=` is the old spelling of one model. Progress goes to stderr, which pytest shows
    for a failing test."""

    def verify_models(models: Sequence[str] | str = (), tp: Sequence[int] | int = DEFAULT_TP,
                      checks: Sequence[str] = (), *, model: str | None = None,
                      **options) -> Report:
        if model is not None:
            if models:
                raise TypeError("give models= or the old model=, not both")
            models = [model]
        options.setdefault("progress", True)
        return run(models=[models] if isinstance(models, str) else models, tp=tp,
                   checks=checks, **options)

    return verify_models
