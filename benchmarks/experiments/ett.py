"""ETTh1 / ETTh2 for the forecasting benchmarks: the standard 12/4/4-month split, standardized.

The data is read from ``../shared/data/ETTh1.csv`` relative to the repository root (or a path
given with ``--data``); it is never copied into the repository.

Split (the standard ETT-hour loaders of Informer / Autoformer / PatchTST): 12 months of train,
4 of validation, 4 of test, 30-day months of 24 hourly rows::

    train rows [0, 8640)   val rows [8640, 11520)   test rows [11520, 14400)

Validation and test windows start ``seq_len`` rows before their split so that the first target
of each split is its first row.  Every channel is standardized with the mean and standard
deviation of the *train* rows only (``ddof = 0``, as sklearn's ``StandardScaler``).  A sample is
``(x, y)`` with ``x`` the ``(seq_len, n_vars)`` input window and ``y`` the ``(pred_len, n_vars)``
targets that follow it (stride 1).  The forecasters are channel-independent: each of the
``n_vars`` series of a window is embedded and forecast on its own inside the model.

Usage::

    python benchmarks/experiments/ett.py [--data PATH] [--pred-len 96]   # prints the split sizes
"""

from __future__ import annotations

import argparse
import csv
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["ETTSplits", "ETTWindows", "SPLITS", "default_data_path", "load_ett", "make_loaders", "read_csv"]

#: Rows of each split (12/4/4 months of 30 days x 24 hours).
MONTH = 30 * 24
SPLITS: Dict[str, Tuple[int, int]] = {
    "train": (0, 12 * MONTH),
    "val": (12 * MONTH, 16 * MONTH),
    "test": (16 * MONTH, 20 * MONTH),
}

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_data_path(name: str = "ETTh1.csv") -> str:
    """``../shared/data/<name>`` relative to the repository root."""
    return os.path.normpath(os.path.join(_REPO, "..", "shared", "data", name))


def read_csv(path: str) -> Tuple[list, torch.Tensor]:
    """Read an ETT csv: ``(column names without 'date', float64 tensor (rows, channels))``.

    Raises:
        FileNotFoundError: no file at ``path`` (the message says where the data is expected).
        ValueError: the file has no data rows or ragged rows.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ETT data not found at {path!r}: pass --data PATH (expected the ETDataset csv "
                                f"with a 'date' column, e.g. {default_data_path()})")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise ValueError(f"{path!r} has no data rows")
    header = rows[0]
    start = 1 if header and header[0].strip().lower() == "date" else 0
    names = header[start:]
    try:
        data = torch.tensor([[float(v) for v in r[start:]] for r in rows[1:] if r], dtype=torch.float64)
    except ValueError as e:
        raise ValueError(f"{path!r}: non-numeric value ({e})") from None
    if data.ndim != 2 or data.shape[1] != len(names):
        raise ValueError(f"{path!r}: rows do not all have {len(names)} values")
    return names, data


class ETTWindows(Dataset):
    """Sliding windows ``(x (seq_len, C), y (pred_len, C))`` over one standardized split (float32).

    Args:
        series: the standardized split rows, ``(rows, C)``, including the ``seq_len`` rows of
            history before the split for val/test.
        seq_len: input length.
        pred_len: horizon.
        stride: step between window starts (1 = every window).
    """

    def __init__(self, series: torch.Tensor, seq_len: int, pred_len: int, stride: int = 1) -> None:
        for n, v in (("seq_len", seq_len), ("pred_len", pred_len), ("stride", stride)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{n} must be an int >= 1, got {v!r}")
        if series.ndim != 2:
            raise ValueError(f"series must be (rows, channels), got shape {tuple(series.shape)}")
        self.series = series.to(torch.float32).contiguous()
        self.seq_len, self.pred_len, self.stride = seq_len, pred_len, stride
        n = series.shape[0] - seq_len - pred_len + 1
        if n < 1:
            raise ValueError(f"a split of {series.shape[0]} rows holds no window of {seq_len} + {pred_len}")
        self.n_windows = n

    def __len__(self) -> int:
        return (self.n_windows + self.stride - 1) // self.stride

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        s = (i % len(self)) * self.stride
        x = self.series[s: s + self.seq_len]
        y = self.series[s + self.seq_len: s + self.seq_len + self.pred_len]
        return x, y


@dataclass
class ETTSplits:
    """The three splits of one ETT file.

    Attributes:
        train, val, test: :class:`ETTWindows`.
        mean, std: the train rows' per-channel mean and standard deviation (float64).
        columns: channel names.
        rows: the number of rows of each split proper (without the history rows).
    """

    train: ETTWindows
    val: ETTWindows
    test: ETTWindows
    mean: torch.Tensor
    std: torch.Tensor
    columns: list
    rows: Dict[str, int]


def load_ett(path: Optional[str] = None, *, seq_len: int = 96, pred_len: int = 96,
             test_stride: int = 1) -> ETTSplits:
    """Load an ETT-hour csv with the standard split, standardized with the train statistics.

    Args:
        path: the csv (default :func:`default_data_path`).
        seq_len: input length (96).
        pred_len: horizon (96 or 336 in the benchmarks).
        test_stride: keep every ``test_stride``-th val/test window (1 = all; quick runs use more).
    """
    names, data = read_csv(path or default_data_path())
    need = SPLITS["test"][1]
    if data.shape[0] < need:
        raise ValueError(f"the standard split needs {need} rows, the file has {data.shape[0]}")
    lo, hi = SPLITS["train"]
    train = data[lo:hi]
    mean = train.mean(0)
    std = train.std(0, unbiased=False)
    if bool((std == 0).any()):
        raise ValueError("a channel is constant over the train split (std 0): cannot standardize")
    z = (data - mean) / std
    parts = {}
    for split, (a, b) in SPLITS.items():
        start = a if split == "train" else a - seq_len
        stride = 1 if split == "train" else test_stride
        parts[split] = ETTWindows(z[start:b], seq_len, pred_len, stride)
    return ETTSplits(parts["train"], parts["val"], parts["test"], mean, std, list(names),
                     {k: b - a for k, (a, b) in SPLITS.items()})


def make_loaders(splits: ETTSplits, batch_size: int = 32, *, seed: int = 0,
                 eval_batch_size: int = 256) -> Tuple[DataLoader, DataLoader, DataLoader]:
    """``(train, val, test)`` loaders; train shuffled by a generator seeded with ``seed``, drop_last."""
    g = torch.Generator().manual_seed(seed)
    train = DataLoader(splits.train, batch_size=batch_size, shuffle=True, drop_last=True, generator=g)
    val = DataLoader(splits.val, batch_size=eval_batch_size, shuffle=False)
    test = DataLoader(splits.test, batch_size=eval_batch_size, shuffle=False)
    return train, val, test


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=default_data_path(), help="ETT csv (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--pred-len", type=int, default=96)
    a = p.parse_args(argv)
    s = load_ett(a.data, seq_len=a.seq_len, pred_len=a.pred_len)
    print(f"{a.data}: channels {s.columns}")
    for k in ("train", "val", "test"):
        print(f"  {k:5s}: {s.rows[k]} rows, {len(getattr(s, k))} windows of {a.seq_len} -> {a.pred_len}")
    print(f"  train mean {[round(float(v), 3) for v in s.mean]}")
    print(f"  train std  {[round(float(v), 3) for v in s.std]}")


if __name__ == "__main__":
    main()
