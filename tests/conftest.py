"""Fixtures shared by the test modules."""

import pytest


@pytest.fixture(params=["numba", "numpy"])
def kernels(request, monkeypatch):
    """Run a test with the compiled CPU kernels, then with the NumPy path alone (a CPUBackend made
    without kernels= reads PYDTNN_CPU_KERNELS)."""
    monkeypatch.setenv("PYDTNN_CPU_KERNELS", request.param)
    return request.param
