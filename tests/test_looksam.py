"""LookSAM (looksam.py) against an fp64 transcription of Liu et al. 2022's Algorithm 1 written here (global vectors,
torch.autograd for the gradients, SGD with momentum written out), against sam.SAM (k = 1: bit for bit; alpha = 0:
SAM every k-th step and the base optimizer between, bit for bit), the base optimizer (rho = 0: bit for bit), the
decomposition's own properties (g_v orthogonal to g, the reuse term's norm alpha ||g||, zero gradients), the passes
counted, a single process with k groups (2 gloo ranks), GradScaler overflows and loss scales, a resume, and through
train_cifar.py's and train_imagenet.py's flags."""
import contextlib
import io
import json
import math
import os
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from looksam import LookSAM
from sam import SAM, first_pass, second_pass
from toys import all_equal, clone_params, flat_grad, free_port, toy_data, toy_mlp

F64 = torch.float64
pytestmark = pytest.mark.usefixtures('one_thread')  # tiny ops: a second thread only contends
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _look_step(model, opt, groups, scaler=None, clip=None, all_reduce=False, plant=None):
    """One step as looksam.py's docstring loop: refresh (opt.refresh) two passes per group, reuse one pass over the
    groups as micro-batches; plant=(pass, j): an inf in group j's first or second gradient."""
    scaler = scaler or torch.amp.GradScaler('cpu', enabled=False)
    two, k = opt.refresh, len(groups)
    for j, (x, y) in enumerate(groups):
        with first_pass(model) if two or j < k - 1 else contextlib.nullcontext():
            scaler.scale(F.cross_entropy(model(x), y) / (1 if two else k)).backward()
        if plant == ('first', j):
            next(model.parameters()).grad.view(-1)[0] = float('inf')
        if two:
            opt.first_step(zero_grad=True)
            with second_pass(model, sync=j == k - 1):
                scaler.scale(F.cross_entropy(model(x), y) / k).backward()
            if plant == ('second', j):
                list(model.parameters())[-1].grad[0] = float('nan')
            if j < k - 1:
                opt.next_group()
    opt.look_gradient(all_reduce=all_reduce)
    scaler.unscale_(opt)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


# -----------------------------------------------------------------------------
# The oracle: Algorithm 1 with g, g_s, g_v as flat fp64 vectors; SGD with momentum (torch's: buf = g first, then
# mu buf + g; no dampening) written out
def _oracle(k, alpha, rho, steps, lr=0.1, mu=0.9):
    model = toy_mlp(0, dtype=F64)
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buf = g_v = None
    for t in range(steps):
        x, y = toy_data(100 + t, 8, F64)
        g = flat_grad(model, w, x, y)
        if t % k == 0:
            g_s = flat_grad(model, w + rho * g / g.norm(), x, y)
            g_v = g_s - (g_s @ g) / (g @ g) * g
            g_hat = g_s
        else:
            g_hat = g + alpha * g.norm() / g_v.norm() * g_v
        buf = g_hat.clone() if buf is None else mu * buf + g_hat
        w = w - lr * buf
    return w


@pytest.mark.parametrize('alpha', [0.0, 0.7])
def test_matches_algorithm_1_in_fp64(alpha):
    """14 steps with k = 5: refreshes at t = 0, 5, 10, reuse steps between, against the transcription (fp64)."""
    model = toy_mlp(0, dtype=F64)
    opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.3, k=5, alpha=alpha, lr=0.1, momentum=0.9)
    for t in range(14):
        _look_step(model, opt, [toy_data(100 + t, 8, F64)])
    want = _oracle(5, alpha, 0.3, 14)
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.allclose(want, _oracle(5, 0.35 if alpha else 0.7, 0.3, 14), rtol=0, atol=1e-6)  # (it tells)


def test_per_tensor_option_is_another_algorithm():
    """per_tensor=True (the ports' variant): each tensor's own c and ||g_v||; not Algorithm 1 (fp64 oracle)."""
    runs = []
    for per_tensor in (False, True):
        model = toy_mlp(0, dtype=F64)
        opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.3, k=5, alpha=0.7, per_tensor=per_tensor, lr=0.1,
                      momentum=0.9)
        for t in range(7):
            _look_step(model, opt, [toy_data(100 + t, 8, F64)])
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(runs[0], _oracle(5, 0.7, 0.3, 7), rtol=0, atol=1e-12)
    assert (runs[0] - runs[1]).abs().max() > 1e-6


