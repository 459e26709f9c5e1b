"""Shared fixtures: tiny models built from configs (no network), the real model when it is cached."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# hypothesis keeps caches in a directory of its own: not in the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "transformers-offload-hypothesis"))

from hypothesis import settings  # noqa: E402

# Property-based tests (hypothesis): the same examples on every run, nothing written to the checkout.
# `TRANSFORMERS_OFFLOAD_FUZZ=large` runs ten times as many, from a random seed, on demand.
settings.register_profile("ci", database=None, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("large", database=None, deadline=None, print_blob=True)

from .helpers import (  # noqa: E402
    FUZZ_SCALE,
    RELEASE_INDEPENDENT,
    TEST_CB_MEMORY_PERCENT,
    TINY_MODELS,
    Store,
    make_tiny,
    record_with_reference,
)

settings.load_profile("large" if FUZZ_SCALE > 1 else "ci")


@pytest.fixture(scope="session", autouse=True)
def _continuous_batching_cache_of_a_test_size():
    """Continuous batching sizes its cache from the machine's memory (transformers 5.x: 60% of it on CPU, about
    14 GiB resident on a 24 GiB machine for a tiny model); two test workers doing it at once were killed for memory.
    Tests cap it at `TEST_CB_MEMORY_PERCENT` (4%) on CPU where `max_memory_percent` is not set, plenty for the
    tiny models' few requests."""
    try:
        from transformers.generation.continuous_batching import initialization
    except ImportError:  # a release without continuous batching, or with another set-up (no cap)
        yield
        return
    resolve = getattr(initialization, "resolve_max_memory_percent", None)
    if resolve is None:
        yield
        return

    def capped(cb_config, *args, **kwargs):
        device = kwargs.get("device")
        if cb_config.max_memory_percent is None and (device is None or torch.device(device).type == "cpu"):
            cb_config.max_memory_percent = TEST_CB_MEMORY_PERCENT
        return resolve(cb_config, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(initialization, "resolve_max_memory_percent", capped)
        yield


@pytest.fixture(params=sorted(TINY_MODELS))
def tiny_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return make_tiny(request.param)


@pytest.fixture
def gpt2() -> torch.nn.Module:
    return make_tiny("gpt2")


@pytest.fixture(params=["memory", "spill"])
def store(request: pytest.FixtureRequest, tmp_path) -> Store:
    """The test runs once per store: its recording kept in memory, and spilled to `tmp_path / "run"`
    and opened again from disk (`store.options()` for the Recorder, `store.reopen(rec)` to read)."""
    return Store(request.param, tmp_path / "run")


@pytest.fixture
def recorded(store: Store):
    """`recorded(model, recorder={...}, spill={...}, **generate_kwargs)`: the call recorded in each
    store beside Hugging Face's reference for it (a `helpers.Recorded`)."""
    return functools.partial(record_with_reference, store=store)


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct and its tokenizer, from the cache `scripts/setup.sh` fills."""
    from transformers_offload import demo_model

    if not demo_model.is_cached():
        reason = (
            f"the real model is not cached in {demo_model.model_dir()}: run `bash scripts/test.sh` "
            "(or `python -m transformers_offload.demo_model`) once"
        )
        if os.environ.get("TRANSFORMERS_OFFLOAD_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return demo_model.load()


def _minutes(item: pytest.Item) -> float:
    """How long a slow test takes, as its `slow` mark says (`minutes=`; 0 where it does not)."""
    return max((mark.kwargs.get("minutes", 0) for mark in item.iter_markers("slow")), default=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The slow tests (a minute or two each, some) first, so that the workers of `-n auto` share them
    # and the short ones fill in after; last, one worker ran the long ones while the other sat idle
    # (the whole suite took 757 s on 2 workers for 1,038 s of tests). Among them the longest first
    # (`@pytest.mark.slow(minutes=N)`): begun late, a 3-minute test left a worker alone to its end.
    items.sort(key=lambda item: ("slow" not in item.keywords, -_minutes(item)))
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rpartition(".")[2] in RELEASE_INDEPENDENT:
            item.add_marker(pytest.mark.release_independent)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


REQUIRE_BROWSER = os.environ.get("TRANSFORMERS_OFFLOAD_REQUIRE_BROWSER") == "1"


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through its driver (Debian's `chromium` and `chromium-driver`, which
    scripts/setup.sh installs)."""
    webdriver = pytest.importorskip("selenium.webdriver", exc_type=ImportError)
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (binary and driver_path):
        if REQUIRE_BROWSER:
            pytest.fail("Chromium or chromedriver is missing: run scripts/setup.sh (apt-get install chromium chromium-driver)")
        pytest.skip("needs Chromium and chromedriver (apt-get install chromium chromium-driver; scripts/setup.sh "
                    "installs them unless TRANSFORMERS_OFFLOAD_SKIP_SYSTEM_PACKAGES=1)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1200,900", "--no-first-run"):
        options.add_argument(argument)
    options.binary_location = binary
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()
