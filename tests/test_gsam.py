"""GSAM (gsam.GSAM) against an fp64 transcription of big_vision's gsam_gradient (the official JAX code,
big_vision/trainers/proj/gsam/gsam.py, written out here from that file with torch.autograd for jax), against
plain SAM (alpha = 0, rho_min = rho: bit for bit), the base optimizer (rho = 0: bit for bit), a single process with k
groups (k gloo ranks), GradScaler overflows, a resume, and through train_cifar.py's flags."""
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

from gsam import GSAM
from sam import SAM, first_pass, second_pass
from toys import clone_params, free_port, toy_data, toy_mlp

F64 = torch.float64


def _gsam_step(model, opt, groups, micro=1, scaler=None, clip=None, all_reduce=False, plant=None, autocast=None):
    """One GSAM step as the gsam.py docstring's loop: k = len(groups) groups of `micro` micro-batches; every
    backward under DDP's no_sync; plant=(pass, j): an inf in group j's first or second gradient; autocast: a
    context for the forward passes (not the backward, as torch.autocast asks)."""
    k, ctx = len(groups), autocast or contextlib.nullcontext
    scaler = scaler or torch.amp.GradScaler('cpu', enabled=False)
    for j, (x, y) in enumerate(groups):
        parts = list(zip(x.chunk(micro), y.chunk(micro)))
        with first_pass(model):
            for xb, yb in parts:
                with ctx():
                    loss = F.cross_entropy(model(xb), yb) / micro
                scaler.scale(loss).backward()
        if plant == ('first', j):
            next(model.parameters()).grad.view(-1)[0] = float('inf')
        opt.first_step(zero_grad=True)
        with second_pass(model, sync=False):
            for xb, yb in parts:
                with ctx():
                    loss = F.cross_entropy(model(xb), yb) / (k * micro)
                scaler.scale(loss).backward()
        if plant == ('second', j):
            list(model.parameters())[-1].grad[0] = float('nan')
        if j < k - 1:
            opt.next_group()
    opt.gsam_gradient(all_reduce=all_reduce)
    scaler.unscale_(opt)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


# -----------------------------------------------------------------------------
# The oracle: big_vision's gsam_gradient, line by line (pytrees -> dicts of tensors), in float64
def _dual_vector(y):
    gradient_norm = torch.sqrt(sum(torch.sum(torch.square(e)) for e in y.values()))
    return {k: x / gradient_norm for k, x in y.items()}, gradient_norm


def _gsam_gradient(loss_fn, params, inputs, targets, rho_max, rho_min, alpha, lr, lr_max, lr_min, eps=1e-12,
                   adaptive_perturbation=False, minimize_fp=True):
    def value_and_grad(ps, x, y):  # jax.value_and_grad, by torch.autograd.grad on fresh leaves
        ps = {k: v.detach().requires_grad_() for k, v in ps.items()}
        loss = loss_fn(ps, x, y)
        return dict(zip(ps, torch.autograd.grad(loss, list(ps.values())))), loss.detach()
    g_clean, l_clean = value_and_grad(params, inputs, targets)
    g_clean_normalized, g_clean_length = _dual_vector(g_clean)
    if lr_max == lr_min:
        sam_rho = rho_max
    else:
        sam_rho = rho_min + (rho_max - rho_min) * (lr - lr_min) / (lr_max - lr_min)
    if adaptive_perturbation:
        param_sam = {k: a + torch.abs(a) * sam_rho * g_clean[k] / (g_clean_length + eps) for k, a in params.items()}
    else:
        param_sam = {k: a + sam_rho * g_clean[k] / (g_clean_length + eps) for k, a in params.items()}
    g_robust, _ = value_and_grad(param_sam, inputs, targets)
    if minimize_fp:
        g_robust_normalized, _ = _dual_vector(g_robust)
        g_clean_projection_norm = sum(torch.vdot(g_robust_normalized[k].flatten(), g_clean[k].flatten())
                                      for k in params)
        g_clean_residual = {k: a - g_clean_projection_norm * g_robust_normalized[k] for k, a in g_clean.items()}
        g_gsam = {k: a - g_clean_residual[k] * alpha for k, a in g_robust.items()}
    else:
        g_clean_projection_norm = sum(torch.vdot(g_clean_normalized[k].flatten(), g_robust[k].flatten())
                                      for k in params)
        g_robust_residual = {k: a - g_clean_projection_norm * g_clean_normalized[k] for k, a in g_robust.items()}
        g_gsam = {k: a + g_robust_residual[k] * alpha for k, a in g_clean.items()}
    return l_clean, g_gsam


def _mlp_loss(ps, x, y):  # toy_mlp's forward (LayerNorm), written out
    h = F.layer_norm(F.linear(x, ps['0.weight'], ps['0.bias']), (16,), ps['1.weight'], ps['1.bias'])
    return F.cross_entropy(F.linear(F.gelu(h), ps['3.weight'], ps['3.bias']), y)


CFG = dict(rho_max=0.3, rho_min=0.1, alpha=0.4, lr_max=0.5, lr_min=0.05)
LRS = [0.5, 0.35, 0.2, 0.05]  # the lr of each step, along a decay from lr_max to lr_min


def _oracle_run(k, adaptive_perturbation, minimize_fp, clip=None):
    """fp64: per step the mean over the k groups of gsam_gradient (big_vision: per device, then pmean), clipped
    (after the pmean, as optax's clip_by_global_norm; with torch's 1e-6), then plain SGD w - lr d."""
    model = toy_mlp(0).to(F64)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step, lr in enumerate(LRS):
        x, y = toy_data(step, 4 * k, F64)
        ds = [_gsam_gradient(_mlp_loss, params, xg, yg, lr=lr, adaptive_perturbation=adaptive_perturbation,
                             minimize_fp=minimize_fp, **CFG)[1] for xg, yg in zip(x.split(4), y.split(4))]
        d = {n: sum(dj[n] for dj in ds) / k for n in params}
        if clip is not None:
            norm = torch.sqrt(sum(torch.sum(v ** 2) for v in d.values()))
            d = {n: v * torch.clamp(clip / (norm + 1e-6), max=1.0) for n, v in d.items()}  # (torch's 1e-6)
        params = {n: p - lr * d[n] for n, p in params.items()}
    return list(params.values())


