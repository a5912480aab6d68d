"""The curvature of a loss: Hessian-vector products and what they buy. Copy this file; it needs only torch.

    H v           hvp_operator: the exact product, by double backward (Pearlmutter 1994), batches weighted by size,
                  summed over torchrun's processes (one all-reduce of a flat vector per product); k vectors at once
                  through one vmapped backward (one all-reduce for the k)
    G v           ggn_operator: the Gauss-Newton matrix of the cross-entropy, J^T H_out J (Schraudolph 2002)
    lambda        power_iteration (PyHessian's), lanczos (top-k 'LA', bottom-k 'SA' or by magnitude 'LM', with the
                  Ritz vectors on request; full reorthogonalisation, residual stopping rule)
    tr H          hutchinson (Rademacher probes), hutchpp (Meyer et al. 2021), xtrace (Epperly, Tropp & Webber
                  2024: the smallest error of the three at equal products where the spectrum decays), each with its
                  standard error
    density       slq: stochastic Lanczos quadrature (Ghorbani, Krishnan & Xiao, ICML 2019; PyHessian's `density`)

Every vector is a flat float64 tensor of the (block's) parameters, in model.parameters() order, on their device
(k of them: the rows of a (k, P) tensor); the products run in the parameters' dtype and are accumulated in
float64. The algorithms work on any symmetric `matvec` (a function of one flat vector), so each is testable
against an explicit matrix; scipy takes one as a LinearOperator in three lines (docs/geometry.md). Every public
function checks its arguments: a mistake is a ValueError / TypeError naming it, never a number computed from nothing."""
import contextlib
import functools
import math
import numbers
import time

import torch
import torch.distributed as dist
from torch.func import functional_call, grad, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel


def all_sum(t):  # t summed over torchrun's processes, in place (each holds a slice of the images), else t
    return dist.all_reduce(t) or t if dist.is_available() and dist.is_initialized() else t


# ----------------------------------------------------------------------------- H v
HVP_MODES = ('reverse', 'cached', 'forward')


