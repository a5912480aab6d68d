"""hessian.py against the full float64 Hessian (torch.func.jacrev of torch.func.grad, checked against central
differences; torch.linalg.eigh) of small models (an MLP, a tiny ViT, a tiny ResNet with BatchNorm in eval mode),
against PyHessian 0.1 (the oracle of requirements-test.txt), and geometry.py's hessian --repeats and memory sizing
(ntk chunk, hessian batch)."""
import functools
import json
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchvision.models.resnet import BasicBlock

import anchors
import data
import models
import geometry as G
import hessian
import matfree
import utils
import vit
from conftest import REPO

pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def tiny_vit():  # 8 px, 4 tokens of 4 px, one block; the JAX init's zero head drawn (else most of H is 0)
    model = vit.VisionTransformer(img_size=8, patch_size=4, dim=8, depth=1, heads=2, num_classes=3)
    nn.init.normal_(model.head.weight, std=0.5)
    return model


def tiny_resnet():  # a BasicBlock between a conv stem and a linear head; BatchNorm in eval with drawn statistics
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), BasicBlock(4, 4),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2)
    return model


MODELS = {'mlp': (mlp, (4,)), 'resnet': (tiny_resnet, (3, 6, 6)), 'vit': (tiny_vit, (3, 8, 8))}