def _gsam_run(k, adaptive_perturbation, minimize_fp, clip=None, micro=1):
    model = toy_mlp(0).to(F64)
    kw = {key: CFG[key] for key in ('rho_min', 'alpha', 'lr_max', 'lr_min')}
    opt = GSAM(model.parameters(), torch.optim.SGD, rho=CFG['rho_max'], lr=LRS[0], minimize_fp=minimize_fp,
               adaptive_perturbation=adaptive_perturbation, **kw)
    for step, lr in enumerate(LRS):
        for group in opt.param_groups:
            group['lr'] = lr
        x, y = toy_data(step, 4 * k, F64)
        _gsam_step(model, opt, list(zip(x.split(4), y.split(4))), micro=micro, clip=clip)
    return clone_params(model)


@pytest.mark.parametrize('minimize_fp,adaptive_perturbation,k,micro,clip', [
    (True, False, 1, 1, None), (True, True, 3, 2, 0.05), (False, False, 3, 2, 0.05), (False, True, 1, 1, None)],
    ids=['min-fp-sam-eps', 'min-fp-abs-w-3-groups-micro-clip', 'min-f-sam-eps-3-groups-micro-clip', 'min-f-abs-w'])
def test_matches_big_vision_gsam_gradient(minimize_fp, adaptive_perturbation, k, micro, clip):
    """4 steps with the lr decaying from lr_max to lr_min (rho_t from the lr, not from the schedule's factor: big_vision
    PR #8), both decompositions, both perturbations; k = 3 m-sharpness groups of 2 micro-batches, clipped after."""
    want = _oracle_run(k, adaptive_perturbation, minimize_fp, clip)
    got = _gsam_run(k, adaptive_perturbation, minimize_fp, clip, micro)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_oracle_tells_the_variants_apart():
    """So that the test above cannot pass trivially: alpha, rho_t and the decomposition each move w by far more
    than its tolerance."""
    base = _oracle_run(1, False, True)
    for other in (_oracle_run(1, True, True), _oracle_run(1, False, False)):
        assert max((a - b).abs().max().item() for a, b in zip(base, other)) > 1e-4
    cfg = dict(CFG)
    for change in (dict(alpha=0.0), dict(rho_min=CFG['rho_max']), dict(lr_max=1.0, lr_min=0.1)):  # 0.1: the factor
        CFG.update(change)
        try:
            other = _oracle_run(1, False, True)
        finally:
            CFG.clear()
            CFG.update(cfg)
        assert max((a - b).abs().max().item() for a, b in zip(base, other)) > 1e-4, change


# -----------------------------------------------------------------------------
# Special cases: alpha = 0 and rho_min = rho is SAM; rho = 0 is the base optimizer (bit for bit)
def _sam_loop_step(model, opt, groups, scaler=None):
    """One SAM step as the sam.py docstring's group loop (the DDP-free form)."""
    k = len(groups)
    scaler = scaler or torch.amp.GradScaler('cpu', enabled=False)
    for j, (x, y) in enumerate(groups):
        with first_pass(model):
            scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.first_step(zero_grad=True)
        with second_pass(model, sync=j == k - 1):
            scaler.scale(F.cross_entropy(model(x), y) / k).backward()
        if j < k - 1:
            opt.next_group()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


BASES = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)), (torch.optim.AdamW, dict(lr=1e-2))]