# -----------------------------------------------------------------------------
# Against sam.SAM and the base optimizer, bit for bit
BASES = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
         (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05))]


def _sam_step(model, opt, groups, two=True):
    """sam.py's docstring loop; two=False: one plain pass over the groups as micro-batches and the base step."""
    k = len(groups)
    for j, (x, y) in enumerate(groups):
        with first_pass(model) if two or j < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(model(x), y) / (1 if two else k)).backward()
        if two:
            opt.first_step(zero_grad=True)
            with second_pass(model, sync=j == k - 1):
                (F.cross_entropy(model(x), y) / k).backward()
            if j < k - 1:
                opt.next_group()
    opt.step() if two else opt.base_optimizer.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize('base,kw', BASES, ids=['sgd', 'adamw'])
@pytest.mark.parametrize('k,alpha', [(1, 0.7), (3, 0.0)], ids=['k1-is-sam', 'alpha0-is-sam-every-k'])
def test_k_one_is_sam_and_alpha_zero_is_sam_every_k_steps(base, kw, k, alpha):
    """BatchNorm, 2 m-sharpness groups: k = 1 is SAM on every step, alpha = 0 SAM on every k-th (bit for bit)."""
    runs = []
    for cls in (SAM, LookSAM):
        model = toy_mlp(0, bn=True)
        opt = cls(model.parameters(), base, rho=0.2, **kw, **(dict(k=k, alpha=alpha) if cls is LookSAM else {}))
        for t in range(7):
            x, y = toy_data(t, 8)
            groups = list(zip(x.split(4), y.split(4)))
            _look_step(model, opt, groups) if cls is LookSAM else _sam_step(model, opt, groups, two=t % k == 0)
        runs.append(clone_params(model) + [b.clone() for b in model.buffers()])
    assert all_equal(*runs)


@pytest.mark.parametrize('base,kw', BASES, ids=['sgd', 'adamw'])
def test_rho_zero_is_the_base_optimizer_bit_for_bit(base, kw):
    """rho = 0: g_s = g, so g_v = 0 exactly and the reuse term is 0: the base optimizer's run (k 3, alpha 0.7)."""
    runs = []
    for look in (False, True):
        model = toy_mlp(0, bn=True)
        opt = LookSAM(model.parameters(), base, rho=0.0, k=3, alpha=0.7, **kw) if look else base(model.parameters(),
                                                                                                 **kw)
        for t in range(7):
            x, y = toy_data(t, 8)
            if look:
                _look_step(model, opt, [(x, y)])
            else:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        runs.append(clone_params(model) + [b.clone() for b in model.buffers()])
    assert all_equal(*runs)


# -----------------------------------------------------------------------------
# The decomposition: g_v orthogonal to g, the reuse term's norm, zero gradients, the passes made
def _clean_grad(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize('per_tensor', [False, True], ids=['global', 'per-tensor'])
def test_g_v_is_orthogonal_to_g_and_the_reuse_term_has_norm_alpha_g(per_tensor):
    """fp64: after a refresh g_v/||g_v|| has norm 1 and <g_v, g> = 0 (1e-12; per tensor: each tensor's); on a reuse
    step look_gradient adds a term of norm alpha ||g|| (per tensor: alpha ||g_p||)."""
    model = toy_mlp(0, dtype=F64)
    opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.3, k=4, alpha=0.7, per_tensor=per_tensor, lr=0.1)
    x, y = toy_data(0, 8, F64)
    g = _clean_grad(model, x, y)
    _look_step(model, opt, [(x, y)])
    u = [opt.g_v[p] for p in model.parameters()]
    if per_tensor:
        for ui, gi in zip(u, g):
            assert abs(ui.norm().item() - 1) < 1e-12 and abs((ui * gi).sum().item()) < 1e-12 * gi.norm().item()
    else:
        assert abs(math.sqrt(sum(ui.square().sum().item() for ui in u)) - 1) < 1e-12
        dot, norm = sum((ui * gi).sum().item() for ui, gi in zip(u, g)), math.sqrt(sum(gi.square().sum().item()
                                                                                       for gi in g))
        assert abs(dot) < 1e-12 * norm
    x, y = toy_data(1, 8, F64)
    g = _clean_grad(model, x, y)
    F.cross_entropy(model(x), y).backward()
    opt.look_gradient()
    added = [p.grad - gi for p, gi in zip(model.parameters(), g)]
    if per_tensor:
        for a, gi in zip(added, g):
            assert abs(a.norm().item() - 0.7 * gi.norm().item()) < 1e-12 * gi.norm().item()
    else:
        norm = lambda ts: math.sqrt(sum(t.square().sum().item() for t in ts))  # noqa: E731
        assert abs(norm(added) - 0.7 * norm(g)) < 1e-12 * norm(g)


