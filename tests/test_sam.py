"""sam.py against independent oracles: closed forms on a quadratic, the base optimizer alone, a
single-process simulation of 2-process DDP, fp32 runs for AMP, plain forward passes for BatchNorm,
one big batch for accumulation, and hand-computed clipping."""
import contextlib
import copy
import io
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import convmixer
from sam import SAM, first_pass, second_pass
from toys import clone_params, free_port, toy_data, toy_mlp

F64 = torch.float64


# -----------------------------------------------------------------------------
# helpers (the spawned DDP workers import this module, so everything stays at top level)
def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _sam_step(model, opt, micro, scaler=None, autocast=None, clip=None, unscale=True):
    """One SAM step exactly as in the sam.py / README loop (k = len(micro) micro-batches)."""
    k = len(micro)
    scaler = scaler or torch.amp.GradScaler('cpu', enabled=False)
    ctx = autocast or contextlib.nullcontext
    with first_pass(model):
        for xb, yb in micro:
            with ctx():
                loss = F.cross_entropy(model(xb), yb) / k
            scaler.scale(loss).backward()
    opt.first_step(zero_grad=True)
    with second_pass(model):
        for xb, yb in micro:
            with ctx():
                loss = F.cross_entropy(model(xb), yb) / k
            scaler.scale(loss).backward()
    if unscale:
        scaler.unscale_(opt)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _grads_at(model, params, x, y):
    """Independent oracle: d CE(model(x), y) / d params, by torch.autograd.grad."""
    return torch.autograd.grad(F.cross_entropy(model(x), y), params)


def _update_rel_err(w0, wa, wb):
    """||(wa - w0) - (wb - w0)|| / ||wb - w0||: compares two updates of the same start point."""
    da, db = _flat(wa) - _flat(w0), _flat(wb) - _flat(w0)
    return ((da - db).norm() / db.norm()).item()


# -----------------------------------------------------------------------------
# 1. closed form on L(w) = 1/2 w^T A w (the gradient is A w)
@pytest.mark.parametrize('adaptive', [False, True], ids=['sam', 'asam'])
@pytest.mark.parametrize('base,kw', [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1)),
], ids=['sgd', 'adamw'])
def test_closed_form_quadratic(adaptive, base, kw):
    torch.manual_seed(0)
    n, rho, eta = 7, 0.3, 0.01
    m = torch.randn(n, n, dtype=F64)
    a = m @ m.T + n * torch.eye(n, dtype=F64)
    w = torch.randn(n, dtype=F64)
    # w is split over two tensors so that the norm must be global; `unused` never gets a grad
    w1 = nn.Parameter(w[:3].clone())
    w2 = nn.Parameter(w[3:].reshape(2, 2).clone())
    unused = nn.Parameter(torch.randn(2, dtype=F64))
    unused0 = unused.detach().clone()
    opt = SAM([w1, w2, unused], base, rho=rho, adaptive=adaptive, eta=eta, **kw)
    ref = nn.Parameter(w.clone())  # oracle: the base optimizer alone, fed A(w + eps)
    ref_opt = base([ref], **kw)

    def loss():
        v = torch.cat([w1.reshape(-1), w2.reshape(-1)])
        return 0.5 * v @ a @ v

    for _ in range(3):
        w = ref.detach().clone()
        g = a @ w
        if adaptive:  # Kwon et al.: eps = rho T^2 g / ||T g||, T = |w| + eta
            t = w.abs() + eta
            eps = rho * t ** 2 * g / torch.linalg.vector_norm(t * g)
        else:         # Foret et al. eq. (2): eps = rho g / ||g||
            eps = rho * g / torch.linalg.vector_norm(g)

        loss().backward()
        opt.first_step(zero_grad=True)
        torch.testing.assert_close(_flat([w1, w2]).detach(), w + eps, rtol=0, atol=1e-12)
        assert torch.equal(unused.detach(), unused0) and unused.grad is None
        loss().backward()
        opt.second_step(zero_grad=True)

        ref.grad = a @ (w + eps)  # weight decay is the base optimizer's business, not eps's
        ref_opt.step()
        torch.testing.assert_close(_flat([w1, w2]).detach(), ref.detach(), rtol=0, atol=1e-12)
    assert torch.equal(unused.detach(), unused0)


def test_per_group_rho_and_adaptive_share_one_norm():
    """Official-ASAM layout: weights adaptive, biases not (T = 1); the norm runs over both."""
    torch.manual_seed(0)
    w, b = torch.randn(5, dtype=F64), torch.randn(3, dtype=F64)
    pw, pb = nn.Parameter(w.clone()), nn.Parameter(b.clone())
    opt = SAM([{'params': [pw]}, {'params': [pb], 'adaptive': False, 'rho': 0.2}],
              torch.optim.SGD, rho=0.5, adaptive=True, eta=0.01, lr=0.1)
    ((pw ** 3).sum() + (pb ** 2).sum()).backward()
    gw, gb = 3 * w ** 2, 2 * b
    t = w.abs() + 0.01
    norm = math.sqrt(((t * gw) ** 2).sum() + (gb ** 2).sum())
    opt.first_step()
    torch.testing.assert_close(pw.detach(), w + 0.5 * t ** 2 * gw / norm, rtol=0, atol=1e-12)
    torch.testing.assert_close(pb.detach(), b + 0.2 * gb / norm, rtol=0, atol=1e-12)


# -----------------------------------------------------------------------------
# 2. rho = 0 is the base optimizer, bit for bit
@pytest.mark.parametrize('base,kw', [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
], ids=['sgd', 'adamw'])
def test_rho_zero_is_bit_identical_to_base(base, kw):
    m_sam, m_ref = toy_mlp(0), toy_mlp(0)
    opt = SAM(m_sam.parameters(), base, rho=0.0, **kw)
    ref = base(m_ref.parameters(), **kw)
    for step in range(4):
        x, y = toy_data(step, 16)
        _sam_step(m_sam, opt, [(x, y)])
        ref.zero_grad()
        F.cross_entropy(m_ref(x), y).backward()
        ref.step()
    for p, q in zip(m_sam.parameters(), m_ref.parameters()):
        assert torch.equal(p, q)