@pytest.mark.parametrize('base,kw,k', [(*BASES[0], 1), (*BASES[1], 3)], ids=['sgd-1-group', 'adamw-3-groups'])
def test_alpha_zero_and_constant_rho_is_sam_bit_for_bit(base, kw, k):
    """fp32, BatchNorm, a GradScaler, the lr changing every step (rho_t = rho since rho_min = rho), k groups."""
    runs = []
    for make in (lambda ps: SAM(ps, base, rho=0.2, adaptive=True, **kw),
                 lambda ps: GSAM(ps, base, rho=0.2, rho_min=0.2, alpha=0.0, lr_max=kw['lr'], lr_min=0.0,
                                 adaptive=True, **kw)):
        model = toy_mlp(0, bn=True)
        opt, scaler = make(model.parameters()), torch.amp.GradScaler('cpu', init_scale=2.0 ** 6)
        for step in range(4):
            for group in opt.param_groups:
                group['lr'] = kw['lr'] * (1 - step / 4)
            x, y = toy_data(step, 4 * k)
            groups = list(zip(x.split(4), y.split(4)))
            (_gsam_step if isinstance(opt, GSAM) else _sam_loop_step)(model, opt, groups, scaler=scaler)
        runs.append([*clone_params(model), *model[1].buffers()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize('base,kw,minimize_fp', [(*BASES[0], False), (*BASES[1], True)], ids=['sgd-min-f', 'adamw'])
def test_rho_zero_trains_as_the_base_optimizer(base, kw, minimize_fp):
    """rho = 0: g_p = g, so g_perp = 0 exactly and GSAM (any alpha) and SAM give the base optimizer's weights and
    BatchNorm statistics bit for bit (davda54/sam#80 asks this of SAM; both are checked here)."""
    runs = []
    for kind in ('base', 'sam', 'gsam'):
        model = toy_mlp(0, bn=True)
        opt = base(model.parameters(), **kw) if kind == 'base' else SAM(model.parameters(), base, rho=0.0, **kw) \
            if kind == 'sam' else GSAM(model.parameters(), base, rho=0.0, alpha=0.5, minimize_fp=minimize_fp, **kw)
        for step in range(4):
            x, y = toy_data(step, 8)
            if kind == 'base':
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                (_sam_loop_step if kind == 'sam' else _gsam_step)(model, opt, [(x, y)])
        runs.append([*clone_params(model), *model[1].buffers()])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


# -----------------------------------------------------------------------------
# DDP: 2 gloo ranks, each its own g_p decomposed, then the mean: = one process with the ranks' images as groups
G_STEPS, G_M = 3, 4
G_CONFIGS = [('bn', 1), ('mlp', 2), ('closure', 1)]  # (model, groups per rank); closure: BatchNorm, step(closure)
G_KW = dict(rho=0.3, rho_min=0.1, alpha=0.4, lr_max=0.2, lr_min=0.0, lr=0.2, momentum=0.9)


def _g_lr(step):
    return G_KW['lr'] * (1 - step / G_STEPS)


def _ddp_worker(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world)
    try:
        patch = mock.patch.object(dist, 'all_reduce', wraps=dist.all_reduce)
        counted = patch.start()  # sam.py calls torch.distributed.all_reduce: count its collectives
        res = []
        for name, g in G_CONFIGS:
            counted.reset_mock()
            model = toy_mlp(0, bn=name != 'mlp').to(F64)
            ddp = nn.parallel.DistributedDataParallel(model)
            hooked = []
            ddp.register_comm_hook(None, lambda state, bucket: hooked.append(1) or
                                   torch.futures.Future().set_result(bucket.buffer()))
            opt = GSAM(ddp.parameters(), torch.optim.SGD, **G_KW)
            per = g * G_M
            for step in range(G_STEPS):
                for group in opt.param_groups:
                    group['lr'] = _g_lr(step)
                x, y = toy_data(50 + step, world * per, F64)
                xr, yr = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
                if name == 'closure':  # both passes under no_sync, then gsam_gradient's all-reduce (issue 45)
                    def closure():
                        opt.zero_grad()
                        loss = F.cross_entropy(ddp(xr), yr)
                        loss.backward()
                        return loss
                    opt.step(closure, model=ddp)
                    opt.zero_grad(set_to_none=True)
                else:
                    _gsam_step(ddp, opt, list(zip(xr.split(G_M), yr.split(G_M))), all_reduce=True)
            res.append({'final': clone_params(model), 'allreduces': counted.call_count, 'ddp_buckets': len(hooked)})
        patch.stop()
        torch.save(res, os.path.join(out, f'rank{rank}.pt'))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_equal_one_process_with_groups(tmp_path):
    """2 ranks x g groups == 1 process x 2g groups (fp64; BatchNorm with g = 1): each rank decomposes its own
    g_p, the mean (not the sum) over ranks follows, in ONE all-reduce per step and none by DDP's buckets; the same
    through step(closure, model=ddp)."""
    world = 2
    mp.spawn(_ddp_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    res = [torch.load(tmp_path / f'rank{r}.pt') for r in range(world)]
    for i, (name, g) in enumerate(G_CONFIGS):
        model = toy_mlp(0, bn=name != 'mlp').to(F64)
        opt = GSAM(model.parameters(), torch.optim.SGD, **G_KW)
        for step in range(G_STEPS):
            for group in opt.param_groups:
                group['lr'] = _g_lr(step)
            x, y = toy_data(50 + step, world * g * G_M, F64)
            _gsam_step(model, opt, list(zip(x.split(G_M), y.split(G_M))))
        for a, b, c in zip(res[0][i]['final'], res[1][i]['final'], clone_params(model)):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=0, atol=1e-12)
        assert res[0][i]['allreduces'] == G_STEPS and res[0][i]['ddp_buckets'] == 0, (name, g)


# -----------------------------------------------------------------------------
# GradScaler: an overflow in either pass (of any group) skips the step with w exact; resume; no host sync
@pytest.mark.parametrize('plant,alpha', [(('first', 0), 0.5), (('second', 0), 0.0), (('first', 1), 0.0),
                                         (('second', 1), 0.5)], ids=['first-g0', 'second-g0', 'first-g1', 'second-g1'])
def test_overflow_in_either_pass_skips_with_w_exact(plant, alpha):
    model = toy_mlp(0)
    opt = GSAM(model.parameters(), torch.optim.AdamW, rho=0.2, alpha=alpha, lr=1e-2)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
    x, y = toy_data(0, 8)
    w0 = clone_params(model)
    _gsam_step(model, opt, list(zip(x.split(4), y.split(4))), scaler=scaler, plant=plant)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), w0))
    assert len(opt.base_optimizer.state) == 0 and scaler.get_scale() == 2.0 ** 7
    _gsam_step(model, opt, list(zip(x.split(4), y.split(4))), scaler=scaler)  # and it trains on
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), w0))


def test_real_fp16_overflow_skips():
    """fp16 autocast with a loss scale of 2^40: both passes overflow; w stays, the scale halves."""
    model = toy_mlp(0)
    opt = GSAM(model.parameters(), torch.optim.AdamW, rho=0.2, alpha=0.3, lr=1e-2)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 40)
    x, y = toy_data(0, 8)
    w0 = clone_params(model)
    _gsam_step(model, opt, [(x, y)], scaler=scaler, autocast=lambda: torch.autocast('cpu', dtype=torch.float16))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), w0)) and scaler.get_scale() == 2.0 ** 39


