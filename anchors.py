"""hessian.py beside the curvature libraries people use, on one model, one batch of images and one start vector:
`geometry.py hessian --compare [LIBRARY ...]` (docs/geometry.md). Each library is imported here only, when named
(PACKAGES; a missing one is named in one line). compare: against our Lanczos to a residual of 1e-10 |lambda|, ours
(products to the top-1 / top-5 at reach, lambda_min, tr H by XTrace and Hutchinson), curvlinops (its product, wrong
with LayerNorm: tests/test_curvature.py; scipy's eigsh on its operator), hessian-eigenthings (deflated power
iteration: each eigenvalue's flag, true residual, distance to the reference), PyHessian (trace()'s probes,
eigenvalues(top_n=5)), seconds per vector. Bare --compare: to_lambda_max, against PyHessian's power iteration."""
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hessian
import matfree
from utils import UserError

PACKAGES = {'pyhessian': 'pyhessian==0.1', 'curvlinops': 'curvlinops-for-pytorch==3.0.1',
            'eigenthings': 'hessian-eigenthings==1.0.0a5'}


def require(*names, world=1):  # the (last) library's module, or one line naming what to install; one process
    if world > 1:
        raise UserError('--compare runs in one process (the other libraries cannot split the images)')
    for name in names:
        try:
            module = __import__({'eigenthings': 'hessian_eigenthings'}.get(name, name))
        except ImportError:
            raise UserError(f'--compare {name} needs {PACKAGES[name]}: pip install {PACKAGES[name]}') from None
    return module


def worst(got, want):  # the largest relative error of the eigenvalues `got` against the reference `want`
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


def reference(matvec, v0):
    """Our Lanczos to a residual of 1e-10 |lambda|: the top 5, the bottom 1, the 5 largest in magnitude."""
    run = lambda k, which: matfree.lanczos(matvec, v0, k, 400, 1e-10, which)['eigenvalues']  # noqa: E731
    return dict(top=run(5, 'LA'), bottom=run(1, 'SA')[0], magnitude=run(5, 'LM'))


def ours(matvec, n, v0, ref, reach, probes, seed):
    row = {}
    for k in (1, 5):
        r = matfree.lanczos(matvec, v0, k, 400, reach)
        row[f'top{k}'] = dict(products=r['products'], error=worst(r['eigenvalues'], ref['top'][:k]))
    row['lambda_min'] = matfree.lanczos(matvec, v0, 1, 400, reach, 'SA')['eigenvalues'][0]
    return {**row, 'trace_xtrace': matfree.xtrace(matvec, n, probes, seed),
            'trace_hutchinson': matfree.hutchinson(matvec, n, probes, seed)[:2]}


def curvlinops_row(model, x, y, params, matvec, v0, ref, reach):
    curvlinops = require('curvlinops')
    from scipy.sparse.linalg import LinearOperator, eigsh
    op = curvlinops.HessianLinearOperator(model, torch.nn.CrossEntropyLoss(), params, [(x, y)],
                                          check_deterministic=False)
    ours_v = matvec(v0)
    theirs = (op @ v0.to(params[0].dtype)).double()
    row = dict(product_error=((theirs - ours_v).abs().max() / ours_v.abs().max()).item())
    sp = op.to_scipy()
    for k in (1, 5):
        count = [0]

        def mv(V):
            count[0] += 1 if V.ndim == 1 else V.shape[1]
            return sp @ V
        lam = eigsh(LinearOperator(sp.shape, matvec=mv, matmat=mv, dtype=sp.dtype), k=k, which='LA', tol=reach,
                    v0=v0.cpu().numpy(), return_eigenvectors=False)
        row[f'top{k}'] = dict(products=count[0], error=worst(sorted(lam.tolist(), reverse=True), ref['top'][:k]))
    return row, op