# -----------------------------------------------------------------------------
# 3. DDP m-sharpness: 2 processes, gloo on CPU, against a single-process simulation. In float64: in fp32 the gloo
# sum and a single process's backward round differently, by ~1e-7 relative per step and more on another CPU (vector
# width, thread count), too close to any tolerance that still tells a wrong perturbation apart. In float64 that
# rounding is ~1e-16, so 1e-12 is far above the noise of any CPU and far below the differences under test.
DDP_KW = dict(rho=0.2, lr=0.1, momentum=0.9)
DDP_BATCH, DDP_MICRO = 8, 2  # global batch 8 = 2 ranks x 2 micro-batches x 2 samples
DDP_STEPS, DDP_OVERFLOW_STEP = 4, 2  # at step 2 only rank 0's first-pass gradient overflows


def _ddp_worker(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=world)
    try:
        model = toy_mlp(0).to(F64)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = SAM(ddp.parameters(), torch.optim.SGD, **DDP_KW)
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)  # fp32 compute, as with fp16
        per = DDP_BATCH // world
        before, perturbed = [], []
        for step in range(DDP_STEPS):
            before.append(clone_params(model))
            x, y = toy_data(100 + step, DDP_BATCH)
            xr, yr = x[rank * per:(rank + 1) * per].to(F64), y[rank * per:(rank + 1) * per]
            micro = list(zip(xr.chunk(DDP_MICRO), yr.chunk(DDP_MICRO)))
            k = len(micro)
            with first_pass(ddp):  # the loop of the sam.py docstring, verbatim
                for xb, yb in micro:
                    scaler.scale(F.cross_entropy(ddp(xb), yb) / k).backward()
            if step == DDP_OVERFLOW_STEP and rank == 0:
                model[0].weight.grad[0, 0] = float('inf')
            opt.first_step(zero_grad=True)
            perturbed.append(clone_params(model))
            with second_pass(ddp):
                for j, (xb, yb) in enumerate(micro):
                    with ddp.no_sync() if j < k - 1 else contextlib.nullcontext():
                        scaler.scale(F.cross_entropy(ddp(xb), yb) / k).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 10.0)  # inactive here, but in the loop
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        torch.save({'final': clone_params(model), 'before': before, 'perturbed': perturbed, 'scale': scaler.get_scale()},
                   os.path.join(out, f'rank{rank}.pt'))
        dist.barrier()  # leave together: gloo aborts a rank whose peer tore down first
    finally:
        dist.destroy_process_group()


def _both_ddp_workers(rank, world, ports, out):
    """This file's two 2-rank gloo runs, one after the other in the same spawned processes: each spawned child
    imports torch and this module (~3 s), once for both runs."""
    _ddp_worker(rank, world, ports[0], os.path.join(out, 'sam'))
    _ddp_groups_worker(rank, world, ports[1], os.path.join(out, 'groups'))


@pytest.fixture(scope='module')
def ddp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('ddp')
    (out / 'sam').mkdir()
    (out / 'groups').mkdir()
    ports = [free_port()]
    while len(ports) < 2:
        ports += [p for p in [free_port()] if p != ports[0]]
    mp.spawn(_both_ddp_workers, args=(2, ports, str(out)), nprocs=2, join=True)
    return out


def test_ddp_m_sharpness_matches_single_process(ddp_runs):
    world = 2
    res = [torch.load(ddp_runs / 'sam' / f'rank{r}.pt') for r in range(world)]

    # Oracle: one process, plain autograd. Each sub-batch perturbs with its own gradient
    # (no all-reduce); the second-pass gradients of the sub-batches are averaged.
    model = toy_mlp(0).to(F64)
    params = list(model.parameters())
    ref = torch.optim.SGD(params, lr=DDP_KW['lr'], momentum=DDP_KW['momentum'])
    per = DDP_BATCH // world
    for step in range(DDP_STEPS):
        x, y = toy_data(100 + step, DDP_BATCH)
        x = x.to(F64)
        w = clone_params(model)
        if step == DDP_OVERFLOW_STEP:
            # rank 0 overflowed in its first pass: it did not move, rank 1 did, and BOTH skipped,
            # leaving w exactly as it was
            r0, r1 = res
            assert torch.equal(_flat(r0['perturbed'][step]), _flat(r0['before'][step]))
            assert not torch.allclose(_flat(r1['perturbed'][step]), _flat(r1['before'][step]))
            for r in res:
                assert torch.equal(_flat(r['before'][step + 1]), _flat(r['before'][step]))
            continue
        g_sam = [torch.zeros_like(p) for p in params]
        for r in range(world):
            xr, yr = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
            g = _grads_at(model, params, xr, yr)
            norm = torch.linalg.vector_norm(_flat(g))
            with torch.no_grad():
                for p, gi in zip(params, g):
                    p.add_(DDP_KW['rho'] * gi / norm)
            for a, b in zip(res[r]['perturbed'][step], params):  # rank r's own eps
                assert a.dtype == F64
                torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-12)
            for gs, gi in zip(g_sam, _grads_at(model, params, xr, yr)):
                gs += gi / world
            with torch.no_grad():
                for p, wi in zip(params, w):
                    p.copy_(wi)
        for p, gs in zip(params, g_sam):
            p.grad = gs
        ref.step()
        # the two ranks did perturb differently (no all-reduce in the first pass)
        assert not torch.allclose(_flat(res[0]['perturbed'][step]), _flat(res[1]['perturbed'][step]))

    for a, b in zip(res[0]['final'], res[1]['final']):
        assert torch.equal(a, b)  # replicas stay bit-identical
    for a, b in zip(res[0]['final'], params):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-12)
    assert res[0]['scale'] == res[1]['scale'] == 2.0 ** 7  # one skipped step on both ranks