def test_bf16_autocast_close_to_fp32():
    """bf16 autocast (no scaler): the update after 3 steps is within 2% of fp32's, and 2% tells GSAM from SAM."""
    runs = []
    for ctx, alpha in ((None, 0.4), (lambda: torch.autocast('cpu', dtype=torch.bfloat16), 0.4), (None, 0.0)):
        model = toy_mlp(0)
        opt = GSAM(model.parameters(), torch.optim.SGD, rho=0.5, rho_min=0.1, alpha=alpha, lr_max=0.1, lr_min=0,
                   lr=0.1, momentum=0.9)
        for step in range(3):
            _gsam_step(model, opt, [toy_data(step, 32)], autocast=ctx)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    w0 = torch.cat([p.detach().flatten() for p in toy_mlp(0).parameters()])
    err = [((run - runs[0]).norm() / (runs[0] - w0).norm()).item() for run in runs[1:]]
    assert err[0] < 0.02 < err[1], err


def test_state_dict_resume_mid_run_is_bit_identical():
    kw = dict(rho=0.3, rho_min=0.1, alpha=0.4, lr_max=1e-2, lr_min=0.0, lr=1e-2, weight_decay=0.05)

    def train(model, opt, steps):
        for step in steps:
            for group in opt.param_groups:
                group['lr'] = kw['lr'] * (1 - step / 6)
            _gsam_step(model, opt, list(zip(*(t.split(4) for t in toy_data(step, 8)))))

    model = toy_mlp(0, bn=True)
    opt = GSAM(model.parameters(), torch.optim.AdamW, **kw)
    train(model, opt, range(3))
    buf = io.BytesIO()
    torch.save({'model': model.state_dict(), 'opt': opt.state_dict()}, buf)
    train(model, opt, range(3, 6))
    buf.seek(0)
    ckpt = torch.load(buf)
    assert ckpt['opt']['param_groups'][0]['alpha'] == 0.4 and ckpt['opt']['param_groups'][0]['rho_min'] == 0.1
    model2 = toy_mlp(1, bn=True)
    opt2 = GSAM(model2.parameters(), torch.optim.AdamW, **kw)
    model2.load_state_dict(ckpt['model'])
    opt2.load_state_dict(ckpt['opt'])
    assert opt2.param_groups is opt2.base_optimizer.param_groups
    train(model2, opt2, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_closure_form_equals_the_loop():
    """step(closure, model=...) is the written-out loop bit for bit, BatchNorm's running statistics included (issue
    45: the second pass ran outside second_pass, so the statistics were updated at w + eps too)."""
    runs = []
    for closure in (False, True):
        model = toy_mlp(0, bn=True)
        opt = GSAM(model.parameters(), torch.optim.SGD, rho=0.3, alpha=0.4, lr=0.1, momentum=0.9)
        for step in range(3):
            x, y = toy_data(step, 8)
            if closure:
                def f():
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    return loss
                opt.step(f, model=model)
                opt.zero_grad(set_to_none=True)
            else:
                _gsam_step(model, opt, [(x, y)])
        runs.append([*clone_params(model), *model.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert int(model[1].num_batches_tracked) == 3  # one clean forward a step


# -----------------------------------------------------------------------------
# The scripts: train_cifar.py and train_imagenet.py --gsam-alpha / --rho-min, the surrogate gap in metrics.jsonl
TINY = ['--model-kw', 'dim=16', 'depth=1', 'patch_size=4', 'kernel_size=3']  # ConvMixer with BatchNorm


def _cifar(cifar10_dir, out, *extra):
    import train_cifar
    common = ['--data', cifar10_dir, '--train-subset', 100, '--test-subset', 10, '--batch-size', 50, '--epochs', 2,
              '--log-every', 0, *TINY]
    train_cifar.main([str(a) for a in [*common, *extra, '--out', out]])
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    return torch.load(out / 'last.pt', weights_only=True)['model'], [r for r in rows if r['kind'] == 'train']


def test_cifar_flags_sam_and_base_identities_and_the_gap(cifar10_dir, tmp_path, one_thread, capsys):
    """train_cifar.py: --gsam-alpha 0 --rho-min = --rho is --sam bit for bit; --rho 0 (SAM, GSAM) is the base
    optimizer bit for bit; GSAM proper trains elsewhere; SAM/GSAM rows hold the surrogate gap, > 0 at rho > 0. The
    header names rho_min (--rho when unset, not None) and the LR range rho_t follows."""
    w, rows = {}, {}
    for name, extra in (('sam', ['--sam', '--rho', 0.5]), ('gsam0', ['--sam', '--rho', 0.5, '--gsam-alpha', 0,
                                                                       '--rho-min', 0.5]),
                        ('gsam', ['--sam', '--rho', 0.5, '--gsam-alpha', 0.5, '--rho-min', 0.1]), ('base', []),
                        ('sam-rho0', ['--sam', '--rho', 0]), ('gsam-rho0', ['--sam', '--rho', 0, '--gsam-alpha', 0.5])):
        capsys.readouterr()
        w[name], rows[name] = _cifar(cifar10_dir, tmp_path / name, *extra)
        header = capsys.readouterr().out
        peak = 0.05 * (1 - 0.95 / 2)  # --epochs 2 of 2 steps: locuslab's cycle at t = 1/2 epoch (--lr 0.05)
        assert ('GSAM' in header) == name.startswith('gsam') and 'None' not in header, header
        assert name != 'gsam' or f'| GSAM alpha 0.5 rho_min 0.1 at LR 0 .. rho 0.5 at LR {peak:g} |' in header
        assert name != 'gsam-rho0' or f'| GSAM alpha 0.5 rho_min 0.0 at LR 0 .. rho 0.0 at LR {peak:g} |' in header
    same = lambda a, b: all(torch.equal(v, w[b][k]) for k, v in w[a].items())  # noqa: E731
    assert same('sam', 'gsam0') and same('base', 'sam-rho0') and same('base', 'gsam-rho0')
    assert not same('sam', 'gsam')
    assert all('surrogate_gap' not in r for r in rows['base']) and len(rows['sam']) == 2
    assert all(r['surrogate_gap'] > 0 for name in ('sam', 'gsam') for r in rows[name])
    assert all(r['surrogate_gap'] == 0 for r in rows['sam-rho0'])


def test_cifar_gsam_resumes_bit_identically(cifar10_dir, tmp_path, one_thread, monkeypatch):
    """A GSAM run stopped in epoch 2 and resumed (rho_t from the same schedule) ends where the whole run ends."""
    import train_cifar
    flags = ['--sam', '--rho', 0.5, '--gsam-alpha', 0.3, '--rho-min', 0.1, '--sam-m', 25]
    whole, _ = _cifar(cifar10_dir, tmp_path / 'whole', *flags)
    real = train_cifar.train_step

    def stop(*a, **k):  # the first step of epoch 2 (2 steps an epoch)
        stop.calls += 1
        if stop.calls == 3:
            raise KeyboardInterrupt
        return real(*a, **k)
    stop.calls = 0
    monkeypatch.setattr(train_cifar, 'train_step', stop)
    with pytest.raises(SystemExit):
        _cifar(cifar10_dir, tmp_path / 'cut', *flags)
    monkeypatch.setattr(train_cifar, 'train_step', real)
    train_cifar.main(['--resume', str(tmp_path / 'cut' / 'last.pt')])
    resumed = torch.load(tmp_path / 'cut' / 'last.pt', weights_only=True)['model']
    assert all(torch.equal(v, resumed[k]) for k, v in whole.items())


@pytest.mark.parametrize('epochs,peak', [(1, 0.05 / 20 * (1 - 1 / 4)), (2, 0.05 * (1 - 0.95 / 4)), (5, 0.05)])
def test_cifar_gsam_rho_t_reaches_rho_at_the_schedules_real_peak(epochs, peak):
    """C26: at --epochs 1 locuslab's one cycle (breakpoints 0, 0, 0, 1 epochs) never comes near --lr: lr_max was --lr,
    so rho_t stayed near --rho-min. lr_max is now the highest LR the loop sets (4 steps an epoch; closed forms of the
    cycle: lr/20 (1 - t) at --epochs 1, lr (1 - 0.95 t) at 2, for t <= 1 epoch; --lr at 5), where rho_t = --rho."""
    import train_cifar
    args = train_cifar.get_args(['--data', 'x', '--sam', '--rho', '0.1', '--rho-min', '0.02', '--gsam-alpha', '0.3',
                                 '--lr', '0.05', '--epochs', str(epochs)])
    opt = train_cifar.make_optimizer(args, nn.Linear(2, 2), 4)
    assert opt.lr_max == pytest.approx(peak, rel=1e-12) and opt.lr_min == 0.0
    opt.param_groups[0]['lr'] = peak
    assert opt.radius(opt.param_groups[0]) == pytest.approx(0.1, rel=1e-12)


@pytest.mark.parametrize('sched,warmup,peak,low', [('linear', 10, 0.05 * 4 / 10, 0.05 / 10), ('linear', 2, 0.05, 0),
                                                   ('cosine', 0, 0.05, 0), ('onecycle', 0, 0.05 / 20 * (1 - 1 / 4), 0)])
def test_imagenet_gsam_rho_t_reaches_rho_at_the_schedules_real_peak(sched, warmup, peak, low):
    """C26's kind in train_imagenet.py: a run shorter than its warm-up (4 steps of a 10-step warm-up: the LRs are
    1/10 .. 4/10 of --lr) or locuslab's one cycle at --epochs 1 never reaches --lr; lr_max is the highest LR it does
    reach and lr_min its lowest (closed forms: the end of the schedule, 0, or the warm-up's first step); --lr where
    the warm-up ends inside the run. (A 10-step warm-up in 4 steps used to give lr_min = 5/10 of --lr, the LR of a
    step after the run's end.)"""
    import train_imagenet
    args = train_imagenet.get_args(['--synthetic', '--sam', '--rho', '0.1', '--rho-min', '0.02', '--lr', '0.05',
                                    '--epochs', '1', '--sched', sched, '--warmup-steps', str(warmup)])
    opt = train_imagenet.make_optimizer(args, nn.Linear(2, 2), 4)
    assert opt.lr_max == pytest.approx(peak, rel=1e-12) and opt.lr_min == pytest.approx(low, rel=1e-12, abs=0)


@pytest.mark.parametrize('script', ['train_cifar', 'train_imagenet'])
def test_a_stored_rho_min_above_a_new_rho_names_the_file(script, tmp_path):
    """R03 / J13: --resume with a lower --rho than the run's --rho-min: the line says the value came from the run."""
    import runs
    import utils
    mod, extra = __import__(script), (['--synthetic'] if script == 'train_imagenet' else ['--data', 'x'])
    args = mod.get_args(['--sam', '--rho', '0.1', '--rho-min', '0.02', '--gsam-alpha', '0.3', *extra])
    ckpt = {**{k: {} for k in runs.RUN_KEYS}, 'args': {k: v for k, v in vars(args).items() if k != 'saved_args'}}
    if script == 'train_imagenet':
        ckpt['steps_per_epoch'] = 1
    torch.save(ckpt, tmp_path / 'last.pt')
    message = '--rho-min must be a finite number >= 0 and <= 0.01, got 0.02'
    with pytest.raises(utils.UserError, match=re.escape(f'{message} (from the args stored in {tmp_path / "last.pt"})')):
        mod.get_args(['--resume', str(tmp_path / 'last.pt'), '--rho', '0.01'])
    with pytest.raises(utils.UserError, match=re.escape(message) + '$'):  # typed: no pointer to the file
        mod.get_args(['--resume', str(tmp_path / 'last.pt'), '--rho', '0.01', '--rho-min', '0.02'])


@pytest.mark.parametrize('script', ['train_cifar', 'train_imagenet'])
@pytest.mark.parametrize('argv,message', [
    (['--gsam-alpha', '0.5'], '--gsam-alpha only act with --sam'),
    (['--rho-min', '0.01'], '--rho-min only act with --sam'),
    (['--sam', '--gsam-alpha', '-1'], '--gsam-alpha must be a finite number >= 0, got -1.0'),
    (['--sam', '--gsam-alpha', 'nan'], '--gsam-alpha must be a finite number >= 0, got nan'),
    (['--sam', '--rho-min', '0.1'], '--rho-min must be a finite number >= 0 and <= 0.05, got 0.1'),
    (['--sam', '--rho-min', '-0.01'], '--rho-min must be a finite number >= 0 and <= 0.05, got -0.01'),
])
def test_bad_gsam_flags_are_refused(script, argv, message):
    import utils
    mod = __import__(script)
    with pytest.raises(utils.UserError, match=re.escape(message)):
        mod.get_args(argv + (['--synthetic'] if script == 'train_imagenet' else []))


def test_imagenet_gsam_alpha_zero_is_sam_and_logs_the_gap(cifar10_dir, tmp_path, one_thread, capsys):
    """train_imagenet.py on 40 CIFAR images in its folder layout, m-sharpness groups inside 2 micro-batches:
    --gsam-alpha 0 --rho-min = --rho is --sam bit for bit; the train rows of both hold the surrogate gap; the header
    names GSAM's alpha, rho_min and the LR range (it said only 'SAM rho 0.5')."""
    import shutil
    import train_imagenet
    for split, src, n in (('train', 'train', 4), ('val', 'test', 1)):
        for c in sorted(os.listdir(cifar10_dir / src)):
            (tmp_path / 'data' / split / c).mkdir(parents=True)
            for f in sorted(os.listdir(cifar10_dir / src / c))[:n]:
                shutil.copy(cifar10_dir / src / c / f, tmp_path / 'data' / split / c / f.replace('.jpg', '.JPEG'))
    common = ['--data', tmp_path / 'data', '--model', 'vit_ti16', '--model-kw', 'depth=1', 'dim=32', 'heads=2',
              '--img-size', 32, '--sam', '--rho', 0.5, '--batch-size', 8, '--accum-steps', 2, '--sam-m', 2,
              '--max-steps', 2, '--log-every', 1, '--workers', 0, '--save-every', 2, '--lr', 0.01,
              '--warmup-steps', 1]
    w = []
    for extra in ([], ['--gsam-alpha', 0, '--rho-min', 0.5]):
        out = tmp_path / str(len(w))
        train_imagenet.main([str(a) for a in [*common, *extra, '--out', out]])
        w.append(torch.load(out / 'last.pt', weights_only=False)['model'])
        rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
        assert [r['surrogate_gap'] > 0 for r in rows if r['kind'] == 'train'] == [True, True]
        header = capsys.readouterr().out
        assert ('GSAM alpha 0 rho_min 0.5 at LR 0 .. rho 0.5 at LR 0.01,' in header) == bool(extra), header
    assert all(torch.equal(v, w[1][k]) for k, v in w[0].items())


# -----------------------------------------------------------------------------
# No host sync in a GSAM step; SAM.step's own unscale (scaler.step without unscale_) is multi-tensor
def test_no_host_sync_in_the_gsam_step():
    """first_step, the decomposition (two dot products, the guard on ||g_p|| = 0 by torch.where) and the step read
    nothing back to the host (no scaler; an enabled GradScaler's one read of found_inf is GradScaler's own)."""
    from test_sam import _count_host_syncs
    model = toy_mlp(0, bn=True)
    opt = GSAM(model.parameters(), torch.optim.SGD, rho=0.2, rho_min=0.1, alpha=0.4, lr_max=0.1, lr_min=0.0, lr=0.1,
               momentum=0.9)
    x, y = toy_data(0, 8)
    w0 = clone_params(model)
    for j, (xg, yg) in enumerate(zip(x.chunk(2), y.chunk(2))):
        F.cross_entropy(model(xg), yg).backward()
        with _count_host_syncs() as calls:
            opt.first_step(zero_grad=True)
            with second_pass(model, sync=False):
                (F.cross_entropy(model(xg), yg) / 2).backward()
            if j == 0:
                opt.next_group()
            else:
                opt.gsam_gradient()
                opt.second_step(zero_grad=True)
        assert calls == []
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), w0))