@pytest.mark.parametrize('per_tensor', [False, True], ids=['global', 'per-tensor'])
@pytest.mark.parametrize('where', ['one-tensor', 'everywhere'])
def test_zero_gradients_give_no_nan(per_tensor, where):
    """A tensor whose gradient is all zero (or every gradient zero) at a refresh and a reuse step: finite weights,
    finite g_v (0 there), no NaN (one port divides by its ||g_v|| there)."""
    model = toy_mlp(0)
    opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.1, k=2, alpha=0.7, per_tensor=per_tensor, lr=0.1,
                  momentum=0.9)
    params = list(model.parameters())
    for t in range(4):
        x, y = toy_data(t, 8)
        two = opt.refresh
        for _ in range(2 if two else 1):
            loss = F.cross_entropy(model(x), y) * (0.0 if where == 'everywhere' else 1.0)
            loss.backward()
            params[0].grad.zero_()  # the first layer's weight: a whole tensor with gradient 0
            if two and _ == 0:
                opt.first_step(zero_grad=True)
        opt.look_gradient()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(p.isfinite().all() for p in params) and all(v.isfinite().all() for v in opt.g_v.values())
    assert not opt.g_v[params[0]].any() and (where == 'everywhere' or opt.g_v[params[-1]].any())  # (g_v made)


@pytest.mark.parametrize('form', ['loop', 'closure'])
def test_forward_passes_over_t_steps_are_t_plus_ceil_t_over_k(form):
    """Counted by a forward hook: T + ceil(T/k) passes over T steps (k 5, T 12: 15), in the loop and the closure."""
    model = toy_mlp(0)
    passes = []
    model.register_forward_pre_hook(lambda *_: passes.append(1))
    opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.1, k=5, alpha=0.7, lr=0.1)
    for t in range(12):
        x, y = toy_data(t, 8)
        if form == 'loop':
            _look_step(model, opt, [(x, y)])
        else:
            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss
            opt.step(closure, model=model)
    assert len(passes) == 12 + math.ceil(12 / 5) and opt.t == 12


# -----------------------------------------------------------------------------
# DDP: 2 gloo ranks, each its own eps_hat on refresh steps, one explicit all-reduce of g there: = one process with
# the ranks' images as groups (reuse steps: the groups as micro-batches). MSAM (test_msam.py's) in the same spawn.
D_STEPS, D_M = 4, 4
D_CONFIGS = [('bn', 1), ('mlp', 2)]  # (model, groups per rank)
D_KW = dict(rho=0.3, k=2, alpha=0.7, lr=0.2, momentum=0.9)
M_KW = dict(rho=0.5, lr=0.2, momentum=0.9)  # MSAM