# -----------------------------------------------------------------------------
# 4. mixed precision
@pytest.mark.parametrize('adaptive', [False, True], ids=['sam', 'asam'])
def test_eps_is_invariant_to_loss_scale_and_first_gradient_clipping(adaptive):
    """eps = rho*g/||g|| (ASAM: rho*T^2 g/||T g||) ignores any rescaling of g: a loss scale, or
    clipping the first gradient, moves w exactly as the plain first pass does."""
    x, y = toy_data(0, 16)
    moved = []
    for scale, clip in ((1.0, None), (2.0 ** 16, None), (3.0e3, None), (1.0, 1e-3)):
        m = toy_mlp(0)
        opt = SAM(m.parameters(), torch.optim.SGD, rho=0.1, adaptive=adaptive, lr=0.1)
        (scale * F.cross_entropy(m(x), y)).backward()
        if clip:
            assert torch.nn.utils.clip_grad_norm_(m.parameters(), clip) > 100 * clip
        opt.first_step()
        moved.append(clone_params(m))
    w0 = clone_params(toy_mlp(0))
    assert max((a - b).abs().max() for a, b in zip(moved[0], w0)) > 1e-3  # w did move
    for other in moved[1:]:
        for a, b in zip(moved[0], other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _run(steps, base=torch.optim.SGD, autocast=None, scaler=None, rho=0.5, **kw):
    kw = kw or dict(lr=0.1, momentum=0.9)
    m = toy_mlp(0)
    opt = SAM(m.parameters(), base, rho=rho, **kw)
    for step in range(steps):
        x, y = toy_data(step, 32)
        _sam_step(m, opt, [(x, y)], scaler=scaler, autocast=autocast)
    return clone_params(m)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_autocast_matches_fp32(dtype):
    """bf16 autocast without a scaler; fp16 autocast with GradScaler('cpu'). The update after 3
    steps matches fp32 far more closely than it matches the plain (rho = 0) update."""
    w0 = clone_params(toy_mlp(0))
    fp32 = _run(3)
    plain = _run(3, rho=0.0)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 12) if dtype == torch.float16 else None
    amp = _run(3, autocast=lambda: torch.autocast('cpu', dtype=dtype), scaler=scaler)
    err = _update_rel_err(w0, amp, fp32)
    tol = 0.01 if dtype == torch.bfloat16 else 0.002
    assert err < tol
    assert _update_rel_err(w0, plain, fp32) > 10 * tol  # the tolerance does tell SAM from SGD
    if scaler is not None:
        assert scaler.get_scale() == 2.0 ** 12  # no step was skipped


def test_fp16_overflow_in_first_pass_skips_and_keeps_weights():
    """A real fp16 overflow (loss scale 2^40 under fp16 autocast): first_step does not move w and
    keeps the non-finite gradients; GradScaler skips the step; the scale halves; w is unchanged."""
    m = toy_mlp(0)
    opt = SAM(m.parameters(), torch.optim.AdamW, rho=0.1, lr=1e-2)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 40)
    x, y = toy_data(0, 32)
    w0 = clone_params(m)
    with first_pass(m):
        with torch.autocast('cpu', dtype=torch.float16):
            loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
    assert not all(torch.isfinite(p.grad).all() for p in m.parameters())
    opt.first_step(zero_grad=True)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), w0))
    assert not all(torch.isfinite(p.grad).all() for p in m.parameters())  # kept for the scaler
    with second_pass(m):
        with torch.autocast('cpu', dtype=torch.float16):
            loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), w0))
    assert len(opt.base_optimizer.state) == 0  # AdamW never stepped
    assert scaler.get_scale() == 2.0 ** 39


@pytest.mark.parametrize('where', ['first', 'second'])
def test_injected_overflow_skips_and_restores_exactly(where):
    """fp32 compute with an inf injected into one pass. An overflow in the SECOND pass is the
    dangerous case: w sits at w + eps, GradScaler skips the step, and SAM must still restore w."""
    m = toy_mlp(0)
    opt = SAM(m.parameters(), torch.optim.AdamW, rho=0.1, lr=1e-2)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
    x, y = toy_data(0, 32)
    w0 = clone_params(m)
    with first_pass(m):
        scaler.scale(F.cross_entropy(m(x), y)).backward()
    if where == 'first':
        m[0].weight.grad[0, 0] = float('inf')
    opt.first_step(zero_grad=True)
    moved = not all(torch.equal(p, q) for p, q in zip(m.parameters(), w0))
    assert moved == (where == 'second')
    with second_pass(m):
        scaler.scale(F.cross_entropy(m(x), y)).backward()
    if where == 'second':
        m[3].bias.grad[0] = float('nan')
    scaler.step(opt)  # without unscale_: the found_inf check happens inside GradScaler.step
    scaler.update()
    opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), w0))
    assert len(opt.base_optimizer.state) == 0
    assert scaler.get_scale() == 2.0 ** 7
    # and training goes on normally: the next step moves w and AdamW counts one step
    _sam_step(m, opt, [(x, y)], scaler=scaler)
    assert not all(torch.equal(p, q) for p, q in zip(m.parameters(), w0))
    assert all(float(s['step']) == 1 for s in opt.base_optimizer.state.values())


def test_gradscaler_with_or_without_unscale_call():
    """scaler.step(opt) unscales inside SAM.step when unscale_ was not called: same result, and
    (power-of-two scale, fp32 compute) the same as no scaler at all."""
    runs = []
    for unscale in (True, False):
        m = toy_mlp(0)  # SGD: its update is proportional to the gradient, so a missed unscale shows
        opt = SAM(m.parameters(), torch.optim.SGD, rho=0.1, lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10)
        for step in range(3):
            x, y = toy_data(step, 32)
            _sam_step(m, opt, [(x, y)], scaler=scaler, unscale=unscale)
        runs.append(clone_params(m))
    fp32 = _run(3, rho=0.1, lr=0.1, momentum=0.9)
    for a, b, c in zip(*runs, fp32):
        assert torch.equal(a, b) and torch.equal(a, c)


