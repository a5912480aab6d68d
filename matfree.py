"""Matrix-free linear algebra on a symmetric operator: what hessian.py does with its Hessian- (or Gauss-Newton-)
vector products, on any `matvec` (a function of one flat float64 vector, or of k of them as the rows of a (k, P)
tensor), so each algorithm is testable against an explicit matrix. Copy it with hessian.py (or alone); it needs
only torch.

    lambda        power_iteration (PyHessian's), lanczos (top-k 'LA', bottom-k 'SA' or by magnitude 'LM', with the
                  Ritz vectors on request; full reorthogonalisation, residual stopping rule)
    tr H          hutchinson (Rademacher probes), hutchpp (Meyer et al. 2021), xtrace (Epperly, Tropp & Webber
                  2024: the smallest error of the three at equal products where the spectrum decays), each with its
                  standard error; `batch` vectors per call of matvec
    density       slq: stochastic Lanczos quadrature (Ghorbani, Krishnan & Xiao, ICML 2019; PyHessian's `density`)

Every public function checks its arguments: a mistake is a ValueError / TypeError naming it."""
import math
import numbers
import time

import torch


# ----------------------------------------------------------------------------- lambda_max
def power_iteration(matvec, v, iters=100, tol=1e-4, *, progress=None):
    """PyHessian's (pyhessian/hessian.py `eigenvalues`): v <- Hv / ||Hv||, the Rayleigh quotient v^T H v as the
    estimate, stop at a relative change |new - old| / (|old| + 1e-6) < tol (PyHessian: 1e-3). Finds the
    eigenvalue of largest magnitude, sign kept. -> (estimate, products used, the estimates after each product)."""
    check_vector(v)
    iters, tol = check_int('iters', iters), check_real('tol', tol)
    check_progress(progress)
    eig, history, start, v = None, [], time.time(), v / v.norm()
    for i in range(iters):
        hv = matvec(v)
        norm, new = torch.stack([hv.norm(), hv @ v]).tolist()  # one read per product; ||v|| = 1
        check_finite(norm + new, f'H v at product {i + 1}')
        if norm == 0:  # H v = 0 for a random v: this block of the Hessian is 0 (e.g. behind a zero head)
            return 0.0, i + 1, history + [0.0]
        change = abs(new - eig) / (abs(eig) + 1e-6) if eig is not None else float('inf')
        eig, v = new, hv / norm
        history.append(eig)
        if progress:
            progress(f'power iteration {i + 1}/{iters} | lambda {eig:.6g} | rel. change {change:.1e} '
                     f'| {time.time() - start:.0f} s')
        if change < tol:
            break
    return eig, len(history), history


def tridiagonal(alpha, beta):  # T: alpha on the diagonal, beta beside it; float64, on the CPU
    if not len(alpha) or len(beta) != len(alpha) - 1:
        raise ValueError(f'tridiagonal needs n >= 1 diagonal and n - 1 off-diagonal entries, got {len(alpha)} and '
                         f'{len(beta)}')
    a, b = torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64)
    return torch.diag(a) + torch.diag(b, 1) + torch.diag(b, -1)


def orthogonalise_(w, V):
    """w minus its components along the rows of V (orthonormal), in place, twice ("twice is enough": Giraud, Langou
    & Rozloznik 2005): Lanczos' full reorthogonalisation (Golub & Van Loan, Sec. 10.3.1), which also removes
    alpha v_j and beta v_{j-1}. A float64 basis: classical, two matrix-vector products; a float32 one: modified,
    coefficients in float64 (a float32 matrix product sums in float32: 1e-6 of lambda)."""
    for _ in range(2):
        if V.dtype == torch.float64:
            w -= V.T @ (V @ w)
        else:
            for b in V:
                b = b.double()
                w -= (b @ w) * b
    return w


WHICH = {'LA': lambda theta: -theta, 'SA': lambda theta: theta, 'LM': lambda theta: -theta.abs()}  # sort keys