def eigenthings_row(model, x, y, matvec, ref, reach, seed):
    et = require('eigenthings')
    op = et.HessianOperator(model, [(x, y)], et.supervised_loss(F.cross_entropy))
    r = et.deflated_power_iteration(op, k=5, max_iter=100, tol=reach, seed=seed)
    known = torch.tensor(ref['top'] + ref['magnitude'] + [ref['bottom']], dtype=torch.float64)
    pairs = []
    for lam, v, conv in zip(r.eigenvalues.tolist(), r.eigenvectors, r.converged.tolist()):
        v = v.double()
        pairs.append(dict(eigenvalue=lam, converged=conv, residual=(matvec(v) - lam * v).norm().item(),
                          distance=(known - lam).abs().min().item()))
    return dict(products=r.iterations, pairs=pairs)


def pyhessian_row(model, x, y, seed, probes, reach):
    pyhessian = require('pyhessian')
    module = sys.modules['pyhessian.hessian']  # (the package's `hessian` attribute is the class)
    count, hvp = [0], module.hessian_vector_product

    def counting(*a):  # its products, counted where its hessian.py calls them
        count[0] += 1
        return hvp(*a)
    module.hessian_vector_product = counting
    try:
        ph = pyhessian.hessian(model, F.cross_entropy, data=(x, y), cuda=x.is_cuda)
        torch.manual_seed(seed)
        tr = ph.trace(maxIter=probes, tol=1e-3)
        count[0], row = 0, dict(trace=dict(probes=len(tr), estimate=sum(tr) / len(tr)))
        torch.manual_seed(seed)
        row['top5'] = dict(eigenvalues=ph.eigenvalues(maxIter=100, tol=reach, top_n=5)[0], products=count[0])
    finally:
        module.hessian_vector_product = hvp
        for p in model.parameters():  # it leaves the create_graph gradient (and its graph) in .grad
            p.grad = None
    return row


def per_vector(products, reps, cuda):
    """{name: median seconds per vector} of each (function, vectors it multiplies), timed in alternating order: CPU
    seconds of this process (wall after a synchronize on CUDA)."""
    clock = lambda: torch.cuda.synchronize() or time.perf_counter() if cuda else time.process_time()  # noqa: E731
    times = {k: [] for k in products}
    for r in range(reps):
        for k in list(products)[::1 if r % 2 else -1]:
            fn, count = products[k]
            t0 = clock()
            fn()
            times[k].append((clock() - t0) / count)
    return {k: statistics.median(t) for k, t in times.items()}