def hvp_operator(model, loss_fn, batches, params=None, mode='reverse'):
    """-> (matvec, P): matvec(v) = H v for the Hessian of the mean loss over every image of `batches` (an iterable of
    (x, y), read once; loss_fn(model(x), y) a batch mean, each batch weighted by its size; under torchrun over every
    process's images) with respect to `params` (default: every trainable parameter; a subset gives that diagonal
    block), P their number of entries. Measured in eval mode (eval_mode: the model and its buffers left as they were).
    Refused up front (one forward over the images and a backward of the first batch; 'cached': while it builds its
    graphs): no images (on any process), a loss that is not finite, a loss that uses none of params (a Hessian of 0).
    mode 'reverse': H v = d/dw <grad L(w), v>, a forward, a backward with create_graph and its backward per batch
        and product; memory: one batch's graph and its gradient's graph.
    mode 'cached': the gradient graphs of every batch built once and kept (PyHessian's single-batch path): each
        product is then only the backward of the backward (~6 forwards of FLOPs, not ~9, by
        torch.utils.flop_counter on ViT-S/16 and Mixer-S/16); memory: every batch's graphs at once.
    mode 'forward': forward-over-reverse, torch.func.jvp of torch.func.grad (the JAX way): exact as well, as many
        FLOPs as 'reverse' and not faster on CPU (README, measured).
    The fused attention kernels have no double backward: the math kernel is used inside (sdpa_kernel)."""
    if mode not in HVP_MODES:
        raise ValueError(f"mode must be 'reverse', 'cached' or 'forward', got {mode!r}")
    params = trainable(model, params)
    if not callable(loss_fn):
        raise TypeError(f'loss_fn must be a function loss_fn(model(x), y), got {type(loss_fn).__name__}')
    batches = list(batches)  # (a generator or a DataLoader: read once, used for every product)
    if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
        raise TypeError('batches must be an iterable of (x, y) pairs')
    batches = [(x, y) for x, y in batches if len(x)]  # (an empty batch weighs 0: its mean loss would be nan)
    dev = params[0].device
    n = all_sum(torch.tensor(float(sum(len(x) for x, _ in batches)), dtype=torch.float64, device=dev)).item()
    if not n:  # (n, and each count below, summed over the processes: every process raises alike)
        raise ValueError('no images in batches' + ' of any process' * (dist.is_available() and dist.is_initialized()))
    # The checks: each batch's loss (cached: with the gradient graphs it keeps; else no grad but the first batch's)
    seen, cached = torch.zeros(2, dtype=torch.float64, device=dev), []  # non-finite losses, params the loss uses
    with sdpa_kernel(SDPBackend.MATH), eval_mode(model):
        for i, (x, y) in enumerate(batches):
            with torch.set_grad_enabled(mode == 'cached' or i == 0):
                loss = loss_fn(model(x), y)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise ValueError(f'loss_fn must return the batch\'s mean loss, a 0-dim tensor; got '
                                 f'{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}')
            seen[0] += ~torch.isfinite(loss.detach())
            if loss.requires_grad:
                grads = torch.autograd.grad(loss * (len(x) / n), params, create_graph=mode == 'cached',
                                            allow_unused=True)
                seen[1] += sum(g is not None for g in grads)
                cached.append(grads)
    bad, used = all_sum(seen).tolist()
    if bad:
        raise ValueError(f'the loss is not finite on {bad:.0f} batch(es) (inf/nan in the model or the images)')
    if not used:
        raise ValueError('the loss does not depend on params: model(x) uses none of them (their Hessian is 0)')
    if mode == 'forward':
        f, w0 = functional(model, params)

    def batch_hvp(x, y, u, grads=None):  # this batch's (weighted) H u, a tuple per parameter (None: zero)
        k = u[0].dim() > params[0].dim()  # u holds k vectors (a leading dim): through one vmapped backward
        if mode == 'forward':
            g = grad(lambda *w: loss_fn(f(x, *w), y), argnums=tuple(range(len(w0))))  # the gradient in the weights
            hvp = lambda *t: jvp(g, w0, t)[1]  # noqa: E731
            return tuple(h * (len(x) / n) for h in (vmap(hvp)(*u) if k else hvp(*u)))
        if grads is None:
            grads = torch.autograd.grad(loss_fn(model(x), y) * (len(x) / n), params, create_graph=True,
                                        allow_unused=True)
        pairs = [(g, v) for g, v in zip(grads, u) if g is not None and g.requires_grad]
        if not pairs:  # the gradient does not depend on these weights: H u = 0
            return [None] * len(params)
        # k vectors: is_grads_batched vmaps the backward of the gradient's graph (right with LayerNorm, unlike a
        # vmapped jacrev: tested against the fp64 Hessian, tests/test_curvature.py)
        return torch.autograd.grad([g for g, _ in pairs], params, grad_outputs=[v for _, v in pairs],
                                   retain_graph=mode == 'cached', allow_unused=True, is_grads_batched=k)

    return flat_operator(model, params, lambda u: ((batch_hvp(None, None, u, g) for g in cached) if mode == 'cached'
                                                   else (batch_hvp(x, y, u) for x, y in batches)))


def flat_operator(model, params, products):
    """-> (matvec, P): matvec(v) for one flat vector v (P,) or k of them as the rows of (k, P), from products(u):
    an iterable of per-batch tuples (a tensor with u's leading dims, or None for zero, per parameter) of the
    vectors u as tensors per parameter; summed in float64 over the batches and torchrun's processes (one all-reduce
    of the flat result per call: for k vectors, one for all k)."""
    sizes, dev = [p.numel() for p in params], params[0].device
    dtype = functools.reduce(torch.promote_types, {p.dtype for p in params})  # v in it once, not per parameter

    def matvec(v):
        lead = v.shape[:-1]
        u = [t.reshape(*lead, *p.shape).to(p.dtype) for t, p in zip(v.to(dtype).split(sizes, -1), params)]
        out = None
        with sdpa_kernel(SDPBackend.MATH), eval_mode(model):  # the fused attention has no double backward, nor jvp
            for hv in products(u):
                flat = torch.cat([p.new_zeros(*lead, p.numel()) if h is None else h.reshape(*lead, -1)
                                  for h, p in zip(hv, params)], -1)
                # float64 across batches: each batch's product is exact to its dtype's rounding, and so stays
                # their sum (fp32 partial sums over many batches would add a rounding per batch)
                out = flat.double() if out is None else out.add_(flat)
        if out is None:  # no images in this process
            out = torch.zeros(*lead, sum(sizes), dtype=torch.float64, device=dev)
        return all_sum(out)

    return matvec, sum(sizes)