def problem(name, dtype=torch.float64):
    """(model in eval mode, batches of unequal sizes, the full Hessian of the mean loss over all images: the
    Jacobian of the gradient, jacrev(grad), checked against central differences below)."""
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model = make().to(dtype).eval()
    x, y = torch.randn(12, *shape, dtype=dtype), torch.randint(0, 3, (12,))
    names, shapes = [n for n, _ in model.named_parameters()], [p.shape for p in model.parameters()]

    def loss_of(w):  # the mean loss over the 12 images as a function of the flat weights
        ws = {n: t.view(s) for n, t, s in zip(names, w.split([s.numel() for s in shapes]), shapes)}
        return F.cross_entropy(functional_call(model, ws, (x,)), y)
    # Not torch.func.hessian nor jacrev(jacrev): torch 2.14's vmap rule for native_layer_norm_backward builds the LN
    # weight's gradient from the saved mean and rstd, constants to autograd, so its derivative is wrong (report, h36)
    with sdpa_kernel(SDPBackend.MATH):  # the math kernel: the fused ones have no double backward
        H = torch.func.jacrev(torch.func.grad(loss_of))(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return model, [(x[:7], y[:7]), (x[7:], y[7:])], H


@pytest.fixture(scope='module', params=sorted(MODELS))
def case(request):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as one_thread (a module's fixture is set up before a test's)
    yield request.param, *problem(request.param)
    torch.set_num_threads(n)


def test_the_oracle_is_symmetric_and_equals_central_differences_of_the_gradient(case):
    """H = H^T to 1e-12 of its largest entry, and H v = (g(w + hv) - g(w - hv)) / 2h (g: the float64 gradient by
    one backward, h = 1e-6) to 1e-4 of max |H v| along random v (measured: <= 2e-6; torch.func.hessian's ViT
    Hessian is off by 2e-3 to 1e-2). Not on the ResNet: across a ReLU kink differences measure another quantity."""
    name, model, batches, H = case
    assert (H - H.T).abs().max() <= 1e-12 * H.abs().max()
    if name == 'resnet':  # ReLU: central differences across a kink are not the Hessian (symmetry checked above)
        return
    x, y = (torch.cat(t) for t in zip(*batches))
    params = list(model.parameters())
    w0 = [p.detach().clone() for p in params]

    def g(v, h):  # the gradient at w0 + h v, by one backward
        with torch.no_grad():
            for p, w, t in zip(params, w0, v.split([p.numel() for p in params])):
                p.copy_(w + h * t.view_as(p))
        return torch.cat([t.flatten() for t in torch.autograd.grad(F.cross_entropy(model(x), y), params)])
    gen = torch.Generator().manual_seed(2)
    try:
        for _ in range(3):
            v = torch.randn(len(H), dtype=torch.float64, generator=gen)
            fd = (g(v, 1e-6) - g(v, -1e-6)) / 2e-6
            assert (H @ v - fd).abs().max() <= 1e-4 * fd.abs().max()
    finally:
        with torch.no_grad():
            for p, w in zip(params, w0):
                p.copy_(w)


@pytest.mark.parametrize('mode', ['reverse', 'cached', 'forward'])
def test_hvp_modes_equal_the_full_hessian(case, mode):
    _, model, batches, H = case
    matvec, n = hessian.hvp_operator(model, F.cross_entropy, batches, mode=mode)
    v = torch.randn(n, dtype=torch.float64)
    assert n == len(H) and torch.allclose(matvec(v), H @ v, rtol=0, atol=1e-12 * H.abs().max().item())


def test_lanczos_top_k_equals_eigh(case):
    """Largest algebraic and largest in magnitude, to 1e-8, from the residual stopping rule at 1e-10."""
    _, model, batches, H = case
    eig = torch.linalg.eigvalsh(H)
    matvec, n = hessian.hvp_operator(model, F.cross_entropy, batches)
    v0 = hessian.start_vector(list(model.parameters()))
    got = matfree.lanczos(matvec, v0, k=3, steps=n, tol=1e-10)
    assert got['eigenvalues'] == pytest.approx(eig.flip(0)[:3].tolist(), rel=1e-8, abs=1e-12)
    mag = eig[eig.abs().argsort(descending=True)[:2]].tolist()
    assert matfree.lanczos(matvec, v0, k=2, steps=n, tol=1e-10, which='LM')['eigenvalues'] == \
        pytest.approx(mag, rel=1e-8, abs=1e-12)
    assert got['products'] < n or case[0] == 'mlp'  # stopped by the residual, before a full basis


def test_hutchinson_within_three_standard_errors_and_its_error_shrinks_as_one_over_sqrt(case):
    """The exact variance of z^T H z for Rademacher z is 2 (||H||_F^2 - sum_i H_ii^2): the reported s.e. matches
    it, shrinks as 1/sqrt(samples), and the estimate is within 3 s.e. of tr H."""
    _, model, batches, H = case
    matvec, n = hessian.hvp_operator(model, F.cross_entropy, batches)
    sd = math.sqrt(2 * ((H ** 2).sum() - (H.diag() ** 2).sum()).item())
    for m in (16, 64):
        t, se, vals = matfree.hutchinson(matvec, n, m, seed=1)
        assert len(vals) == m and abs(t - H.trace().item()) <= 3 * sd / math.sqrt(m)
        assert 0.5 < se / (sd / math.sqrt(m)) < 1.6


def test_hutchpp_is_unbiased_with_fewer_errors_on_a_decaying_spectrum():
    """Hutch++ on an explicit matrix with a few large eigenvalues (a Hessian's outliers): the same products, a
    smaller spread over seeds than Hutchinson's (measured here: docs/geometry.md's comparison)."""
    torch.manual_seed(0)
    q = torch.linalg.qr(torch.randn(60, 60, dtype=torch.float64))[0]
    A = q @ torch.diag(torch.cat([torch.tensor([50., 30, 20, 10], dtype=torch.float64),
                                  0.1 * torch.randn(56, dtype=torch.float64)])) @ q.T
    hp = torch.tensor([matfree.hutchpp(lambda v: A @ v, 60, 30, seed=s)[0] for s in range(40)])
    hu = torch.tensor([matfree.hutchinson(lambda v: A @ v, 60, 30, seed=s)[0] for s in range(40)])
    assert abs(hp.mean() - A.trace()) < 4 * hp.std() / math.sqrt(40) + 1e-9
    assert hp.std() < 0.2 * hu.std()


def test_slq_moments_equal_the_exact_spectrum(case):
    """Gauss quadrature is exact to degree 2 steps - 1: per probe v, sum_i w_i theta_i^p = v^T H^p v / v^T v
    (p = 0, 1, 2; 3 steps); with the probes an orthonormal basis (the MLP: n runs of 2 steps) the moments are the
    exact spectrum's, tr(H^p) / n. Rademacher probes: the weights sum to 1."""
    name, model, batches, H = case
    matvec, n = hessian.hvp_operator(model, F.cross_entropy, batches)
    gen = torch.Generator().manual_seed(3)
    probes = list(torch.randn(4, n, dtype=torch.float64, generator=gen))
    nodes, w = matfree.slq(matvec, n, steps=3, vectors=probes)
    for p in (0, 1, 2):
        want = sum(v @ torch.linalg.matrix_power(H, p) @ v / (v @ v) for v in probes).item() / 4
        assert (w * nodes ** p).sum().item() == pytest.approx(want, rel=1e-8, abs=1e-12)
    if name == 'mlp':
        basis = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=gen))[0]
        nodes, w = matfree.slq(matvec, n, steps=2, vectors=list(basis.T))  # degree 3 >= 2: exact
        for p, want in ((1, H.trace().item() / n), (2, (H @ H).trace().item() / n)):
            assert (w * nodes ** p).sum().item() == pytest.approx(want, rel=1e-8)
    nodes, w = matfree.slq(matvec, n, steps=5, probes=3)
    assert len(nodes) == 15 and w.sum().item() == pytest.approx(1, rel=1e-12)


