"""pytest plugin for bench/device/verify.py: keeps each GPU test module that trains in a
module-scoped fixture on one xdist worker (``--dist loadgroup``).

tests/test_gpu_fp8.py trains its six runs in one module-scoped fixture and
tests/test_gpu_context_parallel.py its two; spread over several workers, each worker would train
them all again. The layouts of tests/test_gpu_layouts.py are one launch per test and are spread
over the workers. Loaded with ``-p tw_device_groups`` (this folder on PYTHONPATH); the test files
themselves are not changed.
"""

from __future__ import annotations

import pytest

GROUPED = {"test_gpu_fp8.py": "gpu_fp8", "test_gpu_context_parallel.py": "gpu_context_parallel"}


@pytest.hookimpl(tryfirst=True)  # before xdist's worker suffixes the node ids of marked tests
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = GROUPED.get(item.path.name)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