# -----------------------------------------------------------------------------
# 5. BatchNorm: the second pass leaves the running statistics alone
def test_second_pass_freezes_batchnorm_statistics():
    torch.manual_seed(0)
    model = convmixer.ConvMixer(dim=16, depth=2, kernel_size=3, patch_size=2, num_classes=10)
    clean = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1)
    with first_pass(model):
        F.cross_entropy(model(x), y).backward()
    opt.first_step(zero_grad=True)
    at_eps = copy.deepcopy(model)  # weights w + eps, statistics after the first pass
    with second_pass(model):
        F.cross_entropy(model(x), y).backward()
    g_sam = [p.grad.clone() for p in model.parameters()]
    opt.second_step(zero_grad=True)

    with torch.no_grad():
        clean(x)  # oracle: statistics of exactly one clean train-mode forward
    bns = [mod for mod in model.modules() if isinstance(mod, nn.BatchNorm2d)]
    assert len(bns) == 5 and all(mod.track_running_stats for mod in bns)
    for (name, a), (_, b) in zip(model.named_buffers(), clean.named_buffers()):
        assert torch.equal(a, b), name
    assert all(int(mod.num_batches_tracked) == 1 for mod in bns)
    # the second pass still normalised with batch statistics: same gradients as a plain pass
    F.cross_entropy(at_eps(x), y).backward()
    for a, p in zip(g_sam, at_eps.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-6)
    # without second_pass the statistics would have moved (so the check above can fail)
    with torch.no_grad():
        at_eps(x)
    assert not torch.equal(at_eps.stem[2].running_mean, clean.stem[2].running_mean)