def test_spectrum_of_a_block_equals_the_sub_matrix(case):
    name, model, batches, H = case
    first = list(model.parameters())[:2]  # the first layer's weight and bias: the first rows of H
    k = sum(p.numel() for p in first)
    sub = torch.linalg.eigvalsh(H[:k, :k])
    got = hessian.hessian_spectrum(model, F.cross_entropy, batches, first, top_k=2, iters=k, tol=1e-10, trace=64)
    assert got['eigenvalues'] == pytest.approx(sub.flip(0)[:2].tolist(), rel=1e-8, abs=1e-12)
    assert abs(got['trace'] - H[:k, :k].trace().item()) <= 4 * got['trace_se'] + 1e-12


def test_pyhessian_top_eigenvalues_and_trace_agree():
    """PyHessian 0.1's eigenvalues(top_n=2) (power iteration with deflation) and trace() (Hutchinson) on the same
    fp32 ResNet and batch: eigenvalues within its tol (1e-5 asked, 1e-4 compared), trace within 4 standard
    errors of both estimates."""
    pyhessian = pytest.importorskip('pyhessian')
    model, batches, _ = problem('resnet', torch.float32)
    x, y = (torch.cat(t) for t in zip(*batches))
    torch.manual_seed(0)
    ph = pyhessian.hessian(model, F.cross_entropy, data=(x, y), cuda=False)
    want, _ = ph.eigenvalues(maxIter=1000, tol=1e-5, top_n=2)
    tr = torch.tensor(ph.trace(maxIter=400, tol=0.0), dtype=torch.float64)  # tol 0: all 400 probes
    for p in model.parameters():
        p.grad = None
    got = hessian.hessian_spectrum(model, F.cross_entropy, [(x, y)], top_k=2, iters=200, tol=1e-8, trace=400)
    assert got['eigenvalues'] == pytest.approx(want, rel=1e-4)
    se = math.hypot(got['trace_se'], tr.std().item() / math.sqrt(len(tr)))
    assert abs(got['trace'] - tr.mean().item()) <= 4 * se


def test_compare_times_both_products_and_pyhessian_takes_our_power_iterations_steps(cifar10_dir, tmp_path):
    """--compare on a tiny ViT: PyHessian 0.1's power iteration (the oracle) from the same start lands on our power
    iteration's lambda after as many products (its normalisation adds 1e-6 to the norm: 5e-6 apart here); each
    product timed `reps` times (best <= median)."""
    pytest.importorskip('pyhessian')
    G.main(['hessian', '--model', 'vit_s4_cifar', '--model-kw', 'dim=16', 'depth=1', 'heads=2', '--data',
            str(cifar10_dir), '--images', '12', '--iters', '30', '--compare', '--out', str(tmp_path)])
    got = json.loads((tmp_path / 'hessian.json').read_text())['compare']
    rows = got['rows']
    assert rows['PyHessian 0.1']['hvps'] == rows['power iteration']['hvps']  # (here: neither within 30 HVPs)
    assert rows['PyHessian 0.1']['lambda_max'] == pytest.approx(rows['power iteration']['lambda_max'], rel=1e-4)
    assert rows['Lanczos']['lambda_max'] == pytest.approx(got['reference'], rel=got['reach'])
    assert all(0 < r['best_s_per_hvp'] <= r['s_per_hvp'] and r['s_per_step'] > 0 for r in rows.values())


def test_compare_times_power_iteration_to_the_eigenvalue_it_converges_to():
    """H29: where a negative eigenvalue is the largest in magnitude, power iteration (ours, PyHessian's) converges to
    it, not to Lanczos's lambda_max (the largest algebraic): --compare showed them as '> N HVPs', as if slow. Now each
    is timed to its own eigenvalue and the console says which. Oracle: eigh of the float64 jacrev Hessian of a tanh
    MLP whose most negative eigenvalue (-1.75) outweighs its largest (0.87), its next in magnitude -1.33."""
    pytest.importorskip('pyhessian')
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    names, shapes = [k for k, _ in model.named_parameters()], [p.shape for p in model.parameters()]

    def loss_of(w):
        ws = {k: t.view(s) for k, t, s in zip(names, w.split([s.numel() for s in shapes]), shapes)}
        return F.cross_entropy(functional_call(model, ws, (x.double(),)), y)
    eig = torch.linalg.eigvalsh(torch.func.jacrev(torch.func.grad(loss_of))(
        torch.cat([p.detach().flatten() for p in model.parameters()]).double()))
    assert -eig[0] > 1.5 * eig[-1] > 0
    said = []
    got = anchors.to_lambda_max(model.eval(), x, y, 0, said.append, most=100, reps=2)
    assert got['reference'] == pytest.approx(eig[-1].item(), rel=1e-4)
    assert got['reference_magnitude'] == pytest.approx(eig[0].item(), rel=1e-4)
    rows = got['rows']
    assert rows['Lanczos']['lambda_max'] == pytest.approx(eig[-1].item(), rel=1e-3)
    assert rows['power iteration']['hvps'] is not None  # within 1e-4 of the eigenvalue it converges to
    for name in ('power iteration', 'PyHessian 0.1'):
        assert rows[name]['lambda_max'] == pytest.approx(eig[0].item(), rel=1e-3)
    assert any('power iteration and PyHessian converge to the largest-magnitude eigenvalue' in s for s in said)


