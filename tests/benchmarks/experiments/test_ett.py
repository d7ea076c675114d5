"""benchmarks/experiments/ett.py: the standard ETT split, the windows and the train-only standardization."""

from __future__ import annotations

import os

import pytest
import torch
from ett import SPLITS, default_data_path, load_ett, make_loaders, read_csv

ROWS = 17420  # rows of ETTh1.csv (more than the 14400 the split uses)


def _write_csv(path, n_rows: int, n_ch: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    data = torch.randn(n_rows, n_ch, generator=g, dtype=torch.float64) * torch.tensor([1.0, 5.0, 0.1])[:n_ch] \
        + torch.arange(n_rows, dtype=torch.float64)[:, None] * 1e-3
    with open(path, "w") as f:
        f.write("date," + ",".join(f"c{i}" for i in range(n_ch)) + "\n")
        for i, row in enumerate(data.tolist()):
            f.write(f"2016-07-01 {i:05d}," + ",".join(repr(v) for v in row) + "\n")
    return data


def test_split_sizes_and_history_rows(tmp_path):
    p = tmp_path / "ett.csv"
    data = _write_csv(p, 14500)
    s = load_ett(str(p), seq_len=96, pred_len=96)
    assert s.rows == {"train": 8640, "val": 2880, "test": 2880}
    assert (len(s.train), len(s.val), len(s.test)) == (8640 - 191, 2880 - 95, 2880 - 95)
    s336 = load_ett(str(p), seq_len=96, pred_len=336)
    assert (len(s336.train), len(s336.val), len(s336.test)) == (8640 - 431, 2880 - 335, 2880 - 335)
    z = (data - s.mean) / s.std
    # val and test windows start seq_len rows before their split: the first target is the split's first row
    for split in ("val", "test"):
        x, y = getattr(s, split)[0]
        start = SPLITS[split][0]
        assert torch.allclose(x.double(), z[start - 96:start], atol=1e-5)
        assert torch.allclose(y[0].double(), z[start], atol=1e-5)
        x, y = getattr(s, split)[len(getattr(s, split)) - 1]
        assert torch.allclose(y[-1].double(), z[SPLITS[split][1] - 1], atol=1e-5)  # last target: split's last row
    assert x.shape == (96, 3) and y.shape == (96, 3) and x.dtype == torch.float32


def test_standardization_uses_train_rows_only(tmp_path):
    p = tmp_path / "ett.csv"
    data = _write_csv(p, 14400)
    s = load_ett(str(p))
    train = data[:8640]
    assert torch.allclose(s.mean, train.mean(0))
    assert torch.allclose(s.std, train.std(0, unbiased=False))
    zt = s.train.series.double()
    assert zt.shape == (8640, 3)
    assert torch.allclose(zt.mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(zt.std(0, unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-5)
    # the test rows are transformed with the train statistics (their own mean is not 0: the trend)
    assert float(s.test.series.double()[96:].mean(0)[0]) != pytest.approx(0.0, abs=1e-3)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        load_ett(str(tmp_path / "missing.csv"))
    p = tmp_path / "short.csv"
    _write_csv(p, 1000)
    with pytest.raises(ValueError, match="14400 rows"):
        load_ett(str(p))


def test_test_stride_and_loaders(tmp_path):
    p = tmp_path / "ett.csv"
    _write_csv(p, 14400)
    s = load_ett(str(p), pred_len=96, test_stride=8)
    assert len(s.test) == (2785 + 7) // 8 and len(s.train) == 8449
    tr, va, te = make_loaders(s, 32, seed=1)
    x, y = next(iter(tr))
    assert x.shape == (32, 96, 3) and y.shape == (32, 96, 3)
    assert sum(b[0].shape[0] for b in te) == len(s.test)


@pytest.mark.skipif(not os.path.isfile(default_data_path()), reason="ETTh1.csv not in ../shared/data")
def test_real_etth1():
    names, data = read_csv(default_data_path())
    assert names == ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"] and data.shape == (ROWS, 7)
    s = load_ett(pred_len=96)
    assert (len(s.train), len(s.val), len(s.test)) == (8449, 2785, 2785)
    assert torch.allclose(s.train.series.double().mean(0), torch.zeros(7, dtype=torch.float64), atol=1e-4)
