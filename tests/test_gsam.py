"""GSAM (sam.GSAM) against an fp64 transcription of big_vision's gsam_gradient (the official JAX code,
big_vision/trainers/proj/gsam/gsam.py, written out here from that file with torch.func in place of jax), against
plain SAM (alpha = 0, rho_min = rho: bit for bit), the base optimizer (rho = 0: bit for bit), a single process with k
groups (k gloo ranks), GradScaler overflows, a resume, and through train_cifar.py's flags."""
import contextlib
import copy
import io
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from sam import GSAM, SAM, first_pass, second_pass

F64 = torch.float64


def _mlp(seed, bn=False):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16) if bn else nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def _data(seed, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _gsam_step(model, opt, groups, micro=1, scaler=None, clip=None, all_reduce=False, plant=None):
    """One GSAM step as the sam.GSAM docstring's loop: k = len(groups) groups of `micro` micro-batches; every
    backward under DDP's no_sync; plant=(pass, j): an inf in group j's first or second gradient."""
    k = len(groups)
    scaler = scaler or torch.amp.GradScaler('cpu', enabled=False)
    for j, (x, y) in enumerate(groups):
        parts = list(zip(x.chunk(micro), y.chunk(micro)))
        with first_pass(model):
            for xb, yb in parts:
                scaler.scale(F.cross_entropy(model(xb), yb) / micro).backward()
        if plant == ('first', j):
            next(model.parameters()).grad.view(-1)[0] = float('inf')
        opt.first_step(zero_grad=True)
        with second_pass(model, sync=False):
            for xb, yb in parts:
                scaler.scale(F.cross_entropy(model(xb), yb) / (k * micro)).backward()
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
    value_and_grad = torch.func.grad_and_value(loss_fn)
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


CFG = dict(rho_max=0.3, rho_min=0.1, alpha=0.4, lr_max=0.5, lr_min=0.05)
LRS = [0.5, 0.35, 0.2, 0.05]  # the lr of each step, along a decay from lr_max to lr_min


def _oracle_run(k, adaptive_perturbation, minimize_fp, clip=None):
    """fp64: per step the mean over the k groups of gsam_gradient (big_vision: per device, then pmean), clipped
    (after the pmean, as optax's clip_by_global_norm; with torch's 1e-6), then plain SGD w - lr d."""
    model = _mlp(0).to(F64)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_fn(ps, x, y):
        return F.cross_entropy(torch.func.functional_call(model, ps, (x,)), y)
    for step, lr in enumerate(LRS):
        x, y = _data(step, 4 * k, F64)
        ds = [_gsam_gradient(loss_fn, params, xg, yg, lr=lr, adaptive_perturbation=adaptive_perturbation,
                             minimize_fp=minimize_fp, **CFG)[1] for xg, yg in zip(x.split(4), y.split(4))]
        d = {n: sum(dj[n] for dj in ds) / k for n in params}
        if clip is not None:
            norm = torch.sqrt(sum(torch.sum(v ** 2) for v in d.values()))
            d = {n: v * torch.clamp(clip / (norm + 1e-6), max=1.0) for n, v in d.items()}  # (torch's 1e-6)
        params = {n: p - lr * d[n] for n, p in params.items()}
    return list(params.values())


def _gsam_run(k, adaptive_perturbation, minimize_fp, clip=None, micro=1):
    model = _mlp(0).to(F64)
    kw = {key: CFG[key] for key in ('rho_min', 'alpha', 'lr_max', 'lr_min')}
    opt = GSAM(model.parameters(), torch.optim.SGD, rho=CFG['rho_max'], lr=LRS[0], minimize_fp=minimize_fp,
               adaptive_perturbation=adaptive_perturbation, **kw)
    for step, lr in enumerate(LRS):
        for group in opt.param_groups:
            group['lr'] = lr
        x, y = _data(step, 4 * k, F64)
        _gsam_step(model, opt, list(zip(x.split(4), y.split(4))), micro=micro, clip=clip)
    return _params(model)


@pytest.mark.parametrize('k,micro,clip', [(1, 1, None), (3, 2, 0.05)], ids=['one-group', '3-groups-micro-clip'])
@pytest.mark.parametrize('adaptive_perturbation', [False, True], ids=['sam-eps', 'abs-w-eps'])
@pytest.mark.parametrize('minimize_fp', [True, False], ids=['min-fp', 'min-f'])
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