def _ddp_worker(rank, world, port, out):
    from msam import MSAM
    from test_msam import _msam_step
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world)
    try:
        patch = mock.patch.object(dist, 'all_reduce', wraps=dist.all_reduce)
        counted = patch.start()  # looksam.py calls torch.distributed.all_reduce: count its collectives
        res = []
        for name, g in D_CONFIGS + [('msam', 1)]:
            counted.reset_mock()
            model = toy_mlp(0, bn=name != 'mlp', dtype=F64)
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = MSAM(ddp.parameters(), torch.optim.SGD, **M_KW) if name == 'msam' else \
                LookSAM(ddp.parameters(), torch.optim.SGD, **D_KW)
            per = g * D_M
            for step in range(D_STEPS):
                x, y = toy_data(50 + step, world * per, F64)
                xr, yr = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
                if name == 'msam':
                    _msam_step(ddp, opt, [(xr, yr)])
                else:
                    _look_step(ddp, opt, list(zip(xr.split(D_M), yr.split(D_M))), all_reduce=True)
            res.append({'final': clone_params(model), 'allreduces': counted.call_count,
                        'g_v': [opt.g_v[p].clone() for p in model.parameters()] if name != 'msam' else []})
        patch.stop()
        torch.save(res, os.path.join(out, f'rank{rank}.pt'))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope='module')
def ddp_runs(tmp_path_factory):
    out, world = tmp_path_factory.mktemp('ddp'), 2
    mp.spawn(_ddp_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    return [torch.load(out / f'rank{r}.pt') for r in range(world)]


def test_ddp_ranks_equal_one_process_with_groups(ddp_runs):
    """2 ranks x g groups == 1 process x 2g groups (fp64, 1e-12; BatchNorm with g = 1) over 2 cycles of k = 2; the
    weights and the cached g_v identical on both ranks; one all-reduce of g per refresh, none on reuse steps."""
    for i, (name, g) in enumerate(D_CONFIGS):
        model = toy_mlp(0, bn=name == 'bn', dtype=F64)
        opt = LookSAM(model.parameters(), torch.optim.SGD, **D_KW)
        for step in range(D_STEPS):
            x, y = toy_data(50 + step, 2 * g * D_M, F64)
            _look_step(model, opt, list(zip(x.split(D_M), y.split(D_M))))
        for key in ('final', 'g_v'):
            assert all_equal(ddp_runs[0][i][key], ddp_runs[1][i][key]), (name, key)
        for a, c in zip(ddp_runs[0][i]['final'] + ddp_runs[0][i]['g_v'], clone_params(model) + list(opt.g_v.values())):
            torch.testing.assert_close(a, c, rtol=0, atol=1e-12)
        assert ddp_runs[0][i]['allreduces'] == D_STEPS // D_KW['k'], name


def test_msam_ddp_ranks_equal_one_process_with_micro_batches(ddp_runs):
    """MSAM (BatchNorm, SGD): the ranks' weights identical (the shift is made from m, the same on every rank), and
    equal to one process taking the two ranks' images as two micro-batches (fp64, 1e-12); no extra collective."""
    from msam import MSAM
    from test_msam import _msam_step
    model = toy_mlp(0, bn=True, dtype=F64)
    opt = MSAM(model.parameters(), torch.optim.SGD, **M_KW)
    for step in range(D_STEPS):
        x, y = toy_data(50 + step, 2 * D_M, F64)
        _msam_step(model, opt, list(zip(x.split(D_M), y.split(D_M))))
    assert all_equal(ddp_runs[0][-1]['final'], ddp_runs[1][-1]['final']) and ddp_runs[0][-1]['allreduces'] == 0
    for a, c in zip(ddp_runs[0][-1]['final'], clone_params(model)):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-12)


# -----------------------------------------------------------------------------
# GradScaler: an overflow skips the step with w and g_v exact; the loss scale cancels; clipping clips g_hat
@pytest.mark.parametrize('plant,at', [(('first', 1), 2), (('second', 0), 2), (('first', 0), 3)],
                         ids=['refresh-first-g1', 'refresh-second-g0', 'reuse'])