def lanczos(matvec, v, k=1, steps=100, tol=1e-4, which='LA', basis_dtype=torch.float64, vectors=False, *,
            progress=None):
    """The k extreme eigenvalues by Lanczos with full reorthogonalisation (Golub & Van Loan, Matrix Computations,
    Alg. 10.1.1 and Sec. 10.3.1; Ghorbani et al. 2019 use the same for the density): after j products,
    H V_j = V_j T_j + beta_j v_{j+1} e_j^T with T_j tridiagonal; the Ritz values theta_i (eigenvalues of T_j)
    approximate H's extremes, and the residual of each Ritz pair is exactly ||H y_i - theta_i y_i|| = beta_j |s_ij|
    (s_ij: the last entry of T_j's i-th eigenvector). Stop when each of the k wanted pairs has a residual
    <= tol |theta_i| (then |theta_i - lambda| <= tol |theta_i| for some eigenvalue lambda), or at an invariant
    subspace (beta ~ 0: the Ritz values are eigenvalues; fewer than k if it is smaller), or after `steps` products.
    which: 'LA' the k largest algebraic (the top of the spectrum: the paper's lambda_max), 'SA' the k smallest
    algebraic (the bottom: lambda_min, negative where the loss is not convex), 'LM' the k largest in magnitude
    (what power iteration converges to). k <= steps (a product gives one Ritz value) and <= len(v). Memory: the
    basis, (products + 1) x P of basis_dtype (float64, or float32 for an fp32 model: its products are only
    fp32-accurate anyway), grown by doubling.
    -> dict(eigenvalues (k, in `which`'s order: 'LA' descending, 'SA' ascending, 'LM' by descending magnitude),
    residuals, products, converged (the stopping rule or an invariant subspace, not `steps`, ended it), history:
    the wanted first eigenvalue after each product, alpha, beta: T's diagonals;
    with vectors=True also vectors: the Ritz vectors y_i = V_j s_i, (k, P) float64 rows, unit norm)."""
    check_vector(v)
    k, steps, tol = check_int('k', k), check_int('steps', steps), check_real('tol', tol)
    if which not in WHICH:
        raise ValueError(f'which must be one of {", ".join(map(repr, WHICH))}, got {which!r}')
    if k > min(steps, len(v)):
        raise ValueError(f'k = {k} eigenvalues need steps >= k (one Ritz value per product) and a vector of >= k '
                         f'entries; got steps = {steps}, {len(v)} entries')
    if basis_dtype not in (torch.float32, torch.float64):
        raise ValueError(f'basis_dtype must be torch.float32 or torch.float64, got {basis_dtype}')
    check_progress(progress)
    rows = min(steps, len(v)) + 1  # the most basis vectors a run can need; allocated as it goes, doubling
    V = torch.empty(min(rows, 33), len(v), dtype=basis_dtype, device=v.device)  # the basis, a row each
    V[0], alpha, beta, history, start = v / v.norm(), [], [], [], time.time()
    for j in range(steps):
        vj = V[j].double()
        w = matvec(vj)
        a = w @ vj
        orthogonalise_(w, V[:j + 1])
        a, b = torch.stack([a, w.norm().double()]).tolist()  # one read per step
        check_finite(a + b, f'H v at Lanczos step {j + 1}')
        alpha.append(a)
        beta.append(b)
        theta, s = torch.linalg.eigh(tridiagonal(alpha, beta[:-1]))  # ascending
        order = WHICH[which](theta).argsort()[:k]
        res = (beta[-1] * s[-1, order]).abs()
        history.append(theta[order[0]].item())
        done = len(order) == k and bool((res <= tol * theta[order].abs()).all())
        invariant = beta[-1] <= 1e-12 * theta.abs().max().item() or j + 1 == len(v)
        if progress:
            progress(f'Lanczos {j + 1}/{steps} | lambda {history[-1]:.6g} | residual/|lambda| '
                     f'{res[0].item() / max(abs(history[-1]), 1e-30):.1e} | {time.time() - start:.0f} s')
        if done or invariant:
            break
        if j + 1 == len(V):  # (a run that converges early never holds the basis of --iters steps)
            V = torch.cat([V, V.new_empty(min(len(V), rows - len(V)), len(v))])
        V[j + 1] = w / beta[-1]
    out = dict(eigenvalues=theta[order].tolist(), residuals=res.tolist(), products=len(alpha),
               converged=done or invariant, history=history, alpha=alpha, beta=beta[:-1])
    if vectors:  # y_i = sum_j s_ji v_j, row by row in float64 (no float64 copy of a float32 basis)
        y = torch.zeros(len(order), len(v), dtype=torch.float64, device=v.device)
        for j, c in enumerate(s[:, order].to(v.device)):
            y += c[:, None] * V[j].double()
        out['vectors'] = y / y.norm(dim=1, keepdim=True)
    return out