# -----------------------------------------------------------------------------
# 6. gradient accumulation == one pass over the concatenated batch
def test_accumulation_equals_big_batch():
    """In float64: k micro-batches sum in another order than one batch (fp32 noise ~1e-7, CPU-dependent)."""
    m_acc, m_big = toy_mlp(0).to(F64), toy_mlp(0).to(F64)
    kw = dict(rho=0.2, lr=0.1, momentum=0.9)
    o_acc = SAM(m_acc.parameters(), torch.optim.SGD, **kw)
    o_big = SAM(m_big.parameters(), torch.optim.SGD, **kw)
    for step in range(3):
        x, y = toy_data(step, 24)
        x = x.to(F64)
        _sam_step(m_acc, o_acc, list(zip(x.chunk(4), y.chunk(4))))  # k = 4 micro-batches
        _sam_step(m_big, o_big, [(x, y)])
    for a, b in zip(m_acc.parameters(), m_big.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# -----------------------------------------------------------------------------
# 7. clipping after the second pass clips g_sam (before first_step it is a no-op: section 4)
def test_clipping_applies_to_the_second_gradient():
    lr, rho, clip = 0.1, 0.2, 0.05
    m = toy_mlp(0)
    oracle = toy_mlp(0)
    x, y = toy_data(0, 16)
    opt = SAM(m.parameters(), torch.optim.SGD, rho=rho, lr=lr)
    _sam_step(m, opt, [(x, y)], clip=clip)

    params = list(oracle.parameters())
    w = clone_params(oracle)
    g = _grads_at(oracle, params, x, y)
    norm = torch.linalg.vector_norm(_flat(g))
    with torch.no_grad():
        for p, gi in zip(params, g):
            p.add_(rho * gi / norm)
    g_sam = _grads_at(oracle, params, x, y)
    g_norm = torch.linalg.vector_norm(_flat(g_sam))
    assert g_norm > 2 * clip  # the clip is active
    c = clip / (g_norm + 1e-6)  # clip_grad_norm_'s factor
    for p, wi, gi in zip(m.parameters(), w, g_sam):
        torch.testing.assert_close(p.detach(), wi - lr * c * gi, rtol=1e-5, atol=1e-7)


# -----------------------------------------------------------------------------
# 8. weight decay is decoupled: it never enters eps
def test_weight_decay_is_not_part_of_eps():
    x, y = toy_data(0, 16)
    moved = []
    for wd in (0.0, 0.5):
        m = toy_mlp(0)
        opt = SAM(m.parameters(), torch.optim.AdamW, rho=0.1, lr=1e-2, weight_decay=wd)
        F.cross_entropy(m(x), y).backward()
        opt.first_step()
        moved.append(clone_params(m))
    for a, b in zip(*moved):
        assert torch.equal(a, b)


# -----------------------------------------------------------------------------
# API: closure, shared param groups, state_dict round trip, loud misuse
@pytest.mark.parametrize('bn', [False, True], ids=['layernorm', 'batchnorm'])
def test_step_with_closure_equals_two_step_loop(bn):
    """step(closure, model=...) is the written-out loop bit for bit, BatchNorm's running statistics included (issue
    45: the closure's second pass ran outside second_pass, so the statistics were updated at w + eps too)."""
    x, y = toy_data(0, 16)
    m1, m2 = toy_mlp(0, bn=bn), toy_mlp(0, bn=bn)
    o1 = SAM(m1.parameters(), torch.optim.AdamW, rho=0.1, lr=1e-2)
    o2 = SAM(m2.parameters(), torch.optim.AdamW, rho=0.1, lr=1e-2)

    def closure():
        o2.zero_grad()
        loss = F.cross_entropy(m2(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        with torch.no_grad():
            clean_loss = F.cross_entropy(copy.deepcopy(m1)(x), y)  # at w, before the step (a copy: BN's stats)
        _sam_step(m1, o1, [(x, y)])
        assert torch.equal(o2.step(closure, model=m2).detach(), clean_loss)
    for a, b in zip([*m1.parameters(), *m1.buffers()], [*m2.parameters(), *m2.buffers()]):
        assert torch.equal(a, b)
    if bn:  # the oracle: two clean train-mode forwards at the two steps' w (num_batches_tracked = 2, not 4)
        assert int(m2[1].num_batches_tracked) == 2
    with pytest.raises(TypeError, match=r'step\(closure\) needs the model too: optimizer.step\(closure, model=model\)'):
        o2.step(closure)


def test_param_groups_are_shared_so_schedulers_work_on_either():
    m = toy_mlp(0)
    opt = SAM(m.parameters(), torch.optim.SGD, rho=0.0, lr=1.0)
    assert opt.param_groups is opt.base_optimizer.param_groups
    on_base = torch.optim.lr_scheduler.StepLR(opt.base_optimizer, 1, gamma=0.5)
    on_sam = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.2)
    for lr in (1.0, 0.1):  # the second step runs at 1.0 * 0.5 * 0.2
        x, y = toy_data(0, 16)
        w0 = clone_params(m)
        g = _grads_at(m, list(m.parameters()), x, y)
        _sam_step(m, opt, [(x, y)])
        for p, wi, gi in zip(m.parameters(), w0, g):  # rho = 0: w - lr * g with the scheduled lr
            torch.testing.assert_close(p.detach(), wi - lr * gi)
        on_base.step()
        on_sam.step()
    opt.add_param_group({'params': [nn.Parameter(torch.zeros(2))]})
    assert opt.param_groups[-1]['rho'] == 0.0 and opt.param_groups[-1]['lr'] == 1.0
    assert len(opt.base_optimizer.param_groups) == 2


def test_state_dict_round_trip_resumes_exactly():
    kw = dict(rho=0.1, adaptive=True, lr=1e-2, weight_decay=0.05)

    def make(seed, rho):
        m = toy_mlp(seed)
        opt = SAM(m.parameters(), torch.optim.AdamW, **{**kw, 'rho': rho})
        return m, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)

    def train(m, opt, sched, steps):
        for step in steps:
            _sam_step(m, opt, [toy_data(step, 16)])
            sched.step()

    m, opt, sched = make(0, 0.1)
    train(m, opt, sched, range(2))
    buf = io.BytesIO()
    torch.save({'model': m.state_dict(), 'opt': opt.state_dict(), 'sched': sched.state_dict()}, buf)
    train(m, opt, sched, range(2, 4))

    m2, opt2, sched2 = make(1, 0.9)  # other init, other rho: all must come from the checkpoint
    buf.seek(0)
    ckpt = torch.load(buf)
    assert ckpt['opt']['param_groups'][0]['rho'] == 0.1 and ckpt['opt']['param_groups'][0]['adaptive']
    m2.load_state_dict(ckpt['model'])
    opt2.load_state_dict(ckpt['opt'])
    sched2.load_state_dict(ckpt['sched'])
    assert opt2.param_groups is opt2.base_optimizer.param_groups
    assert opt2.state is opt2.base_optimizer.state
    train(m2, opt2, sched2, range(2, 4))
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert opt2.param_groups[0]['lr'] == opt.param_groups[0]['lr']


def test_misuse_fails_loudly():
    m = toy_mlp(0)
    with pytest.raises(TypeError, match='optimizer class'):
        SAM(m.parameters(), torch.optim.SGD(m.parameters(), lr=0.1), rho=0.05)
    with pytest.raises(ValueError, match='rho'):
        SAM(m.parameters(), torch.optim.SGD, rho=-1.0, lr=0.1)
    opt = SAM(m.parameters(), torch.optim.SGD, lr=0.1)
    x, y = toy_data(0, 8)
    F.cross_entropy(m(x), y).backward()
    with pytest.raises(RuntimeError, match='first_step'):
        opt.step()  # a plain one-pass loop must not silently train without SAM
    opt.first_step()
    with pytest.raises(RuntimeError, match='twice'):
        opt.first_step()


def test_lr_scheduler_sees_second_step_and_warns_nothing():
    """second_step() goes through SAM.step, so a scheduler attached to SAM knows the optimizer
    stepped: PyTorch's "lr_scheduler.step() before optimizer.step()" warning must not appear."""
    import warnings
    m = toy_mlp(0)
    opt = SAM(m.parameters(), torch.optim.SGD, rho=0.1, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    x, y = toy_data(0, 16)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # any warning fails the test
        for _ in range(2):
            F.cross_entropy(m(x), y).backward()
            opt.first_step(zero_grad=True)
            F.cross_entropy(m(x), y).backward()
            opt.second_step(zero_grad=True)
            sched.step()
    assert opt.param_groups[0]['lr'] == 0.1 * 0.5 ** 2


# -----------------------------------------------------------------------------
# m-sharpness (Foret et al. Sec. 4.1): groups of m images, each with its own eps_hat
def _sam_group_step(model, opt, groups, scaler=None, micro=1, clip=None, plant=None):
    """One m-sharpness SAM step exactly as in the sam.py docstring loop: k = len(groups) groups,
    each cut into `micro` micro-batches; plant=j puts an inf into group j's first gradient."""
    k = len(groups)
    scaler = scaler or torch.amp.GradScaler('cpu', enabled=False)
    for j, (x, y) in enumerate(groups):
        parts = list(zip(x.chunk(micro), y.chunk(micro)))
        with first_pass(model):
            for xb, yb in parts:
                scaler.scale(F.cross_entropy(model(xb), yb) / micro).backward()
        if plant == j:
            next(model.parameters()).grad.view(-1)[0] = float('inf')
        opt.first_step(zero_grad=True)
        with second_pass(model, sync=j == k - 1):
            for i, (xb, yb) in enumerate(parts):
                last = (j == k - 1 and i == micro - 1) or not hasattr(model, 'no_sync')
                with contextlib.nullcontext() if last else model.no_sync():
                    scaler.scale(F.cross_entropy(model(xb), yb) / (k * micro)).backward()
        if j < k - 1:
            opt.next_group()
    scaler.unscale_(opt)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


M, M_STEPS = 4, 3  # group size, steps
M_KW = dict(rho=0.2, lr=0.1, momentum=0.9)
M_CONFIGS = [  # (model, dtype, groups per rank) for a 2-rank DDP run
    ('mlp', torch.float32, 1), ('bn', torch.float32, 1), ('mlp', F64, 1), ('bn', F64, 1),
    ('mlp', torch.float32, 2), ('bn', F64, 2)]


def _m_model(name, dtype):
    return toy_mlp(0, bn=name != 'mlp', dtype=dtype)  # BatchNorm: each group (rank) its own statistics


def _m_batch(step, n, dtype):
    x, y = toy_data(300 + step, n)
    return x.to(dtype), y


def _m_single_process(name, dtype, k, m=M):
    """The reference run: one process, batch k*m, m-sharpness with k groups of m."""
    model = _m_model(name, dtype)
    opt = SAM(model.parameters(), torch.optim.SGD, **M_KW)
    for step in range(M_STEPS):
        x, y = _m_batch(step, k * m, dtype)
        _sam_group_step(model, opt, list(zip(x.split(m), y.split(m))))
    return clone_params(model)


def _ddp_groups_worker(rank, world, port, out):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=world)
    try:
        res = []
        for name, dtype, g in M_CONFIGS:
            model = _m_model(name, dtype)
            ddp = nn.parallel.DistributedDataParallel(model)
            calls = []

            def hook(state, bucket):  # count the all-reduces of the SAM gradient
                calls.append(1)
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, hook)
            opt = SAM(ddp.parameters(), torch.optim.SGD, **M_KW)
            per = g * M
            for step in range(M_STEPS):
                x, y = _m_batch(step, world * per, dtype)
                xr, yr = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
                if g == 1:  # m = the per-device batch: the plain loop, each rank its own eps_hat
                    _sam_step(ddp, opt, [(xr, yr)])
                else:
                    _sam_group_step(ddp, opt, list(zip(xr.split(M), yr.split(M))))
            res.append({'final': clone_params(model), 'allreduces': len(calls)})
        torch.save(res, os.path.join(out, f'rank{rank}.pt'))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_m_sharpness_one_process_equals_ddp_ranks(ddp_runs):
    """One process with k groups of m images == k/g DDP ranks each with g groups of m (g = 1: the
    plain loop), with and without BatchNorm, fp32 and fp64; one all-reduce per step."""
    world = 2
    res = [torch.load(ddp_runs / 'groups' / f'rank{r}.pt') for r in range(world)]
    for i, (name, dtype, g) in enumerate(M_CONFIGS):
        single = _m_single_process(name, dtype, world * g)
        # fp64 is the exact check (rounding ~1e-16). fp32 only shows the fp32 path runs the same algorithm: the
        # gloo sum and one process's backward round apart by ~1e-7 relative a step (1e-6 seen on one CPU after
        # 3 steps, more possible on another), so 2e-5: still 50x below the m-sharpness difference (> 1e-3, below).
        tol = 2e-5 if dtype == torch.float32 else 1e-12
        for a, b, c in zip(res[0][i]['final'], res[1][i]['final'], single):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=0, atol=tol)
        assert res[0][i]['allreduces'] == res[1][i]['allreduces'] == M_STEPS, (name, g)


