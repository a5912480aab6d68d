"""Momentum-SAM (msam.py) against fp64 transcriptions of Becker et al. 2024's Algorithm 1 written here (with torch's
SGD-momentum and AdamW updates written out), against the base optimizer (rho = 0: bit for bit), the passes counted,
GradScaler overflows and loss scales, a resume, bad settings, and through train_cifar.py's and train_imagenet.py's
flags. (MSAM under DDP, 2 gloo ranks against one process, runs in test_looksam.py's spawn: one torch start-up.)"""
import io
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from msam import MSAM
from toys import all_equal, clone_params, flat_grad, toy_data, toy_mlp

F64 = torch.float64

pytestmark = pytest.mark.usefixtures('one_thread')  # tiny ops: a second thread only contends


def _msam_step(model, opt, micro, scaler=None, clip=None, plant=False):
    """msam.py's docstring loop over micro-batches [(x, y), ...]; plant: an inf in the gradient."""
    scaler = scaler or torch.amp.GradScaler('cpu', enabled=False)
    opt.perturb()
    for x, y in micro:
        scaler.scale(F.cross_entropy(model(x), y) / len(micro)).backward()
    if plant:
        next(model.parameters()).grad.view(-1)[0] = float('inf')
    scaler.unscale_(opt)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


# -----------------------------------------------------------------------------
# The oracle: Algorithm 1 as the paper writes it (the shift carried over and undone arithmetically), flat fp64
def _oracle(base, rho, steps, lr, mu=0.9, betas=(0.9, 0.999), eps=1e-8, wd=0.0):
    model = toy_mlp(0, dtype=F64)
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    m = torch.zeros_like(w)  # v_0 = 0 (SGD); Adam's first moment m_0 = 0
    s = torch.zeros_like(w)  # Adam's second moment
    w_tilde = w.clone()      # w_tilde_0 = w_0 - rho 0/||0||: no shift
    for t in range(steps):
        x, y = toy_data(200 + t, 8, F64)
        g = flat_grad(model, w_tilde, x, y)                    # perturbed forward + backward pass
        w = w_tilde + (rho * m / m.norm() if m.norm() > 0 else 0)  # remove last perturbation
        if base == 'sgd':
            m = mu * m + g                                      # update momentum vector (torch: buf = g first)
            w = w - lr * m                                      # SGD step
        else:  # AdamW, torch's: decay first, then the bias-corrected Adam step
            m, s = betas[0] * m + (1 - betas[0]) * g, betas[1] * s + (1 - betas[1]) * g * g
            w = w * (1 - lr * wd)
            w = w - lr / (1 - betas[0] ** (t + 1)) * m / ((s / (1 - betas[1] ** (t + 1))).sqrt() + eps)
        w_tilde = w - rho * m / m.norm()                        # perturb for next iteration
    return w


@pytest.mark.parametrize('base,kw', [('sgd', dict(lr=0.1, momentum=0.9)),
                                     ('adamw', dict(lr=1e-2, weight_decay=0.1))])
def test_matches_algorithm_1_in_fp64(base, kw):
    """12 steps, rho 0.5: the optimizer equals the transcription (1e-12) and an off-by-one rho tells (1e-6)."""
    model = toy_mlp(0, dtype=F64)
    opt = MSAM(model.parameters(), torch.optim.SGD if base == 'sgd' else torch.optim.AdamW, rho=0.5, **kw)
    for t in range(12):
        _msam_step(model, opt, [toy_data(200 + t, 8, F64)])
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    oracle_kw = dict(lr=kw['lr'], wd=kw.get('weight_decay', 0.0))
    torch.testing.assert_close(got, _oracle(base, 0.5, 12, **oracle_kw), rtol=0, atol=1e-12)
    assert not torch.allclose(got, _oracle(base, 0.45, 12, **oracle_kw), rtol=0, atol=1e-6)
    assert not torch.allclose(got, _oracle(base, -0.5, 12, **oracle_kw), rtol=0, atol=1e-6)  # (the sign tells)