def test_overflow_skips_the_step_with_w_and_g_v_exact(plant, at):
    """An inf/nan in a refresh's first (group 1 of 2) or second pass, or in a reuse step's pass (k 2; the step at
    t = at, after a refresh at t = 0): the weights and the cached g_v are exactly as before the step, the scale is
    halved; the next step trains."""
    model = toy_mlp(0)
    opt = LookSAM(model.parameters(), torch.optim.AdamW, rho=0.2, k=2, alpha=0.5, lr=1e-2)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
    for step in range(at + 1):
        x, y = toy_data(step, 8)
        if step == at:
            w0, v0, scale = clone_params(model), {p: v.clone() for p, v in opt.g_v.items()}, scaler.get_scale()
        _look_step(model, opt, list(zip(x.split(4), y.split(4))), scaler, plant=plant if step == at else None)
    assert v0 and all_equal(clone_params(model), w0) and scaler.get_scale() == scale / 2
    assert v0.keys() == opt.g_v.keys() and all(torch.equal(v, opt.g_v[p]) for p, v in v0.items())
    _look_step(model, opt, [toy_data(9, 8)], scaler)
    assert not all_equal(clone_params(model), w0)


def test_loss_scale_and_clipping():
    """A power-of-two loss scale cancels exactly (g_v from scaled g and g_s, the reuse term scaling with g): the
    same weights as without a scaler, bit for bit. Clipping after look_gradient clips g_hat."""
    runs = []
    for scale in (None, 2.0 ** 10):
        model = toy_mlp(0)
        opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.2, k=3, alpha=0.7, lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler('cpu', init_scale=scale) if scale else None
        for t in range(7):
            _look_step(model, opt, [toy_data(t, 8)], scaler)
        runs.append(clone_params(model) + list(opt.g_v.values()))
    assert all_equal(*runs)
    model = toy_mlp(0)
    opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.2, k=3, alpha=0.7, lr=0.1)
    _look_step(model, opt, [toy_data(0, 8)])
    x, y = toy_data(1, 8)
    g = _clean_grad(model, x, y)
    F.cross_entropy(model(x), y).backward()
    opt.look_gradient()
    g_hat = [p.grad.clone() for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad for p in model.parameters()]
    assert abs(math.sqrt(sum(c.square().sum().item() for c in clipped)) - 0.01) < 1e-6
    assert all(torch.allclose(c * (h.norm() / c.norm()), h) for c, h in zip(clipped, g_hat) if c.norm() > 0)
    assert not all(torch.allclose(h, gi) for h, gi in zip(g_hat, g))  # (g_hat is not g)


# -----------------------------------------------------------------------------
# Resume, host syncs, misuse, bad settings (the leaf copied with sam.py alone: tests/test_library.py)
def test_state_dict_resume_mid_cycle_is_bit_identical():
    """7 steps (k 3) == 4 steps, state_dict (t = 4: mid-cycle, g_v of t = 3) through torch.save, a new optimizer,
    3 steps; AdamW, 2 m-sharpness groups, BatchNorm."""
    def run(cut):
        model = toy_mlp(0, bn=True)
        opt = LookSAM(model.parameters(), torch.optim.AdamW, rho=0.2, k=3, alpha=0.7, lr=1e-2)
        for t in range(7):
            if t == cut:
                buf = io.BytesIO()
                torch.save({'model': model.state_dict(), 'opt': opt.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=True)
                model = toy_mlp(1, bn=True)
                model.load_state_dict(saved['model'])
                opt = LookSAM(model.parameters(), torch.optim.AdamW, rho=0.2, k=3, alpha=0.7, lr=1e-2)
                opt.load_state_dict(saved['opt'])
                assert opt.t == 4 and not opt.refresh
            x, y = toy_data(t, 8)
            _look_step(model, opt, list(zip(x.split(4), y.split(4))))
        return clone_params(model)
    assert all_equal(run(None), run(4))


def test_no_host_sync_in_refresh_or_reuse_steps():
    from test_sam import _count_host_syncs
    model = toy_mlp(0, bn=True)
    opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.2, k=2, alpha=0.7, lr=0.1, momentum=0.9)
    for t in range(4):
        x, y = toy_data(t, 8)
        with _count_host_syncs() as calls:
            _look_step(model, opt, list(zip(x.split(4), y.split(4))))
        assert calls == [], t


def test_misuse_fails_loudly():
    model = toy_mlp(0)
    opt = LookSAM(model.parameters(), torch.optim.SGD, rho=0.2, k=2, lr=0.1)
    x, y = toy_data(0, 8)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match='this step is a refresh'):
        opt.look_gradient()
    opt.first_step(zero_grad=True)
    F.cross_entropy(model(x), y).backward()
    opt.look_gradient()
    with pytest.raises(RuntimeError, match='called twice'):
        opt.look_gradient()
    opt.step()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match='reuses g_v'):
        opt.first_step()