def test_unscale_inside_step_is_one_foreach_kernel_per_dtype_and_equals_unscale_():
    """scaler.step(opt) without scaler.unscale_(opt): SAM.step unscales with one _foreach_mul_ per (device, dtype),
    not a mul_ per parameter, and the weights equal those of the unscale_ path (GradScaler's own kernel)."""
    runs = []
    for unscale in (True, False):
        m32, m64 = toy_mlp(0), toy_mlp(1).to(F64)  # two dtypes: two buckets
        opt = SAM([*m32.parameters(), *m64.parameters()], torch.optim.SGD, rho=0.1, lr=0.1)
        scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 10)
        for step in range(2):
            x, y = toy_data(step, 8)
            for _ in range(2):  # the two passes
                scaler.scale(F.cross_entropy(m32(x), y) + F.cross_entropy(m64(x.to(F64)), y)).backward()
                if _ == 0:
                    opt.first_step(zero_grad=True)
            if unscale:
                scaler.unscale_(opt)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                scaler.step(opt)
            ops = [e.name for e in prof.events() if e.cpu_parent is None or not e.cpu_parent.name.startswith(
                'aten::_foreach')]  # (on a CPU a _foreach kernel runs its per-tensor ops inside itself)
            assert ops.count('aten::mul_') == 0 and ops.count('aten::_foreach_mul_') == 2 * (not unscale), ops
            scaler.update()
            opt.zero_grad(set_to_none=True)
        runs.append([*clone_params(m32), *clone_params(m64)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize('kw,error,message', [
    (dict(alpha=-0.1), ValueError, 'alpha must be a finite number >= 0, got -0.1'),
    (dict(alpha=math.nan), ValueError, 'alpha must be a finite number >= 0, got nan'),
    (dict(rho_min=0.2, lr_max=1.0, lr_min=0.0), ValueError, 'rho_min must be a finite number >= 0 and <= rho'),
    (dict(rho_min=0.01), ValueError, 'pass lr_max and lr_min'),
    (dict(lr_max=1.0), ValueError, 'lr_max and lr_min go together'),
    (dict(adaptive=True, adaptive_perturbation=True), ValueError, 'two perturbations'),
    (dict(alpha='0.1'), TypeError, "alpha must be a real number, got str '0.1'"),
    (dict(rho_min='0.01', lr_max=1.0, lr_min=0.0), TypeError, "rho_min must be a real number, got str '0.01'"),
    (dict(adaptive_perturbation='no'), TypeError, "adaptive_perturbation must be True or False, got str 'no'"),
    (dict(adaptive_perturbation=1), TypeError, 'adaptive_perturbation must be True or False, got int 1'),
    (dict(minimize_fp='no'), TypeError, "minimize_fp must be True or False, got str 'no'"),
    (dict(lr_max=True, lr_min=0.0), TypeError, 'lr_max must be a real number, got bool True'),
    (dict(lr_max=1.0, lr_min='0'), TypeError, "lr_min must be a real number, got str '0'"),
])
def test_bad_gsam_settings_are_refused(kw, error, message):
    """At construction and in an added group alike (rho 0.05): a negative rho_min or alpha would turn the method
    round; rho_min above rho or a schedule-following rho without the schedule's range has no meaning; an option of
    the wrong type is not taken for its truth value (GL09: adaptive_perturbation='no' was |w| perturbation on). A
    refused group leaves the optimizer as it was (GL20: it stayed in, and trained with alpha -1)."""
    m = toy_mlp(0)
    with pytest.raises(error, match=re.escape(message)):
        GSAM(m.parameters(), torch.optim.SGD, lr=0.1, **kw)
    group_kw = {k: v for k, v in kw.items() if k not in ('lr_max', 'lr_min', 'minimize_fp')}
    if group_kw and 'lr_max' not in kw:
        opt = GSAM(list(m.parameters())[:1], torch.optim.SGD, lr=0.1)
        with pytest.raises(error, match=re.escape(message)):
            opt.add_param_group({'params': list(m.parameters())[1:], **group_kw})
        assert len(opt.param_groups) == len(opt.base_optimizer.param_groups) == 1
        assert [len(g['params']) for g in opt.param_groups] == [1]
        opt.add_param_group({'params': list(m.parameters())[1:]})  # the same parameters, valid settings: they join
        assert [g['alpha'] for g in opt.param_groups] == [0.0, 0.0]


# -----------------------------------------------------------------------------
# Issue 42: the order of a user's loop (GL11), rho_t's range (GL12), an option of the wrong type
def _sam_readme_loop(model, opt, x, y, scaler, clip):
    """SAM's loop (sam.py, README) with GSAM swapped in: no gsam_gradient(); unscale_, clipping, scaler.step."""
    with first_pass(model):
        scaler.scale(F.cross_entropy(model(x), y)).backward()
    opt.first_step(zero_grad=True)
    with second_pass(model):
        scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize('scaler', ['enabled', 'disabled', 'second_step'])
def test_sams_loop_without_gsam_gradient_is_refused_with_w_restored(scaler):
    """GL11: under a GradScaler (2^16) that order stepped 1,900x too far (a scaled g against an unscaled g_p), and in
    any precision clipping acted on g_p, not on d. Now one line, w restored bit for bit, and the next (right) step
    of the same optimizer equals a fresh optimizer's."""
    x, y = toy_data(0, 32)
    model = toy_mlp(1)
    opt = GSAM(model.parameters(), torch.optim.SGD, rho=0.1, alpha=0.3, lr=0.1)
    w0 = clone_params(model)
    message = re.escape('GSAM: call optimizer.gsam_gradient() right after the last second backward pass, before '
                        'scaler.unscale_, clipping and step')
    with pytest.raises(RuntimeError, match=message):
        if scaler == 'second_step':
            F.cross_entropy(model(x), y).backward()
            opt.first_step(zero_grad=True)
            F.cross_entropy(model(x), y).backward()
            opt.second_step(zero_grad=True)
        else:
            _sam_readme_loop(model, opt, x, y, torch.amp.GradScaler('cpu', enabled=scaler == 'enabled'), 1.0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), w0))
    assert not hasattr(opt, 'found_inf') and not hasattr(opt, 'grad_scale')
    opt.zero_grad(set_to_none=True)
    fresh = toy_mlp(1)
    runs = []
    for m, o in ((model, opt), (fresh, GSAM(fresh.parameters(), torch.optim.SGD, rho=0.1, alpha=0.3, lr=0.1))):
        _gsam_step(m, o, [(x, y)])
        runs.append(clone_params(m))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_gsams_loop_under_a_gradscaler_is_fp32s_step_and_clipping_bounds_it():
    """GSAM's loop (gsam_gradient before unscale_): g and g_p carry the same loss scale, so a 2^16 scaler gives the
    no-scaler weights bit for bit (powers of two); clipping at c bounds the SGD step to lr * c (the closed form)
    and binds here (the unclipped step is longer)."""
    x, y = toy_data(0, 32)
    lr, clip, runs = 0.1, 0.3, []
    for scaler, c in ((torch.amp.GradScaler('cpu', init_scale=2.0 ** 16), clip),
                      (torch.amp.GradScaler('cpu', enabled=False), clip), (None, None)):
        model = toy_mlp(1)
        opt = GSAM(model.parameters(), torch.optim.SGD, rho=0.1, alpha=0.3, lr=lr)
        _gsam_step(model, opt, [(x, y)], scaler=scaler, clip=c)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    w0 = torch.cat([p.detach().flatten() for p in toy_mlp(1).parameters()])
    assert torch.equal(runs[0], runs[1])
    assert (runs[0] - w0).norm() <= lr * clip * (1 + 1e-5) < (runs[2] - w0).norm()