def functional(model, params):
    """(f, w): f(x, *w) the model's output on x with `params` replaced by w (the other weights and the buffers as
    they are), w those parameters detached: what torch.func differentiates."""
    names = {id(p): k for k, p in model.named_parameters()}
    keys, rest = [names[id(p)] for p in params], {k: p.detach() for k, p in model.named_parameters()}
    rest.update(model.named_buffers())
    return lambda x, *w: functional_call(model, {**rest, **dict(zip(keys, w))}, (x,)), tuple(p.detach() for p in params)


def ggn_operator(model, batches, params=None):
    """-> (matvec, P) as hvp_operator's, for the generalised Gauss-Newton matrix of the mean cross-entropy over
    `batches` (Schraudolph 2002; Martens, JMLR 2020, Sec. 8.1): G = 1/N sum_n J_n^T (diag(p_n) - p_n p_n^T) J_n,
    J_n the Jacobian of image n's logits in `params`, p_n their softmax (the middle factor: the cross-entropy's
    Hessian in the logits, whatever the label). H without the curvature of the network itself: positive
    semi-definite, H itself for a linear model. Per batch and product J v by forward mode (torch.func.jvp), then
    H_out, then J^T by a backward (torch.func.vjp): no Jacobian is stored. k vectors: vmapped over them (a first
    derivative: the vmapped LayerNorm backward is right there, unlike a vmapped jacrev of a gradient). Eval mode."""
    params, batches = trainable(model, params), list(batches)
    if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
        raise TypeError('batches must be an iterable of (x, y) pairs (y unused: G does not depend on the labels)')
    n = all_sum(torch.tensor(float(sum(len(x) for x, _ in batches)), dtype=torch.float64,
                             device=params[0].device)).item()
    if not n:
        raise ValueError('no images in batches' + ' of any process' * (dist.is_available() and dist.is_initialized()))
    f, w0 = functional(model, params)

    def batch_ggn(x, u):  # sum over this batch's images of J_n^T H_out J_n u, / N
        logits, back = vjp(lambda *w: f(x, *w), *w0)
        p = logits.detach().softmax(-1)

        def ggn(*t):
            ju = jvp(lambda *w: f(x, *w), w0, t)[1]
            return back((p * ju - p * (p * ju).sum(-1, keepdim=True)) / n)
        return vmap(ggn)(*u) if u[0].dim() > params[0].dim() else ggn(*u)

    return flat_operator(model, params, lambda u: (batch_ggn(x, u) for x, _ in batches if len(x)))


def start_vector(params, seed=0):
    """PyHessian's start: randn per parameter in order from a seeded CPU generator (the same on every device and
    process), normalised; flat float64 on the parameters' device."""
    params = list(params)
    if not params or not all(isinstance(p, torch.Tensor) for p in params):
        raise ValueError('params must be a non-empty list of tensors (the parameters the vector is drawn for)')
    gen = torch.Generator().manual_seed(check_int('seed', seed, 0))
    v = torch.cat([torch.randn(p.shape, generator=gen, dtype=p.dtype).flatten() for p in params]).double()
    return (v / v.norm()).to(params[0].device)


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


def hessian_eigenvalue(model, loss_fn, batches, params=None, iters=100, tol=1e-4, seed=0, *, progress=None):
    """The dominant (largest-|lambda|, sign kept) eigenvalue of the Hessian of the mean loss over `batches` by
    PyHessian's power iteration (power_iteration), from start_vector(seed), in eval mode (hvp_operator). (Not finite
    differences of gradients: across ReLU kinks they measure another quantity; on resnet20 at init v^T H v was
    0.015 by double backward, -0.146 by differences of the loss at h = 1e-4, float64.)"""
    iters, tol, seed = check_int('iters', iters), check_real('tol', tol), check_int('seed', seed, 0)
    params = trainable(model, params)
    matvec, _ = hvp_operator(model, loss_fn, batches, params)
    return power_iteration(matvec, start_vector(params, seed), iters, tol, progress=progress)[0]