@pytest.mark.parametrize('kw,message', [(dict(k=0), 'k (steps per refresh) must be an integer >= 1, got 0'),
                                        (dict(k=2.5), 'got 2.5'), (dict(k=True), 'got True'),
                                        (dict(alpha=-0.1), 'alpha must be a finite number >= 0, got -0.1'),
                                        (dict(alpha=math.nan), 'got nan'), (dict(rho=-1.0), 'rho must be')])
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LookSAM(toy_mlp(0).parameters(), torch.optim.SGD, lr=0.1, **kw)


# -----------------------------------------------------------------------------
# The scripts: --look-k / --look-alpha (and test_msam.py's --msam) through train_cifar.py and train_imagenet.py
TINY = ['--model-kw', 'dim=16', 'depth=1', 'patch_size=4', 'kernel_size=3']  # ConvMixer with BatchNorm


def _cifar(cifar10_dir, out, *extra, epochs=2):
    """train_cifar.main on 100 images, batch 50 (2 steps an epoch) -> (the final state_dict, the train rows)."""
    import train_cifar
    common = ['--data', cifar10_dir, '--train-subset', 100, '--test-subset', 10, '--batch-size', 50, '--epochs',
              epochs, '--log-every', 0, *TINY]
    train_cifar.main([str(a) for a in [*common, *extra, '--out', out]])
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    return torch.load(out / 'last.pt', weights_only=True)['model'], [r for r in rows if r['kind'] == 'train']


def _same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


def _ctrl_c_at(monkeypatch, module, call):
    """module.train_step raises KeyboardInterrupt at its call-th call (counted from 1), as a Ctrl-C there."""
    real = module.train_step

    def stop(*a, **k):
        stop.calls += 1
        if stop.calls == call:
            raise KeyboardInterrupt
        return real(*a, **k)
    stop.calls = 0
    monkeypatch.setattr(module, 'train_step', stop)
    return real


def test_cifar_look_k_one_is_sam_and_rho_zero_is_the_base_optimizer(cifar10_dir, tmp_path):
    """train_cifar.py: --look-k 1 is --sam bit for bit (m 25); --look-k 3 --rho 0 is AdamW bit for bit; --look-k 3
    trains otherwise; its epoch rows hold the mean surrogate gap of their two-pass steps (t = 0, t = 3): epoch 1's is
    that of SAM's first step (SAM's row of step 1), not halved by the reuse step beside it."""
    w, rows = {}, {}
    for name, extra in (('sam', ['--sam', '--rho', 0.5, '--sam-m', 25, '--log-every', 1]), ('base', []),
                        ('look1', ['--sam', '--rho', 0.5, '--sam-m', 25, '--look-k', 1, '--log-every', 1]),
                        ('look3', ['--sam', '--rho', 0.5, '--sam-m', 25, '--look-k', 3]),  # (a row an epoch)
                        ('look3-rho0', ['--sam', '--rho', 0, '--look-k', 3])):  # (m = 50: the base's BatchNorm)
        w[name], rows[name] = _cifar(cifar10_dir, tmp_path / name, *extra)
    assert _same_state(w['sam'], w['look1']) and _same_state(w['base'], w['look3-rho0'])
    assert not _same_state(w['sam'], w['look3']) and not _same_state(w['base'], w['look3'])
    assert [r['surrogate_gap'] > 0 for r in rows['look3']] == [True, True]
    assert rows['look3'][0]['surrogate_gap'] == rows['sam'][0]['surrogate_gap']  # epoch 1: t = 0's, SAM's step 1