def test_rho_t_stays_in_rho_min_rho():
    """GL12: below lr_min (a warm-up from 0) or above lr_max, big_vision's line leaves [rho_min, rho] (here -0.011 at
    lr 0: w moved down the gradient); it is clamped. Oracle: the closed form, and the length of first_step's move."""
    x, y = toy_data(0, 8, F64)
    for lr, want in ((0.0, 0.0), (5e-5, 0.0), (1e-4, 0.0), (5.5e-4, 0.05), (1e-3, 0.1), (2e-3, 0.1)):
        m = toy_mlp(0).to(F64)
        o = GSAM(m.parameters(), torch.optim.SGD, rho=0.1, alpha=0.3, rho_min=0.0, lr_max=1e-3, lr_min=1e-4, lr=lr)
        assert o.radius(o.param_groups[0]) == pytest.approx(want, abs=1e-15), lr
        w0 = torch.cat([p.detach().flatten() for p in m.parameters()])
        F.cross_entropy(m(x), y).backward()
        o.first_step(zero_grad=True)
        move = torch.cat([p.detach().flatten() for p in m.parameters()]) - w0
        assert move.norm().item() == pytest.approx(want, rel=1e-9, abs=1e-15), lr


def test_gsam_gradient_all_reduce_must_be_a_bool():
    m = toy_mlp(0)
    o = GSAM(m.parameters(), torch.optim.SGD, rho=0.1, alpha=0.3, lr=0.1)
    x, y = toy_data(0, 8)
    F.cross_entropy(m(x), y).backward()
    o.first_step(zero_grad=True)
    F.cross_entropy(m(x), y).backward()
    with pytest.raises(TypeError, match="all_reduce must be True or False, got str 'no'"):
        o.gsam_gradient(all_reduce='no')  # 'no' would all-reduce