@pytest.mark.parametrize('name,dtype', [('mlp', torch.float32), ('bn', torch.float32), ('mlp', F64)])
def test_m_sharpness_differs_from_whole_batch(name, dtype):
    """So that the test above cannot pass trivially: groups of m move w far from one eps_hat for
    the whole batch of 2m (and from a plain step)."""
    w0 = clone_params(_m_model(name, dtype))
    groups = _m_single_process(name, dtype, 2)
    whole = _m_single_process(name, dtype, 1, m=2 * M)
    assert (_flat(groups) - _flat(whole)).abs().max() > 1e-3
    assert _update_rel_err(w0, groups, whole) > 0.01


@pytest.mark.parametrize('clip', [None, 0.05], ids=['noclip', 'clip'])
@pytest.mark.parametrize('adaptive', [False, True], ids=['sam', 'asam'])
def test_m_sharpness_two_groups_by_hand(adaptive, clip):
    """fp64, two groups, plain SGD: each group perturbs with its OWN clean gradient, the two SAM
    gradients are averaged, clipping (if any) clips the average; written out with autograd.grad."""
    rho, eta, lr = 0.3, 0.01, 0.5
    x, y = toy_data(7, 10)
    groups = list(zip(x.double().split(5), y.split(5)))
    model = toy_mlp(0).double()
    oracle = copy.deepcopy(model)
    opt = SAM(model.parameters(), torch.optim.SGD, rho=rho, adaptive=adaptive, eta=eta, lr=lr)
    _sam_group_step(model, opt, groups, clip=clip)

    params = list(oracle.parameters())
    w = clone_params(oracle)
    g_avg = [torch.zeros_like(p) for p in params]
    for xg, yg in groups:
        g = _grads_at(oracle, params, xg, yg)
        t = [wi.abs() + eta if adaptive else torch.ones_like(wi) for wi in w]
        norm = torch.linalg.vector_norm(_flat([ti * gi for ti, gi in zip(t, g)]))
        with torch.no_grad():
            for p, wi, ti, gi in zip(params, w, t, g):
                p.copy_(wi + rho * ti ** 2 * gi / norm)
        for ga, gs in zip(g_avg, _grads_at(oracle, params, xg, yg)):
            ga += gs / 2
        with torch.no_grad():
            for p, wi in zip(params, w):
                p.copy_(wi)
    c = 1.0
    if clip is not None:
        g_norm = torch.linalg.vector_norm(_flat(g_avg))
        assert g_norm > 2 * clip
        c = clip / (g_norm + 1e-6)
    for p, wi, ga in zip(model.parameters(), w, g_avg):
        torch.testing.assert_close(p.detach(), wi - lr * c * ga, rtol=0, atol=1e-12)