@pytest.mark.parametrize('base,kw', [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
                                     (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05))], ids=['sgd', 'adamw'])
def test_rho_zero_is_the_base_optimizer_bit_for_bit(base, kw):
    """rho = 0 (what the scripts set during the warm-up): the base optimizer's run, BatchNorm buffers included."""
    runs = []
    for msam in (False, True):
        model = toy_mlp(0, bn=True)
        opt = MSAM(model.parameters(), base, rho=0.0, **kw) if msam else base(model.parameters(), **kw)
        for t in range(5):
            x, y = toy_data(t, 8)
            if msam:
                _msam_step(model, opt, [(x[:4], y[:4]), (x[4:], y[4:])])
            else:
                for xb, yb in ((x[:4], y[:4]), (x[4:], y[4:])):
                    (F.cross_entropy(model(xb), yb) / 2).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        runs.append(clone_params(model) + [b.clone() for b in model.buffers()])
    assert all_equal(*runs)


def test_one_forward_pass_per_step_and_the_model_holds_w_between_steps():
    """T steps make T passes (closure form too); after a step the model holds w (no shift left in it): w_tilde is
    made from it exactly by the next perturb() and undone exactly by step()."""
    model = toy_mlp(0)
    passes = []
    model.register_forward_pre_hook(lambda *_: passes.append(1))
    opt = MSAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1, momentum=0.9)
    for t in range(6):
        x, y = toy_data(t, 8)
        if t % 2:
            _msam_step(model, opt, [(x, y)])
        else:
            opt.step(lambda: (opt.zero_grad(), F.cross_entropy(model(x), y).backward()))
    assert len(passes) == 6
    w = clone_params(model)
    opt.perturb()
    m = [opt.state[p]['momentum_buffer'] for p in model.parameters()]
    norm = math.sqrt(sum(x.square().sum().item() for x in m))
    for p, w0, mi in zip(model.parameters(), w, m):
        torch.testing.assert_close(p.detach(), w0 - 0.5 * mi / norm)
    with torch.no_grad():
        opt.restore()
    assert all_equal(clone_params(model), w)


# -----------------------------------------------------------------------------
# GradScaler, resume, host syncs, misuse, bad settings
def test_overflow_skips_with_w_and_momentum_exact():
    model = toy_mlp(0)
    opt = MSAM(model.parameters(), torch.optim.AdamW, rho=0.5, lr=1e-2)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
    for t in range(3):
        _msam_step(model, opt, [toy_data(t, 8)], scaler)
    w0, m0 = clone_params(model), [opt.state[p]['exp_avg'].clone() for p in model.parameters()]
    _msam_step(model, opt, [toy_data(3, 8)], scaler, plant=True)
    assert all_equal(clone_params(model), w0) and all_equal([opt.state[p]['exp_avg'] for p in model.parameters()], m0)
    assert scaler.get_scale() == 2.0 ** 7
    _msam_step(model, opt, [toy_data(4, 8)], scaler)
    assert not all_equal(clone_params(model), w0)


def test_loss_scale_cancels_and_resume_mid_run_is_bit_identical():
    """A power-of-two loss scale: the weights of the unscaled run, bit for bit (m is unscaled). 6 steps == 3 steps,
    state_dict + model through torch.save, a new optimizer, 3 steps (the shift comes back from m)."""
    def run(scale=None, cut=None):
        model = toy_mlp(0, bn=True)
        opt = MSAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler('cpu', init_scale=scale) if scale else None
        for t in range(6):
            if t == cut:
                buf = io.BytesIO()
                torch.save({'model': model.state_dict(), 'opt': opt.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=True)
                model = toy_mlp(1, bn=True)
                model.load_state_dict(saved['model'])
                opt = MSAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1, momentum=0.9)
                opt.load_state_dict(saved['opt'])
            _msam_step(model, opt, [toy_data(t, 8)], scaler)
        return clone_params(model)
    whole = run()
    assert all_equal(whole, run(scale=2.0 ** 10)) and all_equal(whole, run(cut=3))