def test_repeats_split_the_images_disjointly(cifar10_dir, tmp_path):
    """--repeats 3 on 24 images: 3 x 8 images, each repeat's lambda_max that of its own images (every third, the
    classes interleaved) measured directly, mean and std over the three."""
    kw = ['dim=16', 'depth=1', 'heads=2']
    G.main(['hessian', '--model', 'vit_s4_cifar', '--model-kw', *kw, '--data', str(cifar10_dir), '--images', '24',
            '--repeats', '3', '--iters', '30', '--trace', '4', '--out', str(tmp_path)])
    got = json.loads((tmp_path / 'hessian.json').read_text())
    assert [r['images'] for r in got['repeats']] == [8, 8, 8] and got['n'] == 24
    lams = torch.tensor([r['lambda_max'] for r in got['repeats']], dtype=torch.float64)
    assert got['lambda_max_mean'] == pytest.approx(lams.mean().item()) and got['lambda_max_std'] == \
        pytest.approx(lams.std().item()) and lams.std() > 0
    assert {'trace_mean', 'trace_std', 'eigenvalues_mean', 'eigenvalues_std'} <= set(got)
    x, y, _, _ = data.measurement_images(str(cifar10_dir), 'cifar10', True, 24, 32)
    assert len(set(y[1::3].tolist())) > 1  # a repeat holds several classes
    torch.manual_seed(0)
    model = models.build_model('vit_s4_cifar', 10, 32, models.parse_model_kw(kw), cifar=True).eval()
    want = hessian.hessian_spectrum(model, F.cross_entropy, [(x[1::3], y[1::3])], iters=30, seed=1)['lambda_max']
    assert got['repeats'][1]['lambda_max'] == pytest.approx(want, rel=1e-5)


# ----------------------------------------------------------------------------- closed forms the code must keep
def test_density_curve_is_the_normal_density_of_std_sigma():
    """Issue 42, mutant 5 (exp(-d^2 / sigma^2), without the 2): one node of weight 1 gives the normal density
    N(x; theta, sigma^2) = exp(-(x - theta)^2 / (2 sigma^2)) / (sigma sqrt(2 pi)), written here from the textbook:
    at theta +- sigma it is exp(-1/2) / (sigma sqrt(2 pi)) (the mutant: exp(-1) / ...), and two nodes' curve
    integrates to their weights' sum (the mutant: 1/sqrt(2) of it)."""
    sigma, theta = 0.3, 1.7
    grid = torch.tensor([theta - sigma, theta, theta + sigma], dtype=torch.float64)
    got = matfree.density_curve(torch.tensor([theta], dtype=torch.float64), torch.ones(1, dtype=torch.float64), grid,
                                sigma)
    peak = 1 / (sigma * math.sqrt(2 * math.pi))
    assert got.tolist() == pytest.approx([peak * math.exp(-0.5), peak, peak * math.exp(-0.5)], rel=1e-12)
    grid = torch.linspace(-10, 10, 20001, dtype=torch.float64)  # +-30 sigma around both nodes
    curve = matfree.density_curve(torch.tensor([-1.0, 2.0], dtype=torch.float64),
                                  torch.tensor([0.25, 0.5], dtype=torch.float64), grid, sigma)
    assert torch.trapezoid(curve, grid).item() == pytest.approx(0.75, rel=1e-9)