@pytest.mark.parametrize('micro', [1, 3])
@pytest.mark.parametrize('base,kw', [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
], ids=['sgd', 'adamw'])
def test_one_group_is_the_plain_step_bit_for_bit(base, kw, micro):
    """k = 1 (m = the whole batch) through the group loop == the plain loop: torch.equal on the
    weights and the optimizer state, with an enabled GradScaler and micro-batch accumulation."""
    runs = []
    for grouped in (False, True):
        m = toy_mlp(0, bn=True)
        opt = SAM(m.parameters(), base, rho=0.2, adaptive=True, **kw)
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
        for step in range(3):
            x, y = toy_data(step, 12)
            if grouped:
                _sam_group_step(m, opt, [(x, y)], scaler=scaler, micro=micro)
            else:
                _sam_step(m, opt, list(zip(x.chunk(micro), y.chunk(micro))), scaler=scaler)
        runs.append((m, opt))
    (m1, o1), (m2, o2) = runs
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = o1.state_dict()['state'], o2.state_dict()['state']
    assert s1.keys() == s2.keys() and len(s1) > 0
    for i in s1:
        for key in s1[i]:
            assert torch.equal(torch.as_tensor(s1[i][key]), torch.as_tensor(s2[i][key]))


def test_m_sharpness_micro_batches_inside_groups():
    """Accumulating each group over 3 micro-batches == each group in one pass (LayerNorm model), in float64
    (another summation order: fp32 would round apart by a CPU-dependent ~1e-7)."""
    runs = []
    for micro in (1, 3):
        m = toy_mlp(0).to(F64)
        opt = SAM(m.parameters(), torch.optim.SGD, **M_KW)
        for step in range(2):
            x, y = toy_data(step, 18)
            _sam_group_step(m, opt, list(zip(x.to(F64).split(9), y.split(9))), micro=micro)
        runs.append(clone_params(m))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize('bad', [0, 1, 2])
def test_m_sharpness_overflow_in_one_group_skips_the_step(bad):
    """An inf in group `bad`'s first gradient: that group does not move w (exactly), its gradient
    is kept in the sum, GradScaler skips the whole step, w is unchanged, and training goes on."""
    m = toy_mlp(0)
    opt = SAM(m.parameters(), torch.optim.AdamW, rho=0.1, lr=1e-2)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
    x, y = toy_data(0, 12)
    groups = list(zip(x.split(4), y.split(4)))
    w0 = clone_params(m)
    moved = []
    first_step = opt.first_step

    def spy(zero_grad=False):
        first_step(zero_grad)
        moved.append(not all(torch.equal(p, q) for p, q in zip(m.parameters(), w0)))
    opt.first_step = spy
    _sam_group_step(m, opt, groups, scaler=scaler, plant=bad)
    assert moved == [j != bad for j in range(3)]
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), w0))
    assert len(opt.base_optimizer.state) == 0  # AdamW never stepped
    assert scaler.get_scale() == 2.0 ** 7
    _sam_group_step(m, opt, groups, scaler=scaler)
    assert not all(torch.equal(p, q) for p, q in zip(m.parameters(), w0))
    assert all(float(s['step']) == 1 for s in opt.base_optimizer.state.values())


def test_m_sharpness_batchnorm_statistics_from_clean_passes():
    """With groups, the running statistics are those of the groups' clean forwards at w, in turn."""
    torch.manual_seed(0)
    model = convmixer.ConvMixer(dim=16, depth=1, kernel_size=3, patch_size=2, num_classes=10)
    clean = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    groups = list(zip(x.split(4), y.split(4)))
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1)
    _sam_group_step(model, opt, groups)
    with torch.no_grad():
        for xg, _ in groups:
            clean(xg)
    for (name, a), (_, b) in zip(model.named_buffers(), clean.named_buffers()):
        assert torch.equal(a, b), name


def test_m_sharpness_misuse_fails_loudly():
    m = toy_mlp(0)
    opt = SAM(m.parameters(), torch.optim.SGD, lr=0.1)
    x, y = toy_data(0, 8)
    with pytest.raises(RuntimeError, match='first_step'):
        opt.next_group()
    F.cross_entropy(m(x), y).backward()
    opt.first_step(zero_grad=True)
    with pytest.raises(RuntimeError, match='next_group'):
        opt.first_step()
    F.cross_entropy(m(x), y).backward()
    opt.next_group()
    with pytest.raises(RuntimeError, match='not after the last'):
        opt.step()


# -----------------------------------------------------------------------------
# no host sync in a SAM step without an enabled GradScaler
@contextlib.contextmanager
def _count_host_syncs():
    """Counts the Tensor methods that copy a value to the host (each a device sync on a GPU)."""
    calls = []
    names = ('item', 'tolist', '__bool__', '__float__', '__int__', '__index__', 'cpu', 'numpy')
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def counted(name, f):
        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return f(self, *args, **kwargs)
        return wrapper

    for n, f in originals.items():
        setattr(torch.Tensor, n, counted(n, f))
    try:
        yield calls
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize('k', [1, 2], ids=['plain', 'groups'])
@pytest.mark.parametrize('scaler', ['none', 'disabled', 'enabled'])
@pytest.mark.parametrize('adaptive', [False, True], ids=['sam', 'asam'])
def test_no_host_sync_in_the_sam_step(adaptive, scaler, k):
    """first_step, the second pass and the step read nothing back to the host; an enabled
    GradScaler (fp16) costs one read of found_inf, as GradScaler's own step does. SGD as the
    base: AdamW reads its step counter, a CPU tensor (no device sync, but counted here)."""
    m = toy_mlp(0, bn=True)
    opt = SAM(m.parameters(), torch.optim.SGD, rho=0.1, adaptive=adaptive, lr=0.1, momentum=0.9)
    gs = None if scaler == 'none' else torch.amp.GradScaler('cpu', enabled=scaler == 'enabled')
    x, y = toy_data(0, 8)
    w0 = clone_params(m)
    for j, (xg, yg) in enumerate(zip(x.chunk(k), y.chunk(k))):
        loss = F.cross_entropy(m(xg), yg)
        (loss if gs is None else gs.scale(loss)).backward()
        with _count_host_syncs() as calls:
            opt.first_step(zero_grad=True)
            with second_pass(m) if j == k - 1 else second_pass(m, sync=False):
                loss = F.cross_entropy(m(xg), yg) / k
                (loss if gs is None else gs.scale(loss)).backward()
            if j < k - 1:
                opt.next_group()
        assert calls == []
    with _count_host_syncs() as calls:
        if gs is None:
            opt.second_step(zero_grad=True)
        else:
            gs.step(opt)
    assert calls == (['item'] if scaler == 'enabled' else [])
    assert not all(torch.equal(p, q) for p, q in zip(m.parameters(), w0))  # it did step