def hessian_spectrum(model, loss_fn, batches, params=None, top_k=1, iters=100, tol=1e-4, trace=0, density=0, seed=0,
                     hvp='reverse', *, bottom_k=0, vectors=False, curvature='hessian', trace_estimator='hutchinson',
                     batch=1, progress=None):
    """The Hessian of the mean loss over `batches` (params: a diagonal block, param_blocks()), eval mode, through
    hvp_operator (curvature='ggn': the Gauss-Newton matrix of the cross-entropy, ggn_operator, instead): the top_k
    largest algebraic eigenvalues by Lanczos (residual <= tol |lambda|, at most `iters` products; eigenvalues[0] is
    the paper's lambda_max), bottom_k > 0 the smallest too (a second Lanczos run, which='SA': lambda_min and
    |lambda_min| / lambda_max), vectors=True their eigenvectors ((k, P) float64 rows), `trace` products of
    trace_estimator ('xtrace', 'hutchinson' or 'hutchpp') tr H and its standard error, `density` SLQ probes of
    `iters` steps the spectral density's nodes and weights. Probes from `seed`; batch: vectors per product call
    for the trace and the density (one backward each). top_k, bottom_k <= iters and the parameters (lanczos)."""
    top_k, iters, tol = check_int('top_k', top_k), check_int('iters', iters), check_real('tol', tol)
    trace, density, seed = check_int('trace', trace, 0), check_int('density', density, 0), check_int('seed', seed, 0)
    bottom_k, batch = check_int('bottom_k', bottom_k, 0), check_int('batch', batch)
    if hvp not in HVP_MODES:
        raise ValueError(f"hvp must be 'reverse', 'cached' or 'forward', got {hvp!r}")
    if curvature not in ('hessian', 'ggn') or trace_estimator not in ('xtrace', 'hutchinson', 'hutchpp'):
        raise ValueError(f"curvature must be 'hessian' or 'ggn' (got {curvature!r}), trace_estimator 'xtrace', "
                         f"'hutchinson' or 'hutchpp' (got {trace_estimator!r})")
    params = trainable(model, params)
    matvec, n = (ggn_operator(model, batches, params) if curvature == 'ggn' else
                 hvp_operator(model, loss_fn, batches, params, hvp))
    v0, out = start_vector(params, seed), dict(curvature=curvature)
    basis = torch.float64 if params[0].dtype == torch.float64 else torch.float32  # Lanczos' basis, XTrace's blocks
    # (fp16/bf16 models: float32)
    for key, which, k in (('', 'LA', top_k), ('bottom_', 'SA', bottom_k)):
        if k:
            r = lanczos(matvec, v0, k, iters, tol, which, basis, vectors, progress=progress)
            out.update({key + k: r[k] for k in ('eigenvalues', 'residuals', 'products', 'vectors') if k in r})
            out['converged'] = out.get('converged', True) and r['converged']
    out['lambda_max'] = out['eigenvalues'][0]
    if bottom_k:
        out.update(lambda_min=out['bottom_eigenvalues'][0],
                   lambda_min_over_max=abs(out['bottom_eigenvalues'][0]) / abs(out['lambda_max']))
    if trace:
        dev = params[0].device
        out['trace'], out['trace_se'] = (
            xtrace(matvec, n, trace, seed, dev, batch, basis) if trace_estimator == 'xtrace' else
            hutchpp(matvec, n, trace, seed, dev, batch) if trace_estimator == 'hutchpp' else
            hutchinson(matvec, n, trace, seed, dev, batch, progress=progress)[:2])
        out['trace_estimator'] = trace_estimator
    if density:
        nodes, weights = slq(matvec, n, iters, density, seed, params[0].device, batch=batch)
        out['density'] = dict(nodes=nodes.tolist(), weights=weights.tolist())
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


def trainable(model, params):  # params as a list (default: every trainable one), each model's, trainable, once
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f'model must be a torch.nn.Module, got {type(model).__name__}')
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    if not params:
        raise ValueError('no parameter requires grad: the Hessian is taken with respect to those (set '
                         'requires_grad_(True) on the ones to measure, or pass params=)')
    if bad := [p for p in params if not isinstance(p, torch.Tensor) or id(p) not in names]:
        raise ValueError(f'params must be parameters of model; {len(bad)} of the {len(params)} are not')
    if frozen := [names[id(p)] for p in params if not p.requires_grad]:
        raise ValueError(f'params {", ".join(frozen)} do not require grad')
    if len({id(p) for p in params}) < len(params):
        raise ValueError('params holds a parameter twice')
    return params


@contextlib.contextmanager
def eval_mode(model):
    """model.eval() for the duration (BatchNorm's running statistics, no dropout: the loss a function of the weights
    alone, as PyHessian asks), then each module's own mode back: the model and its buffers are left as they were."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training
