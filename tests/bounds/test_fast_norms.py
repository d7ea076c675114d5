"""The fast spectral bound (Krylov estimate, Cholesky-verified): never below the exact norm, within its stated factor.

Every case compares with the float64 SVD of the very values the bound read (the tensor cast to float64 exactly).
The stated factor: ``sqrt(1 + FAST_STEPS[0])`` above the tight value when the first factorization succeeds (the
rounding margins add below ``1e-7`` for these shapes), so ``1 + 6e-5`` on the norm.
"""

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from certblocks import bounds
from certblocks.bounds import _fast, norms

FACTOR = 1.0 + 6e-5  # sqrt(1 + 1e-4) plus the rounding margins
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_RANGE = {torch.float16: (1e-3, 1e3), torch.bfloat16: (1e-30, 1e30), torch.float32: (1e-30, 1e30),
          torch.float64: (1e-300, 1e300)}


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]


def _family(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    m, n = shape[-2:]
    k = min(m, n)
    if name == "gaussian":
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    if name == "ill_conditioned":  # singular values from 1 down to 1e-12
        s = torch.logspace(0, -12, k, dtype=torch.float64)
        return _orthogonal(m, gen)[:, :k] @ torch.diag(s) @ _orthogonal(n, gen)[:k, :]
    if name == "rank_3":
        return torch.randn(m, 3, generator=gen, dtype=torch.float64) @ torch.randn(3, n, generator=gen,
                                                                                     dtype=torch.float64)
    if name == "low_rank_plus_noise":
        low = torch.randn(m, 2, generator=gen, dtype=torch.float64) @ torch.randn(2, n, generator=gen,
                                                                                    dtype=torch.float64)
        return low + 1e-3 * torch.randn(m, n, generator=gen, dtype=torch.float64)
    if name == "orthogonal":  # every singular value 1: the Krylov space is invariant at once
        return _orthogonal(max(m, n), gen)[:m, :n]
    if name == "identity_scaled":
        return 3.0 * torch.eye(m, n, dtype=torch.float64)
    if name == "all_ones":  # |W| = W: the worst case of the Gram's rounding bound
        return torch.ones(m, n, dtype=torch.float64)
    if name == "tied_top":  # the two largest singular values equal, a gap below
        s = torch.linspace(0.5, 0.1, k, dtype=torch.float64)
        s[:2] = 1.0
        return _orthogonal(m, gen)[:, :k] @ torch.diag(s) @ _orthogonal(n, gen)[:k, :]
    if name == "one_entry":
        w = torch.zeros(m, n, dtype=torch.float64)
        w[m // 3, n // 2] = -2.5
        return w
    if name == "zero_column":
        w = torch.randn(m, n, generator=gen, dtype=torch.float64)
        w[:, 7] = 0.0
        return w
    raise ValueError(name)


FAMILIES = ("gaussian", "ill_conditioned", "rank_3", "low_rank_plus_noise", "orthogonal", "identity_scaled",
            "all_ones", "tied_top", "one_entry", "zero_column")


def _exact(w: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(w.double(), ord=2).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_fast_bound_is_above_the_svd_norm_and_within_its_factor(family, dtype):
    gen = torch.Generator().manual_seed(FAMILIES.index(family))
    shape = (420, 300) if family != "orthogonal" else (300, 420)  # a wide matrix too
    base = _family(family, shape, gen)
    lo, hi = _RANGE[dtype]
    for scale in (lo, 1.0, hi):
        w = (base * scale / float(base.abs().max())).to(dtype)
        exact = _exact(w)
        got = bounds.op_norm(w, precision="fast")
        assert exact <= got <= exact * FACTOR, (family, dtype, scale, got / exact)
        assert bounds.op_norms(w, precision="fast") == [got]


def test_random_spectra_search():
    # shapes around the thresholds, spectra from flat to steep, clustered tops, heavy-tailed entries
    gen = torch.Generator().manual_seed(21)
    worst = 0.0
    for case in range(24):
        m, n = (int(x) for x in torch.randint(257, 700, (2,), generator=gen))
        k = min(m, n)
        kind = case % 4
        if kind == 0:  # geometric decay at a random rate
            s = torch.logspace(0, -float(torch.rand(1, generator=gen)) * 8, k, dtype=torch.float64)
        elif kind == 1:  # a cluster of near-equal top values
            s = torch.rand(k, generator=gen, dtype=torch.float64) * 0.5
            s[:10] = 1.0 - 1e-6 * torch.rand(10, generator=gen, dtype=torch.float64)
        elif kind == 2:  # heavy tails: a few huge singular values
            s = torch.rand(k, generator=gen, dtype=torch.float64) ** 8 * 1e4
        if kind < 3:
            w = _orthogonal(m, gen)[:, :k] @ torch.diag(s) @ _orthogonal(n, gen)[:k, :]
        else:  # heavy-tailed entries (Cauchy-like)
            w = torch.randn(m, n, generator=gen, dtype=torch.float64) / torch.rand(m, n, generator=gen,
                                                                                  dtype=torch.float64)
        w = w.to(DTYPES[case % 4])
        exact = _exact(w)
        got = bounds.op_norm(w)
        assert exact <= got <= exact * FACTOR, (case, m, n, got / exact)
        worst = max(worst, got / exact)
    assert worst > 1.0


def test_fast_bounds_of_a_batch_one_per_matrix():
    gen = torch.Generator().manual_seed(11)
    w = torch.stack([_family(f, (300, 280), gen) for f in ("gaussian", "orthogonal", "rank_3", "one_entry")])
    w[2] *= 1e-200  # a scaled matrix beside unscaled ones
    w = torch.cat([w, torch.zeros(1, 300, 280, dtype=torch.float64)])
    got = bounds.op_norms(w)
    for g, m in zip(got, w):
        e = _exact(m)
        assert e <= g <= e * FACTOR
    assert got[-1] == 0.0 and bounds.op_norm(w) == max(got)


def test_the_first_step_factors_on_model_shapes():
    # the stated factor holds because the first shift succeeds: check the Krylov estimate is that close
    gen = torch.Generator().manual_seed(3)
    for shape in ((768, 3072), (1024, 1024), (600, 2000)):
        w = torch.randn(*shape, generator=gen) * 0.02
        exact = _exact(w)
        assert exact <= bounds.op_norm(w) <= exact * math.sqrt(1 + norms.FAST_STEPS[0]) * (1 + 1e-7)


def test_non_finite_and_zero_matrices():
    w = torch.randn(300, 300)
    assert bounds.op_norm(torch.zeros(300, 300)) == 0.0
    for bad in (math.nan, math.inf, -math.inf):
        v = w.clone()
        v[3, 4] = bad
        assert bounds.op_norm(v, precision="fast") == math.inf
    batch = torch.stack([w, w])
    batch[1, 0, 0] = math.nan
    finite, nan = bounds.op_norms(batch)
    assert nan == math.inf and _exact(w) <= finite <= _exact(w) * FACTOR


def test_a_shift_below_the_top_eigenvalue_is_refused(monkeypatch):
    # the estimate 3e-4 below lambda_max: the first step (1e-4) must not factor, the second (1e-3) must
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(500, 400, generator=gen, dtype=torch.float64)
    exact = _exact(w)
    lam = exact**2
    calls = []
    real = _fast._cholesky_completes

    def spy(shifted):
        out = real(shifted)
        calls.append(out)
        return out

    monkeypatch.setattr(_fast, "_krylov_top", lambda g, **kw: ([lam * (1 - 3e-4)], 20))
    monkeypatch.setattr(_fast, "_cholesky_completes", spy)
    got = bounds.op_norm(w)
    assert calls == [[False], [False], [True]]  # 1e-4, 1e-4 after the longer run, 1e-3
    assert exact <= got <= exact * math.sqrt((1 - 3e-4) * (1 + 1e-3)) * (1 + 1e-7)


def test_a_start_nearly_orthogonal_to_the_top_vector_is_caught():
    # the Lanczos start is fixed: build a matrix whose top right singular vector is nearly orthogonal to it, the
    # second one 0.3% below: the first estimate stalls at the second value and the factorization must refuse it
    k, m = 400, 600
    start = torch.randn(1, k, generator=torch.Generator().manual_seed(0x5EED), dtype=torch.float32)[0].double()
    start /= start.norm()
    gen = torch.Generator().manual_seed(14)
    basis = torch.linalg.qr(torch.cat([start[:, None], torch.randn(k, k - 1, generator=gen,
                                                                    dtype=torch.float64)], 1))[0]
    v = basis.clone()
    v[:, 0] = 1e-4 * basis[:, 0] + basis[:, 1]  # the top direction: almost no component along the start
    v[:, 1] = basis[:, 0] - 1e-4 * basis[:, 1]
    v = torch.linalg.qr(v)[0]
    s = torch.linspace(0.9, 0.1, k, dtype=torch.float64)
    s[0], s[1] = 1.0, 0.997
    w = _orthogonal(m, gen)[:, :k] @ torch.diag(s) @ v.mT
    exact = _exact(w)
    runs = []
    real = _fast._krylov_top

    def spy(g, **kw):
        out = real(g, **kw)
        runs.append(out[0][0])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fast, "_krylov_top", spy)
        got = bounds.op_norm(w)
    assert exact <= got <= exact * math.sqrt(1 + norms.FAST_STEPS[1]) * (1 + 1e-7)
    assert len(runs) == 2 and runs[0] < 0.999 * exact**2  # the first estimate stalled


@pytest.mark.parametrize("how", ["estimate far too low", "factorization never completes"])
def test_no_step_factors_then_the_tight_path(monkeypatch, how):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(450, 330, generator=gen, dtype=torch.float32)
    exact = _exact(w)
    if how == "estimate far too low":
        monkeypatch.setattr(_fast, "_krylov_top", lambda g, **kw: ([1e-3 * float(g[0].diagonal().max())], 20))
    else:
        monkeypatch.setattr(_fast, "_cholesky_completes", lambda shifted: [False] * shifted.shape[0])
    got = bounds.op_norm(w)
    assert exact <= got <= exact * (1 + 2 * bounds.margin(450, 330) + 1e-13)  # the eigensolver's margin
    monkeypatch.setattr(norms, "EXACT_LIMIT", 100)  # and above the limit, the Gram-power bound
    got = bounds.op_norm(w)
    assert exact <= got <= exact * 330 ** (1 / 256) * 1.001


def test_one_lapack_call_and_the_blocked_factorization_agree(monkeypatch):
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(900, 800, generator=gen, dtype=torch.float64)
    blocked = bounds.op_norm(w)
    monkeypatch.setattr(_fast, "_CHOL_BLOCK", 4096)
    assert bounds.op_norm(w) == blocked and _exact(w) <= blocked <= _exact(w) * FACTOR
    g = _fast._block_gram(w[None])
    shifted = -g
    shifted.diagonal(dim1=-2, dim2=-1).add_(0.999 * float(torch.linalg.eigvalsh(g)[0, -1]))
    monkeypatch.setattr(_fast, "_CHOL_BLOCK", 128)
    assert _fast._cholesky_completes(shifted.clone()) == [False]  # t below lambda_max: no factorization


@pytest.mark.parametrize("k", [100, 613], ids=["one block", "blocks"])
def test_block_gram_is_the_gram_matrix(k):
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(2, 700, k, generator=gen, dtype=torch.float64)
    g = _fast._block_gram(a)
    ref = a.mT @ a
    assert torch.allclose(g, ref, rtol=0, atol=1e-10 * float(ref.abs().max()))
    # exactly symmetric, inside the diagonal blocks too (a BLAS's X^T X alone is not on every CPU)
    assert torch.equal(torch.tril(g, -1), torch.triu(g, 1).mT)
    chunked = _fast._row_chunked_gram(a.float())  # the path of a float32 matrix: by row chunks
    assert torch.equal(torch.tril(chunked, -1), torch.triu(chunked, 1).mT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_gram_read_in_row_chunks_keeps_every_bound(monkeypatch, dtype):
    """A large matrix's float64 Gram matrix is formed from chunks of rows (never a whole float64 copy): the same
    Gram up to rounding, every bound above the SVD norm and within the fast factor, scaled float64 matrices, zero and
    non-finite ones and the tight fallback included."""
    gen = torch.Generator().manual_seed(12)
    w = torch.stack([_family(f, (520, 300), gen) for f in ("gaussian", "ill_conditioned", "all_ones")])
    w[1] *= 1e-200 if dtype == torch.float64 else 1.0
    w = torch.cat([w, torch.zeros(1, 520, 300, dtype=torch.float64)]).to(dtype)
    whole = bounds.op_norms(w)
    seen = []
    upper = _fast._gram_upper_into
    monkeypatch.setattr(_fast, "_gram_upper_into", lambda a, g, accumulate: seen.append(a.shape[1]) or upper(a, g,
                                                                                                             accumulate))
    monkeypatch.setattr(_fast, "GRAM_CHUNK_ELEMENTS", 4 * 300 * 64)  # 64 rows of the batch of 4 at a time
    chunked = bounds.op_norms(w)
    assert max(seen) == 64 and len(seen) >= 520 // 64
    for g_whole, g_chunked, m in zip(whole, chunked, w):
        e = _exact(m)
        assert e <= g_chunked <= e * FACTOR and g_chunked == pytest.approx(g_whole, rel=1e-12, abs=0.0)
    a = w[:1].double()
    g = _fast._row_chunked_gram(a)
    assert torch.allclose(g, a.mT @ a, rtol=0, atol=1e-12 * float((a.mT @ a).abs().max()))
    monkeypatch.setattr(_fast, "_cholesky_completes", lambda shifted: [False] * shifted.shape[0])
    for got, m in zip(bounds.op_norms(w), w):  # the tight fallback reads its matrix again
        e = _exact(m)
        assert e <= got <= e * (1 + 2 * bounds.margin(520, 300) + 1e-13)
    bad = w[:1].clone()
    bad[0, 3, 4] = float("nan")
    assert bounds.op_norms(bad) == [math.inf]


def test_small_and_complex_matrices_take_the_tight_path():
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(300, 200, generator=gen, dtype=torch.float64)  # smaller side <= FAST_MIN
    assert bounds.op_norm(w, precision="fast") == bounds.op_norm(w, precision="tight")
    c = torch.randn(300, 280, generator=gen, dtype=torch.complex128)
    assert bounds.op_norm(c) == bounds.op_norm(c, precision="tight") >= _exact_complex(c)


def _exact_complex(c: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(c, ord=2))


def test_precision_policy_and_its_errors():
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(500, 400, generator=gen, dtype=torch.float64)
    exact = _exact(w)
    assert bounds.get_norm_precision() == "fast"
    fast = bounds.op_norm(w)
    with bounds.norm_precision("tight"):
        assert bounds.get_norm_precision() == "tight"
        tight = bounds.op_norm(w)
        assert bounds.op_norm(w, precision="fast") == fast  # a call's own precision wins
    assert bounds.get_norm_precision() == "fast"
    assert exact <= tight <= exact * (1 + 2 * bounds.margin(500, 400)) and tight < fast <= exact * FACTOR
    with pytest.raises(ValueError, match="precision.*'fast'.*'exact'"):
        bounds.op_norm(w, precision="exact")
    with pytest.raises(ValueError, match="precision"):
        with bounds.norm_precision("cheap"):
            pass
    a, b = w[:, :20], torch.randn(20, 450, generator=gen, dtype=torch.float64)
    assert bounds.product_norm(a, b, precision="tight") <= bounds.product_norm(a, b, precision="fast")
    assert bounds.sandwich_norm(w.mT, w, 0.0, 1.0, precision="tight") <= bounds.sandwich_norm(w.mT, w, 0.0, 1.0)


def test_concurrent_calls_hand_the_precision_to_their_workers():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with bounds.norm_precision("tight"):
            seen = bounds.concurrent_calls([bounds.get_norm_precision] * 4)
        assert seen == ["tight"] * 4
        with ThreadPoolExecutor(1) as pool:  # a plain thread starts from the default
            assert pool.submit(bounds.get_norm_precision).result() == "fast"
    finally:
        torch.set_num_threads(n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_bound_on_cuda(dtype):
    gen = torch.Generator().manual_seed(13)
    for family in ("gaussian", "ill_conditioned", "orthogonal", "all_ones"):
        w = _family(family, (1200, 900), gen).to(dtype)
        exact = _exact(w)
        got = bounds.op_norm(w.cuda())
        assert exact <= got <= exact * FACTOR


def _with_threads(n: int, f):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return f()
    finally:
        torch.set_num_threads(before)


def test_the_work_split_between_threads_gives_the_same_bounds(monkeypatch):
    """With two CPU threads the Gram blocks, the row chunks' conversion, the Cholesky panel and its trailing updates
    are split between two workers: the same bounds, bit for bit, as one thread (row chunks, a scaled float64 matrix
    and the blocked factorization included), in inference mode too, and the split really ran on two workers."""
    gen = torch.Generator().manual_seed(15)
    w = torch.stack([_family(f, (1100, 900), gen) for f in ("gaussian", "tied_top", "all_ones")])
    w[1] *= 1e-200
    cases = [w, w[0].float(), w[2].to(torch.bfloat16).mT]
    split = []
    real_run = _fast._run

    def spy(tasks):
        split.append((_fast._POOL.get() is not None, len(tasks)))
        return real_run(tasks)

    monkeypatch.setattr(_fast, "_run", spy)
    monkeypatch.setattr(_fast, "GRAM_CHUNK_ELEMENTS", 3 * 900 * 256)  # 256 rows of the batch of 3 at a time
    one = _with_threads(1, lambda: [bounds.op_norms(c) for c in cases])
    assert not any(pooled for pooled, _ in split)
    split.clear()
    two = _with_threads(2, lambda: [bounds.op_norms(c) for c in cases])
    assert any(pooled and n > 1 for pooled, n in split)
    assert one == two
    with torch.inference_mode():
        assert _with_threads(2, lambda: bounds.op_norms(cases[0])) == one[0]
    for got, c in zip(two, cases):
        for g, m in zip(got, c.reshape(-1, *c.shape[-2:])):
            e = _exact(m)
            assert e <= g <= e * FACTOR


def test_no_split_inside_concurrent_calls(monkeypatch):
    # concurrent_calls already runs tasks side by side, one thread each: a norm inside one splits nothing
    pools = []
    real_run = _fast._run
    monkeypatch.setattr(_fast, "_run", lambda tasks: pools.append(_fast._POOL.get()) or real_run(tasks))
    gen = torch.Generator().manual_seed(16)
    ws = [torch.randn(700, 600, generator=gen) for _ in range(2)]
    got = _with_threads(2, lambda: bounds.concurrent_calls([lambda w=w: bounds.op_norm(w) for w in ws]))
    assert pools and all(p is None for p in pools)
    assert got == [_with_threads(1, lambda w=w: bounds.op_norm(w)) for w in ws]