@pytest.mark.parametrize('kw,error,message', [
    (dict(rho='0.05'), TypeError, "rho must be a real number, got str '0.05'"),
    (dict(rho=math.inf), ValueError, 'rho must be a finite number >= 0, got inf'),
    (dict(rho=math.nan), ValueError, 'rho must be a finite number >= 0, got nan'),
    (dict(eta='0.01', adaptive=True), TypeError, "eta must be a real number, got str '0.01'"),
    (dict(eta=math.inf, adaptive=True), ValueError, 'eta must be a finite number >= 0, got inf'),
    (dict(adaptive='no'), TypeError, "adaptive must be True or False, got str 'no'"),  # issue 34 SL09: 'no' was ASAM
])
def test_bad_rho_or_eta_is_refused_at_construction(kw, error, message):
    """A string used to fail deep in first_step; rho = inf was accepted and made every weight NaN after one
    step (inf / ||g||): refused with the reason, in the constructor and in a per-group setting alike."""
    m = toy_mlp(0)
    with pytest.raises(error, match=message):
        SAM(m.parameters(), torch.optim.SGD, lr=0.1, **kw)
    with pytest.raises(error, match=message):
        SAM([{'params': list(m.parameters()), **kw}], torch.optim.SGD, lr=0.1)
    opt = SAM(list(m.parameters())[:1], torch.optim.SGD, lr=0.1)
    with pytest.raises(error, match=message):
        opt.add_param_group({'params': list(m.parameters())[1:], **kw})
    assert len(opt.param_groups) == len(opt.base_optimizer.param_groups) == 1  # a refused group is not kept (GL20)
    opt.add_param_group({'params': list(m.parameters())[1:]})  # the same parameters with valid settings: they join
    assert len(opt.param_groups) == 2


def test_options_tested_for_truth_must_be_bools():
    """Issue 42 (GL09's kind): zero_grad='no' would zero the gradients, sync='no' would all-reduce."""
    m = toy_mlp(0)
    opt = SAM(m.parameters(), torch.optim.SGD, rho=0.1, lr=0.1)
    x, y = toy_data(0, 8)
    F.cross_entropy(m(x), y).backward()
    with pytest.raises(TypeError, match="zero_grad must be True or False, got str 'no'"):
        opt.first_step(zero_grad='no')
    opt.first_step(zero_grad=True)
    with pytest.raises(TypeError, match="sync must be True or False, got str 'no'"):
        with second_pass(m, sync='no'):
            pass
    F.cross_entropy(m(x), y).backward()
    with pytest.raises(TypeError, match='zero_grad must be True or False, got int 1'):
        opt.second_step(zero_grad=1)
    opt.second_step(zero_grad=True)  # nothing was done by the refused calls: the step finishes as usual


# -----------------------------------------------------------------------------
# issue 34
@pytest.mark.parametrize('adaptive', [False, True], ids=['sam', 'asam'])
def test_every_bucket_is_restored_after_the_step(adaptive):
    """first_step moves the parameters of each (group, device, dtype) bucket; the step restores all of them, not only
    the last bucket's. Two groups (as train_imagenet.py always builds: decay, no decay) and two dtypes; the base
    step is the identity (SGD at lr 0), so every parameter must come back bit for bit. Oracle: w before the step."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 3).double()
    groups = [dict(params=[a.weight, b.weight]), dict(params=[a.bias, b.bias], rho=0.2)]
    opt = SAM(groups, torch.optim.SGD, rho=0.1, adaptive=adaptive, lr=0.0)
    w0 = [p.detach().clone() for p in (a.weight, a.bias, b.weight, b.bias)]
    x = torch.randn(8, 4)
    loss = lambda: b(torch.tanh(a(x)).double()).square().sum()
    loss().backward()
    opt.first_step(zero_grad=True)
    assert not any(torch.equal(p, q) for p, q in zip((a.weight, a.bias, b.weight, b.bias), w0))  # all 4 moved
    loss().backward()
    opt.second_step(zero_grad=True)
    for p, q in zip((a.weight, a.bias, b.weight, b.bias), w0):
        assert torch.equal(p, q)


def test_next_group_before_first_step_names_next_group():
    """SL01: the message is about next_group(), not about second_step() / step()."""
    opt = SAM(toy_mlp(0).parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=r'SAM.next_group\(\) goes between two m-sharpness groups: after the '
                                           r'first_step\(\)'):
        opt.next_group()


def test_load_state_dict_the_saved_settings_win_as_documented():
    """SL13: as every torch optimizer, the file's rho (and lr, weight_decay) win over the constructor's; the
    docstring says so and names the way to keep new ones (runs.load_optimizer_state, tested in test_library)."""
    m = toy_mlp(0)
    old = SAM(m.parameters(), torch.optim.SGD, rho=0.05, lr=0.1)
    new = SAM(m.parameters(), torch.optim.SGD, rho=0.1, lr=0.1)
    new.load_state_dict(old.state_dict())
    assert new.param_groups[0]['rho'] == 0.05
    assert 'the saved state wins' in SAM.load_state_dict.__doc__