def compare(model, x, y, names, seed=0, probes=100, reach=1e-4, batch=8, reps=5, say=print):
    """The side-by-side of the module's docstring on the images (x, y) as one batch (the model in eval mode)."""
    require(*names)  # every one named is there before any work
    params = [p for p in model.parameters() if p.requires_grad]
    with sdpa_kernel(SDPBackend.MATH), hessian.eval_mode(model):  # (fused attention: no double backward)
        matvec, n = hessian.hvp_operator(model, F.cross_entropy, [(x, y)], params, 'cached')
        v0 = hessian.start_vector(params, seed)
        ref = reference(matvec, v0)
        out = dict(reference=ref, reach=reach, probes=probes, images=len(x), params=n,
                   ours=ours(matvec, n, v0, ref, reach, probes, seed))
        V = torch.randn(batch, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(v0.device)
        timed = {'ours, one vector': (lambda: [matvec(v) for v in V], batch),
                 f'ours, {batch} vectors per call': (lambda: matvec(V), batch)}
        if 'curvlinops' in names:
            out['curvlinops'], op = curvlinops_row(model, x, y, params, matvec, v0, ref, reach)
            M = V.T.to(params[0].dtype).contiguous()
            timed[f'curvlinops, {batch} vectors per call'] = (lambda: op @ M, batch)
        if 'eigenthings' in names:
            out['eigenthings'] = eigenthings_row(model, x, y, matvec, ref, reach, seed)
        if 'pyhessian' in names:
            out['pyhessian'] = pyhessian_row(model, x, y, seed, probes, reach)
        out['seconds_per_vector'] = per_vector(timed, reps, x.is_cuda)
    say(f"  compare | reference: top-5 {', '.join(f'{e:.6g}' for e in ref['top'])} | lambda_min {ref['bottom']:.6g}")
    o = out['ours']
    say(f"  compare | ours Lanczos: top-1 in {o['top1']['products']}, top-5 in {o['top5']['products']} products "
        f"(errors {o['top1']['error']:.1e}, {o['top5']['error']:.1e}) | tr H: XTrace {o['trace_xtrace'][0]:.6g} +- "
        f"{o['trace_xtrace'][1]:.2g}, Hutchinson {o['trace_hutchinson'][0]:.6g} +- {o['trace_hutchinson'][1]:.2g} "
        f'({probes} products each)')
    if 'curvlinops' in out:
        c = out['curvlinops']
        say(f"  compare | curvlinops: its product vs ours, relative {c['product_error']:.1e} | eigsh top-1 in "
            f"{c['top1']['products']}, top-5 in {c['top5']['products']} products (errors {c['top1']['error']:.1e}, "
            f"{c['top5']['error']:.1e})")
    if 'eigenthings' in out:
        e = out['eigenthings']
        say(f"  compare | eigenthings: deflated power iteration, {e['products']} products | " + '; '.join(
            f"{p['eigenvalue']:.6g} {'converged' if p['converged'] else 'not converged'} (true residual "
            f"{p['residual']:.2g}, {p['distance']:.2g} from the nearest reference)" for p in e['pairs']))
    if 'pyhessian' in out:
        p = out['pyhessian']
        say(f"  compare | PyHessian: trace() used {p['trace']['probes']} of {probes} probes: "
            f"{p['trace']['estimate']:.6g} | eigenvalues(top_n=5) in {p['top5']['products']} products: "
            + ', '.join(f'{e:.6g}' for e in p['top5']['eigenvalues']))
    say('  compare | seconds per vector: ' + ', '.join(f'{k} {s:.4f}' for k, s in out['seconds_per_vector'].items()))
    return out


def to_lambda_max(model, x, y, seed, say, most=100, reach=1e-4, reps=15):
    """`hessian --compare`: products and seconds until each is within `reach` (relative) of the eigenvalue it converges
    to (by Lanczos to a residual of 1e-10): Lanczos to lambda_max; power iteration and PyHessian 0.1's eigenvalues()
    to the largest in magnitude (H29: another where a negative one is larger); the same model, images (one batch, as
    PyHessian's single-batch path and our 'cached' mode) and start vector (start_vector(seed) draws what PyHessian
    draws after torch.manual_seed(seed)). Per product: after a warm-up, `reps` timings of each, interleaved in
    alternating order, in CPU seconds of this process (process_time: what other jobs inflate least): the median, the
    best, and the median ratio of neighbouring timings (ours / PyHessian's: a drift of the load cancels). CUDA: wall."""
    PyHessian = require('pyhessian').hessian
    hessian_vector_product = sys.modules['pyhessian.utils'].hessian_vector_product
    params, rows, cuda = [p for p in model.parameters() if p.requires_grad], {}, x.is_cuda

    def clock():  # (CPU seconds, wall seconds) now
        if cuda:
            torch.cuda.synchronize(x.device)
        wall = time.perf_counter()
        return wall if cuda else time.process_time(), wall

    since = lambda t0, t1: (t1[0] - t0[0], t1[1] - t0[1])  # noqa: E731 (CPU, wall) seconds between two clocks
    with sdpa_kernel(SDPBackend.MATH), hessian.eval_mode(model):
        t0 = clock()
        matvec, _ = hessian.hvp_operator(model, F.cross_entropy, [(x, y)], params, 'cached')
        build, v0 = since(t0, clock()), hessian.start_vector(params, seed)
        # the references: the largest algebraic (lambda_max) and in magnitude (the first is also our warm-up)
        ref, ref_lm = (matfree.lanczos(matvec, v0, 1, 300, 1e-10, which)['eigenvalues'][0] for which in ('LA', 'LM'))
        near = lambda e, want: abs(e - want) <= reach * abs(want)  # noqa: E731
        for name, run in (('Lanczos', lambda log: matfree.lanczos(matvec, v0, 1, most, reach, progress=log)['history']),
                          ('power iteration', lambda log: matfree.power_iteration(  # (runs on past the reach)
                              matvec, v0, most, reach / 100, progress=log)[2])):
            stamps, t0, want = [], clock(), ref if name == 'Lanczos' else ref_lm
            history = run(lambda msg: stamps.append(since(t0, clock())))
            k = next((i for i, e in enumerate(history) if near(e, want)), None)
            rows[name] = dict(hvps=None if k is None else k + 1, seconds=None if k is None else build[1] + stamps[k][1],
                              cpu_seconds=None if k is None else build[0] + stamps[k][0], reference=want,
                              s_per_step=stamps[-1][0] / len(stamps), lambda_max=history[-1 if k is None else k])
        steps = rows['power iteration']['hvps'] or most  # the same iteration from the same start: as many products
        with sdpa_kernel(SDPBackend.MATH):  # (the fused attention has no double backward)
            t0 = clock()
            ph = PyHessian(model, F.cross_entropy, data=(x, y), cuda=cuda)
            t1 = clock()
            v = [t.view_as(p).to(p.dtype) for t, p in zip(v0.split([p.numel() for p in params]), params)]
            hessian_vector_product(ph.gradsH, ph.params, v)  # its warm-up, outside its times
            torch.manual_seed(seed)  # its start vector: randn per parameter
            t2 = clock()
            lam = ph.eigenvalues(maxIter=steps, tol=0.0)[0][0]  # tol 0: exactly `steps` products
            run = since(t2, clock())
        reached, first = near(lam, ref_lm), since(t0, t1)
        rows['PyHessian 0.1'] = dict(hvps=steps if reached else None, seconds=first[1] + run[1] if reached else None,
                                     cpu_seconds=first[0] + run[0] if reached else None, s_per_step=run[0] / steps,
                                     lambda_max=lam, ran=steps, reference=ref_lm)  # (else: after `steps` products)
        products = {'ours': lambda: matvec(v0),
                    'PyHessian 0.1': lambda: hessian_vector_product(ph.gradsH, ph.params, v)}
        times = {k: [] for k in products}
        for r in range(reps):
            for k in list(products)[::1 if r % 2 else -1]:  # alternating order: neither always first
                t0 = clock()
                products[k]()
                times[k].append(since(t0, clock()))
        model.zero_grad(set_to_none=True)  # PyHessian leaves the create_graph gradient (and its graph) in .grad
    for name, r in rows.items():
        ts = times['PyHessian 0.1' if name == 'PyHessian 0.1' else 'ours']
        r.update(s_per_hvp=statistics.median(t[0] for t in ts), wall_per_hvp=statistics.median(t[1] for t in ts),
                 best_s_per_hvp=min(t[0] for t in ts))
        hvps = r['hvps'] or f"> {r.get('ran', most)}"  # (PyHessian: the products of our power iteration)
        say(f"  compare | {name:16s} | {hvps} HVPs | {r['seconds'] or math.nan:.2f} s "
            f"({r['cpu_seconds'] or math.nan:.2f} s CPU) to its lambda within {reach:g} | per step "
            f"{r['s_per_step']:.3f} s CPU | per HVP {r['s_per_hvp']:.3f} s CPU, {r['wall_per_hvp']:.3f} s wall "
            f"(median of {reps}; best {r['best_s_per_hvp']:.3f}) | lambda {r['lambda_max']:.8g} (reference "
            f"{r['reference']:.8g})")
    if not near(ref_lm, ref):
        say(f'  compare | power iteration and PyHessian converge to the largest-magnitude eigenvalue {ref_lm:.8g}, '
            f"not to lambda_max {ref:.8g} (the largest algebraic, Lanczos's): their HVPs count to {ref_lm:.8g}")
    ratio = statistics.median([a[0] / b[0] for a, b in zip(times['ours'], times['PyHessian 0.1'])])  # paired
    say(f'  compare | per HVP, ours / PyHessian (CPU seconds of neighbouring timings): median ratio {ratio:.3f}')
    return dict(reference=ref, reference_magnitude=ref_lm, reach=reach, rows=rows, images=len(x), reps=reps,
                threads=torch.get_num_threads(), ours_over_pyhessian=ratio,
                clock='wall (CUDA)' if cuda else 'process_time: CPU seconds of every thread of this process')