# -----------------------------------------------------------------------------
# Issue 42's tests that missed real bugs: the g_p = 0 guard; a SAM checkpoint loaded into GSAM
@pytest.mark.parametrize('vanishes,minimize_fp', [('second', True), ('second', False), ('first', True),
                                                  ('first', False)])
def test_a_vanishing_gradient_gives_the_limit_not_nan(vanishes, minimize_fp):
    """A pass whose loss does not depend on w (a ReLU net dead at w + eps) gives a zero gradient, and the projection's
    <g, g_p>/||g_p||^2 (or <g, g_p>/||g||^2) is 0/0. The limit (nothing to project onto) is 0: with g_p = 0, d =
    -alpha g (minimize_fp) or g; with g = 0 (then eps = 0, g_p = grad L(w) =: g1), d = g1 or alpha g1. Oracle: those
    closed forms from autograd's gradient in fp64, through an SGD step."""
    alpha, lr = 0.4, 0.1
    model = toy_mlp(0).to(F64)
    opt = GSAM(model.parameters(), torch.optim.SGD, rho=0.1, alpha=alpha, lr=lr, minimize_fp=minimize_fp)
    x, y = toy_data(0, 8, F64)
    w0 = clone_params(model)
    g = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    dead = lambda: 0 * model(x).sum()  # noqa: E731 (a loss with a zero gradient)
    with first_pass(model):
        (dead() if vanishes == 'first' else F.cross_entropy(model(x), y)).backward()
    opt.first_step(zero_grad=True)
    with second_pass(model, sync=False):
        (dead() if vanishes == 'second' else F.cross_entropy(model(x), y)).backward()
    opt.gsam_gradient()
    opt.second_step(zero_grad=True)
    factor = {('second', True): -alpha, ('second', False): 1.0, ('first', True): 1.0, ('first', False): alpha}
    for p, w, gi in zip(model.parameters(), w0, g):
        torch.testing.assert_close(p.detach(), w - lr * factor[vanishes, minimize_fp] * gi, rtol=0, atol=1e-15)