# ----------------------------------------------------------------------------- tr H
def rademacher(n, gen, device):  # +-1 with probability 1/2 each, float64, from a CPU generator (the same everywhere)
    if not isinstance(gen, torch.Generator):
        raise TypeError(f'gen must be a torch.Generator, got {type(gen).__name__}')
    return (torch.randint(0, 2, (check_int('n', n),), generator=gen, dtype=torch.float64) * 2 - 1).to(device)


def chunks(matvec, Z, batch=1):  # (i, H z_i.. for `batch` rows of Z from row i): one backward, one all-reduce each
    for i in range(0, len(Z), batch):
        c = Z[i:i + batch].double()
        yield i, matvec(c) if len(c) > 1 else matvec(c[0])[None]


def block_products(matvec, Z, batch=1):  # H z for each row z of Z, float64, `batch` rows per call of matvec
    return torch.cat([hz for _, hz in chunks(matvec, Z, batch)])


def hutchinson(matvec, n, samples=100, seed=0, device='cpu', batch=1, *, progress=None):
    """tr H ~ mean_i z_i^T H z_i, z_i Rademacher (Hutchinson 1990; PyHessian's `trace`): unbiased, variance
    2 (||H||_F^2 - sum_i H_ii^2) per probe. batch: probes per product call (the same probes, as many products).
    -> (estimate, its standard error std(z^T H z) / sqrt(samples), inf for one sample; the samples)."""
    samples, seed, batch = check_int('samples', samples), check_int('seed', seed, 0), check_int('batch', batch)
    check_progress(progress)
    gen, vals = torch.Generator().manual_seed(seed), []
    for i in range(0, samples, batch):
        Z = torch.stack([rademacher(n, gen, device) for _ in range(min(batch, samples - i))])
        vals += (Z * block_products(matvec, Z, batch)).sum(1).tolist()
        for j in range(i, len(vals)):
            check_finite(vals[j], f'z^T H z of probe {j + 1}')
        if progress:
            progress(f'Hutchinson {len(vals)}/{samples} | trace {sum(vals) / len(vals):.6g}')
    t = torch.tensor(vals, dtype=torch.float64)
    return t.mean().item(), (t.std() / math.sqrt(samples)).item() if samples > 1 else math.inf, vals


def hutchpp(matvec, n, products=99, seed=0, device='cpu', batch=1):
    """Hutch++ (Meyer, Musco, Musco & Woodruff, SOSA 2021, Alg. 1): m = products / 3 probes S; Q = orth(H S);
    tr H = tr(Q^T H Q) + Hutchinson on (I - QQ^T) H (I - QQ^T) with m more probes: the top of the spectrum
    exactly, the rest sampled. -> (estimate, standard error). The standard error covers the whole estimate:
    E[estimate | Q] = tr(Q^T H Q) + tr((I - QQ^T) H) = tr H for every Q, so Var(estimate) = E[Var(estimate | Q)],
    which the sampled part's variance / m estimates without bias (tested: its mean square equals the variance over
    seeds; a single s.e. is noisy where Q sometimes misses an outlier, and then more often too small than too large).
    products >= 3; the s.e. is inf for m = 1."""
    m, gen = check_int('products', products, 3) // 3, torch.Generator().manual_seed(check_int('seed', seed, 0))
    S = torch.stack([rademacher(n, gen, device) for _ in range(m)])
    Q = torch.linalg.qr(block_products(matvec, S, batch).T)[0]  # (n, m)
    top = (Q.T * block_products(matvec, Q.T, batch)).sum().item()
    Z = torch.stack([rademacher(n, gen, device) for _ in range(m)])
    Z -= (Z @ Q) @ Q.T
    t = (Z * block_products(matvec, Z, batch)).sum(1)
    check_finite(top + t.sum().item(), 'Hutch++\'s estimate')
    return top + t.mean().item(), (t.std() / math.sqrt(m)).item() if m > 1 else math.inf