def test_power_iteration_stops_on_the_relative_change_as_pyhessian():
    """Issue 42, mutant 6 (stopping on |new - old| < tol, not on |new - old| / (|old| + 1e-6) < tol): on
    A = s diag(1, r), v0 = (1, 1) / sqrt(2), the estimate after product i is in closed form
    s (1 + r^(2i - 1)) / (1 + r^(2i - 2)) (the Rayleigh quotient of A^(i-1) v0); PyHessian's rule (transcribed here
    in float64) stops at the first i whose relative change is < tol. At the scale s = 1e4 an absolute rule
    runs on for many more products, at s = 1e-4 it stops at the second: both scales are checked."""
    r, tol = 0.5, 1e-4
    for s in (1e4, 1e-4):
        A = torch.tensor([[s, 0], [0, s * r]], dtype=torch.float64)
        want = [s * (1 + r ** (2 * i - 1)) / (1 + r ** (2 * i - 2)) for i in range(1, 60)]
        stop = next(i for i in range(1, len(want)) if abs(want[i] - want[i - 1]) / (abs(want[i - 1]) + 1e-6) < tol)
        absolute = next(i for i in range(1, len(want)) if abs(want[i] - want[i - 1]) < tol)
        assert absolute != stop  # the two rules part at this scale
        eig, products, history = matfree.power_iteration(lambda v: A @ v, torch.ones(2, dtype=torch.float64), 100,
                                                         tol)
        assert products == stop + 1 and history == pytest.approx(want[:stop + 1], rel=1e-12)
        assert eig == pytest.approx(want[stop], rel=1e-12)


# ----------------------------------------------------------------------------- issue 42: hessian.py as a library
def lib_mlp():  # bad-inputs-3's `mlp` and `B`: 131 parameters, two batches of 8 (3, 2, 2) images, labels 0..2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x, y = torch.randn(16, 3, 2, 2), torch.arange(16) % 3
    return model, [(x[:8], y[:8]), (x[8:], y[8:])]


class Unused(nn.Module):  # `extra` is never used by forward: the loss does not depend on it
    def __init__(self):
        super().__init__()
        self.used, self.extra = nn.Linear(12, 3), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x.flatten(1))


def library_case(case):
    """bad-inputs-3's HL cases and the same kinds: -> a call that must raise."""
    model, B = lib_mlp()
    x, y = (torch.cat(t) for t in zip(*B))
    spectrum = functools.partial(hessian.hessian_spectrum, model, F.cross_entropy, B)
    matvec, n = hessian.hvp_operator(model, F.cross_entropy, B)
    v0 = hessian.start_vector(list(model.parameters()))
    frozen = nn.Sequential(nn.Flatten(), nn.Linear(12, 3)).requires_grad_(False)
    inf = lib_mlp()[0]
    with torch.no_grad():
        inf[3].bias[0] = math.inf
    nan_x = x.clone()
    nan_x[0, 0, 0, 0] = math.nan
    unused = Unused()
    return {
        'HL06': lambda: hessian.hessian_spectrum(model, F.cross_entropy, []),
        'HL06b': lambda: hessian.hessian_eigenvalue(model, F.cross_entropy, []),
        'HL07': lambda: hessian.hessian_spectrum(model, F.cross_entropy, [(x[:0], y[:0])]),
        'HL01': lambda: hessian.hessian_spectrum(frozen, F.cross_entropy, B),
        'HL01b': lambda: hessian.hessian_eigenvalue(frozen, F.cross_entropy, B),
        'HL20': lambda: hessian.start_vector([]),
        'HL08': lambda: hessian.hessian_spectrum(inf, F.cross_entropy, B, iters=20),
        'HL08b': lambda: hessian.hessian_eigenvalue(inf, F.cross_entropy, B),
        'HL08c': lambda: spectrum.func(model, F.cross_entropy, [(nan_x, y)]),
        'HL08-hvp': lambda: hessian.hvp_operator(inf, F.cross_entropy, B, mode='cached'),
        'HL09': lambda: matfree.lanczos(matvec, v0, k=0, steps=10),
        'HL14': lambda: spectrum(top_k=0),
        'HL10': lambda: matfree.lanczos(matvec, v0, k=1, steps=0),
        'HL15': lambda: spectrum(iters=0),
        'HL11': lambda: matfree.lanczos(matvec, v0, k=2, steps=300, which='BE'),
        'HL11b': lambda: matfree.lanczos(matvec, v0, k=2, steps=300, which='la'),
        'unused': lambda: hessian.hessian_spectrum(unused, F.cross_entropy, B, params=unused.extra.parameters()),
        'unused-eigenvalue': lambda: hessian.hessian_eigenvalue(unused, F.cross_entropy, B,
                                                                params=unused.extra.parameters()),
        'not-its-params': lambda: spectrum(params=nn.Linear(2, 2).parameters()),
        'frozen-param': lambda: hessian.hessian_spectrum(frozen, F.cross_entropy, B, params=frozen.parameters()),
        'hvp-mode': lambda: spectrum(hvp='fwd'),
        'operator-mode': lambda: hessian.hvp_operator(model, F.cross_entropy, B, mode='backward'),
        'trace-bool': lambda: spectrum(trace=True),
        'density-float': lambda: spectrum(density=1.0),
        'tol-nan': lambda: spectrum(tol=math.nan),
        'seed-negative': lambda: hessian.hessian_eigenvalue(model, F.cross_entropy, B, seed=-1),
        'per-image-loss': lambda: hessian.hessian_spectrum(
            model, lambda out, t: F.cross_entropy(out, t, reduction='none'), B),
        'not-pairs': lambda: hessian.hvp_operator(model, F.cross_entropy, [x]),
        'k-above-dimension': lambda: matfree.lanczos(matvec, v0, k=n + 1, steps=1000),
        'k-above-steps': lambda: matfree.lanczos(matvec, v0, k=3, steps=2),
        'zero-start': lambda: matfree.power_iteration(matvec, torch.zeros(n, dtype=torch.float64)),
        'iters-0': lambda: matfree.power_iteration(matvec, v0, iters=0),
        'hutchinson-0': lambda: matfree.hutchinson(matvec, n, 0),
        'hutchpp-2': lambda: matfree.hutchpp(matvec, n, 2),
        'slq-0': lambda: matfree.slq(matvec, n, probes=0),
        'slq-no-vectors': lambda: matfree.slq(matvec, n, vectors=[]),
        'sigma-0': lambda: matfree.density_curve(torch.zeros(1), torch.ones(1), torch.zeros(3), 0.0),
        'nan-product': lambda: matfree.lanczos(lambda v: v * math.nan, v0),
        'nan-power': lambda: matfree.power_iteration(lambda v: v * math.nan, v0),
        'nan-probe': lambda: matfree.hutchinson(lambda v: v * math.nan, n, 2),
        'basis-half': lambda: matfree.lanczos(matvec, v0, basis_dtype=torch.float16),
        'progress-str': lambda: matfree.lanczos(matvec, v0, progress='yes'),
    }[case]


