"""The curvature of a loss: Hessian-vector products and what they buy. Copy it with matfree.py (the algorithms on
any symmetric operator: 570 lines in one file read worse than two of 270 and 320); both need only torch.

    H v           hvp_operator: the exact product, by double backward (Pearlmutter 1994), batches weighted by size,
                  summed over torchrun's processes (one all-reduce of a flat vector per product); k vectors at once
                  through one vmapped backward (one all-reduce for the k)
    G v           ggn_operator: the Gauss-Newton matrix of the cross-entropy, J^T H_out J (Schraudolph 2002)
    spectrum      hessian_spectrum: through matfree.py (beside this file): lambda_max and the top-k
                  by Lanczos, the bottom ('SA'), eigenvectors, tr H (XTrace, Hutchinson, Hutch++), the density (SLQ)

Every vector is a flat float64 tensor of the (block's) parameters, in model.parameters() order, on their device
(k of them: the rows of a (k, P) tensor); the products run in the parameters' dtype and are accumulated in
float64. An operator is a function of a flat vector, so scipy takes it as a LinearOperator in three lines
(docs/geometry.md) and matfree's algorithms are testable against an explicit matrix. Every public
function checks its arguments: a mistake is a ValueError / TypeError naming it, never a number computed from nothing."""
import contextlib
import functools

import torch
import torch.distributed as dist
from torch.func import functional_call, grad, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from matfree import check_int, check_real, hutchinson, hutchpp, lanczos, power_iteration, slq, xtrace


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


# ----------------------------------------------------------------------------- the spectrum
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


# ----------------------------------------------------------------------------- what the drivers check
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