def xtrace(matvec, n, products=100, seed=0, device='cpu', batch=1, dtype=torch.float64):
    """XTrace (Epperly, Tropp & Webber, SIAM J. Matrix Anal. Appl. 45(1), 2024; arXiv:2301.07825, Sec. 2): every
    one of the m = products / 2 test vectors serves both the low-rank part and the sampled part. omega_i uniform on
    the sphere of radius sqrt(n), Y = H Omega = Q R; Q_(i) an orthonormal basis of the columns of Y but the i-th;
        t_i = tr(Q_(i)^T H Q_(i)) + omega_i^T (I - Q_(i) Q_(i)^T) H (I - Q_(i) Q_(i)^T) omega_i
    is unbiased (omega_i is independent of Q_(i)), and so is the estimate, their mean; the paper's error estimate is
    their standard error, (sum_i (t_i - t)^2 / (m (m - 1)))^(1/2). Efficiently (its Sec. 2.2): Q_(i) Q_(i)^T =
    Q (I - s_i s_i^T) Q^T, s_i the unit i-th column of R^-T (the direction of range(Y) orthogonal to every other
    column of Y), so m more products H Q give every t_i; the paper's normalisation (its "improved" XTrace) rescales
    each (I - Q_(i) Q_(i)^T) omega_i to the norm sqrt(n - m + 1) of a uniform vector of that complement.
    Memory: two (m, n) blocks of `dtype` (float32 for an fp32 model halves it). -> (estimate, standard error)."""
    m, gen = check_int('products', products) // 2, torch.Generator().manual_seed(check_int('seed', seed, 0))
    if m < 2:
        raise ValueError(f'xtrace needs products >= 4 (two test vectors at least), got {products}')
    Om = torch.randn(m, n, generator=gen, dtype=torch.float64)
    Om = (Om * (math.sqrt(n) / Om.norm(dim=1, keepdim=True))).to(device, dtype)  # rows: the test vectors
    Y, omy = torch.empty_like(Om), torch.empty(m, dtype=torch.float64, device=device)
    for i, hz in chunks(matvec, Om, batch):
        Y[i:i + len(hz)], omy[i:i + len(hz)] = hz, (hz * Om[i:i + len(hz)]).sum(1)  # omega_i^T H omega_i
    Q, R = torch.linalg.qr(Y.T)  # (n, m), (m, m)
    del Y
    G = torch.empty(m, m, dtype=torch.float64, device=device)  # Q^T H Q
    for i, hq in chunks(matvec, Q.T, batch):
        G[i:i + len(hq)] = (hq.to(dtype) @ Q).double()
    G, W, R = (G + G.T).cpu() / 2, (Om @ Q).T.double().cpu(), R.double().cpu()  # W = Q^T Omega: column i w_i
    S = torch.linalg.inv(R).T
    S /= S.norm(dim=0, keepdim=True)  # s_i: the columns
    sw = (S * W).sum(0)  # s_i^T w_i
    C = W - S * sw  # c_i: the coordinates in Q of Q_(i) Q_(i)^T omega_i
    scale = (n - m + 1) / (n - (C * C).sum(0))  # the normalisation, squared: (n - m + 1) / ||(I - P_i) omega_i||^2
    low = G.trace() - (S * (G @ S)).sum(0)  # tr(Q_(i)^T H Q_(i))
    # (I - P_i) omega_i = omega_i - Q c_i: its quadratic form by H, from H omega_i = y_i, Q^T y_i = r_i and G
    rest = omy.cpu() - 2 * (C * R).sum(0) + (C * (G @ C)).sum(0)
    t = low + scale * rest
    check_finite(t.sum().item(), 'XTrace\'s estimate')
    return t.mean().item(), (t.std() / math.sqrt(m)).item()


# ----------------------------------------------------------------------------- density
def slq(matvec, n, steps=80, probes=1, seed=0, device='cpu', vectors=None, batch=1):
    """Spectral density by stochastic Lanczos quadrature (Ghorbani et al. 2019, Sec. 3; Lin, Saad & Yang 2016):
    per probe v (Rademacher, normalised), `steps` Lanczos steps with full reorthogonalisation give T; its
    eigenvalues are the quadrature nodes and the squared first entries of its eigenvectors the weights, so that
    sum_i w_i f(theta_i) = v^T f(H) v exactly for polynomials f of degree < 2 steps. Averaged over probes the
    weights sum to 1 and sum_i w_i theta_i^p estimates tr(H^p) / n. vectors: given probes (a list of flat
    vectors) instead. batch: probes run in lockstep, their products `batch` per call (memory: `batch` bases).
    -> (nodes, weights): flat float64 CPU tensors, PyHessian's eigen_list / weight_list."""
    steps, gen = check_int('steps', steps), torch.Generator().manual_seed(check_int('seed', seed, 0))
    vectors = list(vectors) if vectors is not None else [rademacher(n, gen, device)
                                                          for _ in range(check_int('probes', probes))]
    if not vectors:
        raise ValueError('vectors is empty: give one probe vector at least')
    nodes, weights, batch = [], [], check_int('batch', batch)
    for i in range(0, len(vectors), batch):
        for alpha, beta in lanczos_steps(matvec, torch.stack(vectors[i:i + batch]), steps):
            theta, s = torch.linalg.eigh(tridiagonal(alpha, beta))
            nodes.append(theta)
            weights.append(s[0] ** 2 / len(vectors))
    return torch.cat(nodes), torch.cat(weights)