def test_cifar_looksam_stopped_mid_cycle_resumes_bit_identically(cifar10_dir, tmp_path, monkeypatch):
    """k 3 over 3 epochs of 2 steps: Ctrl-C in the first step of epoch 3; the resume starts at t = 4, mid-cycle, with
    the g_v of t = 3 from last.pt, and ends where the whole run ends (BatchNorm, 2 m-sharpness groups)."""
    import train_cifar
    flags = ['--sam', '--rho', 0.5, '--sam-m', 25, '--look-k', 3, '--look-alpha', 0.5]
    whole, _ = _cifar(cifar10_dir, tmp_path / 'whole', *flags, epochs=3)
    real = _ctrl_c_at(monkeypatch, train_cifar, 5)
    with pytest.raises(SystemExit):
        _cifar(cifar10_dir, tmp_path / 'cut', *flags, epochs=3)
    monkeypatch.setattr(train_cifar, 'train_step', real)
    assert torch.load(tmp_path / 'cut' / 'last.pt', weights_only=True)['optimizer']['looksam']['t'] == 4
    train_cifar.main(['--resume', str(tmp_path / 'cut' / 'last.pt')])
    assert _same_state(whole, torch.load(tmp_path / 'cut' / 'last.pt', weights_only=True)['model'])


def _imagenet(root, out, *extra, steps=4):
    """train_imagenet.main: a 1-block ViT, 2 micro-batches of 4 (m-sharpness groups of 2 with --sam-m 2), a
    checkpoint every step -> the final state_dict."""
    import train_imagenet
    common = ['--data', root, '--model', 'vit_ti16', '--model-kw', 'depth=1', 'dim=32', 'heads=2', '--img-size', 32,
              '--batch-size', 8, '--accum-steps', 2, '--max-steps', steps, '--log-every', 1, '--workers', 0,
              '--save-every', 1, '--lr', 0.01, '--warmup-steps', 1]
    train_imagenet.main([str(a) for a in [*common, *extra, '--out', out]])
    return torch.load(out / 'last.pt', weights_only=False)['model']


def test_imagenet_look_k_one_is_sam_and_a_stopped_cycle_resumes_bit_identically(imagenet_dir, tmp_path, monkeypatch):
    """train_imagenet.py: --look-k 1 is --sam bit for bit; LookSAM's rows (k 3, one a step) hold the surrogate gap of
    its two-pass steps only; stopped by Ctrl-C in step 3 (mid-cycle, the mid-epoch checkpoint of step 2) and resumed,
    it ends where the whole run ends."""
    import train_imagenet
    sam = ['--sam', '--rho', 0.5, '--sam-m', 2]
    w = {name: _imagenet(imagenet_dir, tmp_path / name, *sam, *extra)
         for name, extra in (('sam', []), ('look1', ['--look-k', 1]), ('look3', ['--look-k', 3]))}
    assert _same_state(w['sam'], w['look1']) and not _same_state(w['sam'], w['look3'])
    rows = [json.loads(line) for line in (tmp_path / 'look3' / 'metrics.jsonl').read_text().splitlines()]
    assert ['surrogate_gap' in r for r in rows if r['kind'] == 'train'] == [True, False, False, True]  # a row a step
    real = _ctrl_c_at(monkeypatch, train_imagenet, 3)
    with pytest.raises(SystemExit):
        _imagenet(imagenet_dir, tmp_path / 'cut', *sam, '--look-k', 3)
    monkeypatch.setattr(train_imagenet, 'train_step', real)
    train_imagenet.main(['--resume', str(tmp_path / 'cut' / 'last.pt'), '--max-steps', '4'])  # (not stored)
    assert _same_state(w['look3'], torch.load(tmp_path / 'cut' / 'last.pt', weights_only=False)['model'])


@pytest.mark.parametrize('script', ['train_cifar', 'train_imagenet'])
@pytest.mark.parametrize('argv,message', [
    (['--sam', '--look-k', '0'], '--look-k must be a finite number > 0, got 0'),
    (['--sam', '--look-alpha', '-1'], '--look-alpha must be a finite number >= 0, got -1.0'),
    (['--sam', '--look-alpha', 'nan'], '--look-alpha must be a finite number >= 0, got nan'),
    (['--look-k', '3', '--look-alpha', '0.2'], '--look-k, --look-alpha only act with --sam: add --sam'),
    (['--sam', '--look-k', '3', '--gsam-alpha', '0.1'], '--look-k above 1 (LookSAM'),
    (['--sam', '--msam'], '--msam replaces --sam'),
    (['--msam', '--adaptive', '--sam-m', '4'], '--adaptive, --sam-m only act with --sam: --msam takes --rho only'),
    (['--msam', '--rho', '-1'], '--rho must be a finite number >= 0, got -1.0'),
])
def test_bad_look_and_msam_flags_are_refused_in_one_line(script, argv, message):
    import utils
    mod = __import__(script)
    with pytest.raises(utils.UserError, match=re.escape(message)):
        mod.get_args(argv + (['--synthetic'] if script == 'train_imagenet' else []))


