"""Fixtures of the Mamba block tests."""

from __future__ import annotations

import pytest

from certblocks.testing.mamba_cpu import install_selective_scan_stub


@pytest.fixture
def mamba_ssm_ref(monkeypatch):
    """mamba_ssm.Mamba's slow path on CPU: its CUDA scan replaced by selective_scan_ref (tests only).

    The causal-conv and decode kernels (CUDA / triton) are switched off too, so ``forward`` and ``step``
    take mamba_ssm's plain torch code.
    """
    install_selective_scan_stub()
    ms = pytest.importorskip("mamba_ssm.modules.mamba_simple")
    from mamba_ssm.ops.selective_scan_interface import selective_scan_ref

    monkeypatch.setattr(ms, "selective_scan_fn", selective_scan_ref)
    monkeypatch.setattr(ms, "causal_conv1d_fn", None)
    monkeypatch.setattr(ms, "causal_conv1d_update", None)
    monkeypatch.setattr(ms, "selective_state_update", None)
    return ms