LIBRARY_WORDS = {
    'HL06': 'no images in batches', 'HL06b': 'no images in batches', 'HL07': 'no images in batches',
    'HL01': 'no parameter requires grad', 'HL01b': 'no parameter requires grad', 'HL20': 'params must be a non-empty',
    'HL08': 'the loss is not finite on 2 batch(es) (inf/nan in the model or the images)',
    'HL08b': 'the loss is not finite', 'HL08c': 'the loss is not finite on 1 batch(es)', 'HL08-hvp': 'not finite',
    'HL09': 'k must be >= 1, got 0', 'HL14': 'top_k must be >= 1, got 0', 'HL10': 'steps must be >= 1, got 0',
    'HL15': 'iters must be >= 1, got 0', 'HL11': "which must be one of 'LA', 'SA', 'LM', got 'BE'",
    'HL11b': "got 'la'", 'unused': 'the loss does not depend on params', 'unused-eigenvalue': 'does not depend',
    'not-its-params': 'params must be parameters of model', 'frozen-param': 'params 1.weight, 1.bias do not require',
    'hvp-mode': "hvp must be 'reverse', 'cached' or 'forward', got 'fwd'", 'operator-mode': "got 'backward'",
    'trace-bool': 'trace must be an int, got bool True', 'density-float': 'density must be an int, got float',
    'tol-nan': 'tol must be a finite number >= 0, got nan', 'seed-negative': 'seed must be >= 0, got -1',
    'per-image-loss': "loss_fn must return the batch's mean loss, a 0-dim tensor; got (8,)",
    'not-pairs': 'batches must be an iterable of (x, y) pairs', 'k-above-dimension': 'a vector of >= k entries',
    'k-above-steps': 'k = 3 eigenvalues need steps >= k', 'zero-start': 'v must be finite and non-zero',
    'iters-0': 'iters must be >= 1', 'hutchinson-0': 'samples must be >= 1', 'hutchpp-2': 'products must be >= 3',
    'slq-0': 'probes must be >= 1', 'slq-no-vectors': 'vectors is empty',
    'sigma-0': 'sigma must be a finite number > 0',
    'nan-product': 'H v at Lanczos step 1 is not finite', 'nan-power': 'H v at product 1 is not finite',
    'nan-probe': 'z^T H z of probe 1 is not finite', 'basis-half': 'basis_dtype must be torch.float32 or',
    'progress-str': 'progress must be None or a function',
}


@pytest.mark.parametrize('case', sorted(LIBRARY_WORDS))
def test_library_bad_input_is_one_readable_error(case):
    """bad-inputs-3 HL01-HL20 and inputs of the same kinds (a result computed from nothing; a wrong-typed argument
    taken as truthy; a caller trusted): each a ValueError or TypeError naming it, on one line."""
    with pytest.raises((ValueError, TypeError)) as e:
        library_case(case)()
    assert LIBRARY_WORDS[case] in str(e.value) and '\n' not in str(e.value), str(e.value)