@pytest.mark.parametrize('method', ['looksam', 'msam'])
@pytest.mark.parametrize('script', ['train_cifar', 'train_imagenet'])
def test_the_scripts_train_step_is_the_leafs_loop(script, method):
    """Each script's written-out step (its train_step) equals the loop of looksam.py's / msam.py's docstring, bit for
    bit: 5 steps (k 2: refreshes and reuses), BatchNorm, 2 m-sharpness groups of 4 (train_imagenet: 2 micro-batches
    of 4, groups of 2; MSAM: the script's micro-batches)."""
    import argparse
    from msam import MSAM
    from test_msam import _msam_step
    mod = __import__(script)
    runs = []
    for loop in ('script', 'leaf'):
        model = toy_mlp(0, bn=True)
        opt = LookSAM(model.parameters(), torch.optim.AdamW, rho=0.2, k=2, alpha=0.7, lr=1e-2) if method == 'looksam' \
            else MSAM(model.parameters(), torch.optim.AdamW, rho=0.5, lr=1e-2)
        scaler = torch.amp.GradScaler('cpu', enabled=False)
        for t in range(5):
            x, y = toy_data(t, 8)
            m = 4 if script == 'train_cifar' else 2
            if loop == 'leaf':  # (MSAM: the script's micro-batches; train_cifar has none, no groups without --sam)
                n = m if method == 'looksam' else 8 if script == 'train_cifar' else 4
                groups = list(zip(x.split(n), y.split(n)))
                _look_step(model, opt, groups) if method == 'looksam' else _msam_step(model, opt, groups)
            elif script == 'train_cifar':
                args = argparse.Namespace(sam=method == 'looksam', clip_grad=0.0)
                mod.train_step(model, model, opt, scaler, nn.CrossEntropyLoss(), x, y, m, args,
                               contextlib.nullcontext())
            else:
                mod.train_step(model, opt, scaler, [(x[:4], y[:4]), (x[4:], y[4:])], sam=method == 'looksam',
                               clip_grad=0.0, sam_m=m)
        runs.append(clone_params(model) + [b.clone() for b in model.buffers()])
    assert all_equal(*runs)


@pytest.mark.parametrize('method', ['look', 'msam'])
def test_bench_times_the_leafs_loop_and_counts_its_passes(method):
    """bench.py's LookSAM call is a whole cycle of k = 5 steps of looksam.py's loop, its MSAM call msam.py's step, bit
    for bit against the loops written here (AdamW as bench builds it); 2 calls make 2 x 6 and 2 x 1 forward passes."""
    import copy
    import bench
    from msam import MSAM
    from test_msam import _msam_step
    step, module, opt, x, y = bench.make_step('convmixer_256_8', 'ours', 8, 4, 'off', False, torch.device('cpu'),
                                              sam=method)
    twin, kw = copy.deepcopy(module), dict(lr=1e-4, weight_decay=0.05, foreach=True)
    twin_opt = LookSAM(twin.parameters(), torch.optim.AdamW, k=5, **kw) if method == 'look' else \
        MSAM(twin.parameters(), torch.optim.AdamW, **kw)
    passes = []
    module.register_forward_pre_hook(lambda *_: passes.append(1))
    for _ in range(2):
        step()
        for t in range(5 if method == 'look' else 1):
            _look_step(twin, twin_opt, [(x, y)]) if method == 'look' else _msam_step(twin, twin_opt, [(x, y)])
    assert all_equal(clone_params(module), clone_params(twin)) and len(passes) == (12 if method == 'look' else 2)