def test_a_sam_checkpoint_loaded_into_gsam_takes_the_constructors_gsam_settings():
    """SAM's state_dict holds rho/adaptive/eta but no alpha, rho_min, adaptive_perturbation: GSAM fills in its
    constructor's (the file's rho and lr win, as documented), and its next step is big_vision's gsam_gradient with
    those settings (the fp64 oracle above)."""
    model = toy_mlp(0).to(F64)
    ckpt = SAM(model.parameters(), torch.optim.SGD, rho=0.3, lr=0.2).state_dict()
    cfg = dict(rho_min=0.1, alpha=0.4, lr_max=0.5, lr_min=0.05)
    opt = GSAM(model.parameters(), torch.optim.SGD, rho=0.9, adaptive_perturbation=True, lr=0.9, **cfg)
    opt.load_state_dict(ckpt)
    assert {k: opt.param_groups[0][k] for k in ('rho', 'lr', 'rho_min', 'alpha', 'adaptive_perturbation')} == \
        dict(rho=0.3, lr=0.2, rho_min=0.1, alpha=0.4, adaptive_perturbation=True)
    x, y = toy_data(0, 8, F64)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    d = _gsam_gradient(_mlp_loss, params, x, y, rho_max=0.3, lr=0.2, adaptive_perturbation=True, **cfg)[1]
    _gsam_step(model, opt, [(x, y)])
    for (n, w), p in zip(params.items(), model.parameters()):
        torch.testing.assert_close(p.detach(), w - 0.2 * d[n], rtol=0, atol=1e-12)