def test_no_host_sync_in_the_step():
    from test_sam import _count_host_syncs
    model = toy_mlp(0, bn=True)
    opt = MSAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1, momentum=0.9)
    for t in range(3):
        with _count_host_syncs() as calls:
            _msam_step(model, opt, [toy_data(t, 8)])
        assert calls == [], t


def test_misuse_fails_loudly():
    model = toy_mlp(0)
    opt = MSAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1, momentum=0.9)
    F.cross_entropy(model(toy_data(0, 8)[0]), toy_data(0, 8)[1]).backward()
    with pytest.raises(RuntimeError, match='began with perturb'):
        opt.step()
    with pytest.raises(RuntimeError, match='no gradient ascent'):
        opt.first_step()
    opt.perturb()
    with pytest.raises(RuntimeError, match='called twice'):
        opt.perturb()


@pytest.mark.parametrize('base,kw,error,message', [
    (torch.optim.SGD, dict(lr=0.1), ValueError, 'MSAM needs momentum: SGD with momentum (or beta1) > 0, got 0'),
    (torch.optim.Adam, dict(betas=(0.0, 0.9)), ValueError, 'got 0.0'),
    (torch.optim.RMSprop, dict(momentum=0.9), TypeError, 'torch.optim.SGD (momentum > 0), Adam or AdamW, not RMSprop'),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, rho=-1.0), ValueError, 'rho must be a finite number >= 0, got -1.0'),
])
def test_bad_settings_are_refused(base, kw, error, message):
    with pytest.raises(error, match=re.escape(message)):
        MSAM(toy_mlp(0).parameters(), base, **kw)


# -----------------------------------------------------------------------------
# The scripts: --msam (the flag checks are test_looksam.py's, with LookSAM's)
def test_cifar_msam_rho_zero_is_adamw_its_default_rho_and_a_resume(cifar10_dir, tmp_path, monkeypatch):
    """train_cifar.py: --msam --rho 0 is AdamW bit for bit; --msam alone runs at rho 3 (stored) and trains otherwise;
    stopped by Ctrl-C in epoch 2 and resumed, it ends where the whole run ends."""
    import train_cifar
    from test_looksam import _cifar, _ctrl_c_at, _same_state
    base, _ = _cifar(cifar10_dir, tmp_path / 'base')
    rho0, _ = _cifar(cifar10_dir, tmp_path / 'rho0', '--msam', '--rho', 0)
    msam, rows = _cifar(cifar10_dir, tmp_path / 'msam', '--msam')
    assert _same_state(base, rho0) and not _same_state(base, msam)
    assert json.loads((tmp_path / 'msam' / 'args.json').read_text())['rho'] == 3.0
    assert all('surrogate_gap' not in r for r in rows)  # (one pass: no clean loss beside the perturbed one)
    real = _ctrl_c_at(monkeypatch, train_cifar, 3)
    with pytest.raises(SystemExit):
        _cifar(cifar10_dir, tmp_path / 'cut', '--msam')
    monkeypatch.setattr(train_cifar, 'train_step', real)
    train_cifar.main(['--resume', str(tmp_path / 'cut' / 'last.pt')])
    assert _same_state(msam, torch.load(tmp_path / 'cut' / 'last.pt', weights_only=True)['model'])


def test_imagenet_msam_rho_is_zero_through_the_warm_up(imagenet_dir, tmp_path):
    """train_imagenet.py: 4 steps all inside --warmup-steps 4 are AdamW's bit for bit (rho 0 there, the official
    ViT/AdamW rule); with --warmup-steps 1 MSAM moves from step 1 on and trains otherwise."""
    from test_looksam import _imagenet, _same_state
    w = {(msam, warm): _imagenet(imagenet_dir, tmp_path / f'{msam}{warm}', *['--msam'] * msam, '--warmup-steps', warm)
         for msam in (0, 1) for warm in (1, 4)}
    assert _same_state(w[0, 4], w[1, 4]) and not _same_state(w[0, 1], w[1, 1])
