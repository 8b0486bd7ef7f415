"""Shared test set-up: the `gpu` marker skips without CUDA; the kernel build's card selection is restored after each
test (a GPU test's backend selects its card's build switches for the process: build.select_card_switches)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_card_switches():
    from megakernel.kernel import build

    saved = build.card_switch_selection()
    yield
    build.select_card_switches(saved)