def bn_dropout_problem():
    """A float64 MLP with BatchNorm (drawn running statistics) and dropout, and the Hessian of its eval-mode mean
    loss by jacrev(grad) of functional_call with the module in eval mode: the oracle."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Dropout(0.5),
                          nn.Linear(6, 3)).double()
    model[2].running_mean.uniform_(-0.5, 0.5)
    model[2].running_var.uniform_(0.5, 2)
    x, y = torch.randn(10, 3, 2, 2, dtype=torch.float64), torch.arange(10) % 3
    names, shapes = [k for k, _ in model.named_parameters()], [p.shape for p in model.parameters()]
    buffers = {k: b.clone() for k, b in model.named_buffers()}

    def loss_of(w):
        ws = {k: t.view(s) for k, t, s in zip(names, w.split([s.numel() for s in shapes]), shapes)}
        return F.cross_entropy(functional_call(model.eval(), {**ws, **buffers}, (x,)), y)
    H = torch.func.jacrev(torch.func.grad(loss_of))(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return model, [(x[:6], y[:6]), (x[6:], y[6:])], H


@pytest.mark.parametrize('mode', ['reverse', 'cached', 'forward'])
def test_a_model_in_train_mode_is_measured_in_eval_mode_and_left_as_it_was(mode):
    """HL04, HL18: BatchNorm and dropout in train mode. The measurement is the eval-mode Hessian's (the oracle's
    eigenvalues), in every hvp mode; afterwards every buffer is bit for bit what it was (running statistics,
    num_batches_tracked) and every module has its own mode back (the dropout left in eval by the user stays so)."""
    model, batches, H = bn_dropout_problem()
    model.train()
    model[4].eval()  # a user's own choice inside a model in train mode
    modes = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    got = hessian.hessian_spectrum(model, F.cross_entropy, batches, top_k=2, iters=len(H), tol=1e-10, hvp=mode)
    assert got['eigenvalues'] == pytest.approx(torch.linalg.eigvalsh(H).flip(0)[:2].tolist(), rel=1e-8)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == modes


def test_batches_may_be_a_generator_and_empty_batches_weigh_nothing():
    """HL06 (a generator already consumed by the image count gave 0.0) and HL07b: the operator of a generator, of
    the list with an empty batch added, equal the list's (exactly: the same products)."""
    model, B = lib_mlp()
    v = hessian.start_vector(list(model.parameters()), 3)
    want = hessian.hvp_operator(model, F.cross_entropy, B)[0](v)
    empty = (B[0][0][:0], B[0][1][:0])
    for batches in ((b for b in B), [empty, *B], iter([B[0], empty, B[1]])):
        assert torch.equal(hessian.hvp_operator(model, F.cross_entropy, batches)[0](v), want)


def no_images_worker(rank, port, out):  # a torchrun process with a part of the images, or none (rank 1)
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=2)
    model, B = lib_mlp()
    got = {}
    for case, mine in (('shared', B if rank == 0 else []), ('none', []),
                       ('nan', [(B[0][0] * math.nan, B[0][1])] if rank == 1 else B)):
        try:
            got[case] = hessian.hessian_spectrum(model, F.cross_entropy, mine, top_k=2, iters=131, tol=1e-10,
                                                 trace=2)['eigenvalues']
        except ValueError as e:
            got[case] = str(e)
    torch.save(got, f'{out}/{rank}.pt')
    dist.destroy_process_group()


def test_under_torchrun_a_process_without_images_joins_and_none_at_all_is_refused_by_all(tmp_path):
    """HL06 under torchrun: rank 1 without images, rank 0 with all: the eigenvalues of one process; no images on any
    process, or a NaN image on one: both ranks raise the same ValueError (a collective decides: no rank is left
    waiting in an all-reduce)."""
    import torch.multiprocessing as mp
    from toys import free_port
    mp.start_processes(no_images_worker, (free_port(), str(tmp_path)), nprocs=2, start_method='fork')
    ranks = [torch.load(tmp_path / f'{r}.pt') for r in (0, 1)]
    model, B = lib_mlp()
    want = hessian.hessian_spectrum(model, F.cross_entropy, B, top_k=2, iters=131, tol=1e-10)['eigenvalues']
    for got in ranks:
        assert got['shared'] == pytest.approx(want, rel=1e-9)
        assert got['none'] == 'no images in batches of any process'
        assert got['nan'].startswith('the loss is not finite on 1 batch(es)')


# ----------------------------------------------------------------------------- memory sizing
def test_fit_picks_fewer_with_less_memory_and_refuses_in_one_line():
    assert utils.fit(100, 0, 10_000, 1000, 'x') == 80 and utils.fit(100, 0, 1_000, 1000, 'x') == 8
    with pytest.raises(utils.UserError) as e:
        utils.fit(100, 1_000, 1_000, 1000, 'hessian (1 GiB per image)')
    assert '\n' not in str(e.value) and 'GiB free' in str(e.value)