def lanczos_steps(matvec, V0, steps):
    """Lanczos with full reorthogonalisation from each row of V0 at once (lanczos' recurrence, every step; a run
    that reaches an invariant subspace stops there), one product call per step for the runs still going.
    -> [(alpha, beta)] per row: T's diagonals."""
    b, n = V0.shape
    V = torch.empty(b, min(steps, n) + 1, n, dtype=torch.float64, device=V0.device)
    V[:, 0] = V0 / V0.norm(dim=1, keepdim=True)
    runs, going = [([], []) for _ in range(b)], list(range(b))
    for j in range(min(steps, n)):
        W = matvec(V[going, j]) if len(going) > 1 else matvec(V[going[0], j])[None]
        for w, r in zip(W, list(going)):
            alpha, beta = runs[r]
            alpha.append((w @ V[r, j]).item())
            orthogonalise_(w, V[r, :j + 1])
            beta.append(w.norm().item())
            check_finite(alpha[-1] + beta[-1], f'H v at Lanczos step {j + 1}')
            if beta[-1] <= 1e-12 * max(abs(a) for a in alpha) or j + 1 == min(steps, n):
                going.remove(r)  # an invariant subspace (T's eigenvalues are H's), or the last step
            else:
                V[r, j + 1] = w / beta[-1]
        if not going:
            break
    return [(alpha, beta[:-1]) for alpha, beta in runs]


def density_curve(nodes, weights, grid, sigma):
    """The density on `grid`: each node a Gaussian of std sigma (PyHessian's density_generate smooths the same
    way), sum_i w_i N(x; theta_i, sigma^2)."""
    sigma = check_real('sigma', sigma, positive=True)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in (nodes, weights, grid)) or \
            nodes.shape != weights.shape:
        raise ValueError('nodes and weights must be 1-D tensors of one length (slq), grid a 1-D tensor')
    g = torch.exp(-(grid[:, None] - nodes[None]) ** 2 / (2 * sigma ** 2)) / (sigma * math.sqrt(2 * math.pi))
    return g @ weights


# ----------------------------------------------------------------------------- what every public function checks
def check_int(name, v, least=1):  # an int >= least (a bool is refused: True would count as 1)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f'{name} must be an int, got {type(v).__name__} {v!r}')
    if v < least:
        raise ValueError(f'{name} must be >= {least}, got {v}')
    return int(v)


def check_real(name, v, positive=False):  # a finite number >= 0 (positive: > 0)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f'{name} must be a number, got {type(v).__name__} {v!r}')
    if not (math.isfinite(v) and (v > 0 if positive else v >= 0)):
        raise ValueError(f'{name} must be a finite number {"> 0" if positive else ">= 0"}, got {v}')
    return float(v)


def check_vector(v, name='v'):  # a non-empty 1-D float tensor, finite and not 0 (a start or probe vector)
    if not (isinstance(v, torch.Tensor) and v.dim() == 1 and v.is_floating_point() and len(v)):
        raise TypeError(f'{name} must be a non-empty flat (1-D) float tensor, got '
                        + (f'{v.dtype} of shape {tuple(v.shape)}' if isinstance(v, torch.Tensor) else type(v).__name__))
    if not (math.isfinite(norm := v.norm().item()) and norm > 0):
        raise ValueError(f'{name} must be finite and non-zero, its norm is {norm}')


def check_progress(progress):  # None or a function of one string (a wrong value would fail at the first step)
    if progress is not None and not callable(progress):
        raise TypeError(f'progress must be None or a function of one str, got {type(progress).__name__}')


def check_finite(value, what):  # a product read back: inf / nan would go on as a number
    if not math.isfinite(value):
        raise ValueError(f'{what} is not finite ({value}): inf/nan in the operator (the model, the images, or '
                         'an overflow of its dtype)')