def test_ntk_chunk_shrinks_with_the_memory_and_refuses_naming_what_fits():
    torch.manual_seed(0)
    model, x = tiny_vit(), torch.randn(40, 3, 8, 8)
    p = sum(q.numel() for q in model.parameters())
    assert G.ntk_chunk(model, x, 'trace', 0, 2 ** 30) == 40  # all in one chunk
    small = G.ntk_chunk(model, x, 'trace', 0, 40 * 3 * p * 8)  # not all: two buffers of fewer images
    assert 1 <= small < 40
    with pytest.raises(G.UserError) as e:
        G.ntk_chunk(model, x, 'trace', 0, 3 * p * 8)
    msg = str(e.value)
    assert '\n' not in msg and 'GiB free' in msg and '--reduce sum' in msg
    with pytest.raises(G.UserError, match=f'--chunk {small} fits'):
        G.ntk_chunk(model, x, 'trace', small + 1, 40 * 3 * p * 8)


def test_hessian_batch_is_sized_from_the_free_memory(cifar10_dir, tmp_path, monkeypatch):
    common = ['hessian', '--model', 'vit_s4_cifar', '--model-kw', 'dim=16', 'depth=1', 'heads=2', '--data',
              str(cifar10_dir), '--images', '12', '--iters', '3', '--overwrite', '--out', str(tmp_path)]
    G.main(common)
    assert json.loads((tmp_path / 'hessian.json').read_text())['batch_size'] == 12  # plenty: one batch
    p = sum(q.numel() * 4 for q in models.build_model('vit_s4_cifar', 10, 32, dict(dim=16, depth=1, heads=2),
                                                 cifar=True).parameters())
    monkeypatch.setattr(G, 'saved_bytes', lambda x, fn: 10 ** 6)  # 2 MB per image: the graph and the second backward
    monkeypatch.setattr(G, 'free_memory', lambda device: ((3 + 8 + 16) * p + 5 * 2e6 + 1) / 0.8)  # the basis + 5
    G.main(common)
    assert json.loads((tmp_path / 'hessian.json').read_text())['batch_size'] == 5
    monkeypatch.setattr(G, 'free_memory', lambda device: 1000)
    with pytest.raises(G.UserError, match='GiB free'):
        G.main(common)


def test_docs_ntk_commands_run_on_this_cpu(cifar10_dir, tmp_path):
    """Every `python geometry.py ntk ... --data DIR` of docs/geometry.md, as written (DIR: the CIFAR-10 copy)."""
    cmds = [line.split('#')[0].split()[2:] for line in (REPO / 'docs' / 'geometry.md').read_text().splitlines()
            if re.match(r'python geometry.py ntk .*--data DIR', line)]
    assert cmds
    for i, argv in enumerate(cmds):
        argv = [str(cifar10_dir) if a == 'DIR' else a for a in argv]
        argv[argv.index('--out') + 1] = str(tmp_path / str(i))
        G.main(argv)
        assert json.loads((tmp_path / str(i) / 'ntk.json').read_text())['kappa'] > 1


def test_repeats_under_torchrun_equal_one_process(cifar10_dir, tmp_path, one_thread):
    """--repeats 2 on 24 images with 3 gloo processes: each repeat's 12 images split 4 / 4 / 4 (batches of the
    one-process run), every quantity of every repeat equal to one process's to 1e-6."""
    import os
    import subprocess
    import sys
    from toys import free_port
    common = ['hessian', '--model', 'vit_s4_cifar', '--model-kw', 'dim=16', 'depth=1', 'heads=2', '--data',
              str(cifar10_dir), '--images', '24', '--batch-size', '4', '--repeats', '2', '--iters', '4', '--tol', '0',
              '--top-k', '2', '--trace', '4']
    G.main([*common, '--out', str(tmp_path / 'one')])
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'CUDA_VISIBLE_DEVICES': ''}
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '3', '--master_port',
                        str(free_port()), 'geometry.py', *common, '--out', str(tmp_path / 'many')], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    one, many = (json.loads((tmp_path / d / 'hessian.json').read_text()) for d in ('one', 'many'))
    read = lambda d: torch.tensor([v for rep in d['repeats'] for v in (*rep['eigenvalues'], rep['trace'])],  # noqa
                                  dtype=torch.float64)
    assert [rep['images'] for rep in many['repeats']] == [12, 12] and many['processes'] == 3
    assert torch.allclose(read(many), read(one), rtol=1e-6, atol=0)
