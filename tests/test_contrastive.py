"""train_contrastive.py (MoCo v3, with and without SAM): the loss against a direct computation, the
momentum update in closed form, a 2-process run against one process over the same global batch,
learning against the random initialisation, the views against torchvision's ops, bad input.

Subprocess runs use OMP_NUM_THREADS=1 (see tests/test_train_cifar.py for why); the slow runs go
in parallel, one core each.
"""
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from torchvision.transforms import v2

import augment
import data
import models
import train_contrastive as tc
import utils
from conftest import REPO
from toys import free_port

SCRIPT = str(REPO / 'train_contrastive.py')
# A 2-block ViT of width 64 on 8x8-px patches (16 tokens), small MLP heads: ~0.2M parameters.
TINY = ['--model', 'vit_ti16', '--model-kw', 'dim=64', 'depth=2', 'heads=2', 'patch_size=8',
        '--proj-hidden', '256', '--proj-dim', '64', '--log-every', '0']
PROBE = ['--linear-epochs', '30']  # (with --eval linear only: refused with --eval knn alone, T03)


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def env(**extra):
    return {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', **extra}


def start(*args, nproc=1, extra_env=None, script=SCRIPT):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node',
                                                    str(nproc), '--master_port', str(free_port())]
    return subprocess.Popen(launcher + [script, *map(str, args)], cwd=REPO, env=env(**(extra_env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, ok=True):
    out, err = proc.communicate(timeout=600)
    if ok:
        assert proc.returncode == 0, f'exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}'
    return out, err


def rows(out_dir, kind):
    return [r for r in map(json.loads, (out_dir / 'metrics.jsonl').read_text().splitlines()) if r['kind'] == kind]


# -----------------------------------------------------------------------------
# 1. The loss: InfoNCE with MoCo v3's 2*tau factor, against -log softmax written out in float64.
def direct_infonce(q, k, tau):
    q, k = q.double(), k.double()
    q, k = q / q.norm(dim=1, keepdim=True), k / k.norm(dim=1, keepdim=True)
    terms = []
    for i in range(len(q)):
        logits = [float(q[i] @ k[j]) / tau for j in range(len(k))]
        terms.append(-(logits[i] - math.log(sum(math.exp(v) for v in logits))))  # -log softmax(q.k+/tau)
    return sum(terms) / len(terms)


def test_infonce_equals_direct_computation():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    for tau in (0.2, 1.0):
        # builder.py multiplies the cross-entropy by 2*tau (documented in contrastive_loss)
        assert tc.contrastive_loss(q, k, tau).item() == pytest.approx(2 * tau * direct_infonce(q, k, tau), rel=1e-5)
    # the symmetrised MoCo loss is ctr(q1, k2) + ctr(q2, k1) of the predictor outputs
    torch.manual_seed(0)
    args = tc.get_args(TINY[:7])
    moco = tc.MoCo(tc.build_backbone(args), 8, 32, 0.2)
    x1, x2 = torch.randn(4, 3, 32, 32, generator=g), torch.randn(4, 3, 32, 32, generator=g)
    k1, k2 = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    with torch.no_grad():
        q1, q2 = moco.predictor(moco.base_encoder(x1)), moco.predictor(moco.base_encoder(x2))
        expect = 0.4 * (direct_infonce(q1, k2, 0.2) + direct_infonce(q2, k1, 0.2))
        assert moco(x1, x2, k1, k2).item() == pytest.approx(expect, rel=1e-5)


def test_identical_views_small_tau_give_zero_loss():
    q = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ce = lambda k, tau: tc.contrastive_loss(q, k, tau).item() / (2 * tau)  # the cross-entropy itself
    assert ce(q, 0.01) < 1e-4  # each query's positive is itself: -log softmax -> 0
    assert ce(q, 1.0) > 0.5  # ... because of the small tau, not always
    assert ce(q.roll(1, 0), 0.01) > 10  # and only for the right positives


# -----------------------------------------------------------------------------
# 2. The momentum encoder after one step: theta_k = m theta_k0 + (1 - m) theta_q1 exactly (theta_k0 =
# theta_q0, the initial weights), with m = MoCo v3's cosine schedule at the end of epoch 1 of 2.
# With --sam, theta_q1 is the weight after the SAM step (restored, then stepped): updating from the
# perturbed weights, or once per pass, fails the equality.
def test_momentum_update_is_exact_and_resume_bit_identical(cifar10_dir, tmp_path):
    m0 = 0.5
    common = ['--data', cifar10_dir, '--train-subset', 32, '--test-subset', 20, '--batch-size', 32, '--epochs', 2,
              '--warmup-epochs', 0, '--lr', 1e-2, '--moco-m', m0, '--stop-after-epoch', 1, *TINY, *PROBE,
              '--pos-embed', 'learned', '--no-freeze-patch-embed']  # every parameter trained
    procs = {name: start(*common, *extra, '--out', tmp_path / name) for name, extra in
             (('plain', []), ('sam', ['--sam', '--rho', 0.5]), ('full', ['--stop-after-epoch', 0]))}
    m = 1 - 0.5 * (1 + math.cos(math.pi * 1 / 2)) * (1 - m0)  # adjust_moco_momentum(epoch=1, epochs=2)
    args = tc.get_args([str(a) for a in common])
    torch.manual_seed(args.seed)
    theta_0 = tc.MoCo(tc.build_backbone(args), 64, 256, 0.2).base_encoder.state_dict()
    for name in ('plain', 'sam'):
        finish(procs[name])
        sd = torch.load(tmp_path / name / 'last.pt', weights_only=True)['moco']
        moved = 0
        for key, w0 in theta_0.items():
            if w0.is_floating_point() and 'running' not in key:
                q1, k1 = sd['base_encoder.' + key], sd['momentum_encoder.' + key]
                want = w0.double() * m + q1.double() * (1 - m)  # (the update is a lerp: fp32 rounds it, a few ulp)
                assert torch.allclose(k1.double(), want, rtol=0, atol=4e-7 * want.abs().max()), (name, key)
                moved += not torch.equal(q1, w0)
        assert moved > 10, name  # the step did change theta_q
    # --resume at the epoch boundary (flags from the run) equals the uninterrupted run bit for bit: every
    # draw of an epoch comes from (seed, epoch); the optimizer state and history come back whole
    finish(start('--resume', tmp_path / 'plain' / 'last.pt'))
    finish(procs['full'])
    resumed, full = (torch.load(tmp_path / name / 'last.pt', weights_only=True) for name in ('plain', 'full'))
    assert resumed['epoch'] == full['epoch'] == 2 and resumed['moco'].keys() == full['moco'].keys()
    for key, value in full['moco'].items():
        assert torch.equal(resumed['moco'][key], value), key
    timeless = lambda rows: [{k: v for k, v in r.items() if k not in ('elapsed_s', 'img_per_s')} for r in rows]
    assert timeless(resumed['history']) == timeless(full['history'])
    assert len(full['history']) == 4  # 2 train rows, 2 eval rows


# -----------------------------------------------------------------------------
# 3. DDP: two gloo processes of 32 images each give the losses of one process over the 64 (keys
# gathered across ranks, BN over the global batch, gradients averaged), and the evaluation of the
# single run's checkpoint on 2 processes counts exactly what it counted (101 test images: uneven
# shards of 50 and 51).
def test_ddp_equals_single_process(cifar10_dir, tmp_path):
    common = ['--data', cifar10_dir, '--train-subset', 192, '--test-subset', 101, '--batch-size', 64,
              '--epochs', 1, '--warmup-epochs', 0, '--lr', 1e-3, *TINY, *PROBE, '--log-every', 1,
              '--eval-batch-size', 32]
    one = start(*common, '--out', tmp_path / 'one')
    two = start(tmp_path / 'casts', SCRIPT, *common, '--out', tmp_path / 'two', nproc=2,
                script=str(REPO / 'tests' / 'ddp_broadcasts.py'))  # (the profiler counts the broadcasts)
    finish(one)
    out, _ = finish(two)
    for rank in (0, 1):  # no buffer broadcast inside a step (DDP's default: in each of the 3 forwards)
        casts = json.loads((tmp_path / f'casts.{rank}.json').read_text())
        assert casts['forwards'] == 3 and casts['in_forward'] <= 2, casts  # (tests/ddp_broadcasts.py)
    a, b = rows(tmp_path / 'one', 'train'), rows(tmp_path / 'two', 'train')
    assert len(a) == len(b) == 3 and a[0]['loss'] > 1
    # the first step: same views and weights, so only the order of fp32 sums differs (gathered keys, the
    # all-reduced loss): ~1e-7 relative, CPU-dependent; other views or weights would move it by > 1e-3
    assert b[0]['loss'] == pytest.approx(a[0]['loss'], rel=1e-5)
    # later steps: AdamW's first updates are ~lr * sign(g), so a weight whose gradient is rounding noise moves by
    # +-lr in either run (measured 2026-12-07, step 3: 1.5e-7 on torch 2.14.1, 1.3e-4 on 2.11.0, same CPU)
    for x, y in zip(a, b):
        assert y['loss'] == pytest.approx(x['loss'], rel=1e-3)
    assert 'x 3 steps of 64 (2 x 32)' in out  # two ranks of 32 really ran

    single = {r['protocol']: r for r in rows(tmp_path / 'one', 'eval')}
    out, _ = finish(start(*common, '--eval-only', '--checkpoint', tmp_path / 'one' / 'last.pt', nproc=2))
    for protocol in ('knn', 'linear'):
        r = single[protocol]
        assert r['n'] == 101
        assert f"{protocol} acc {r['top1']:.2f}% ({r['correct']}/101)" in out, (protocol, r, out)


# -----------------------------------------------------------------------------
# 4. Learning: a tiny ViT pre-trained for 186 steps (6 epochs at batch 64) on 2,000 CIFAR-10 images, with
# and without SAM, beats the same network at its random initialisation (same seed, same images) on 5,000
# test images by k-NN and linear probe (std of one accuracy ~0.65 points; without SAM this config gained
# 3.8 and 5.6 points over 26.4% and 29.8% when measured). At this scale the patch projection is trained:
# frozen (MoCo v3's trick for stability at scale) it learns more slowly. Its backbone loads into
# train_cifar.py's model for fine-tuning.
def test_learns_and_exports(cifar10_dir, tmp_path):
    common = ['--data', cifar10_dir, '--train-subset', 2000, '--test-subset', 5000, *TINY, *PROBE, '--batch-size', 64,
              '--epochs', 6, '--warmup-epochs', 1, '--lr', 3e-3, '--moco-m', 0.9, '--crop-min', 0.25,
              '--no-freeze-patch-embed', '--eval-every', 0]
    procs = {'plain': start(*common, '--out', tmp_path / 'plain'),
             'sam': start(*common, '--sam', '--out', tmp_path / 'sam')}
    init, _ = finish(start(*common, '--eval-only'))
    before = {p: float(init.split(f'{p} acc ')[1].split('%')[0]) for p in ('knn', 'linear')}
    for name, proc in procs.items():
        finish(proc)
        after = {r['protocol']: r['top1'] for r in rows(tmp_path / name, 'eval')}
        for p in ('knn', 'linear'):
            assert after[p] > before[p] + 1.5, (name, p, before, after)
    # SAM runs log the surrogate gap f_p - f (issue 35): the loss at w + eps-hat sits above the clean loss
    gaps = [r['surrogate_gap'] for r in rows(tmp_path / 'sam', 'train')]
    assert gaps and all(g > 0 for g in gaps) and 'surrogate_gap' not in rows(tmp_path / 'plain', 'train')[0]
    # last.pt's 'model': the backbone under timm's keys with vit.py's zero head: strict loads, and
    # train_cifar's fine-tuning loader (a head of other classes replaced)
    path = tmp_path / 'plain' / 'last.pt'
    ckpt = torch.load(path, weights_only=True)
    kw = models.parse_model_kw(ckpt['args']['model_kw'])
    model = models.build_model('vit_ti16', 10, 32, kw, cifar=True)
    model.load_state_dict(ckpt['model'])
    for key, value in model.state_dict().items():
        assert torch.equal(value, ckpt['moco']['base_encoder.0.' + key] if not key.startswith('head.')
                           else torch.zeros_like(value)), key
    model100 = models.build_model('vit_ti16', 100, 32, kw, cifar=True)
    models.load_weights(model100, path, finetune=True)
    assert torch.equal(model100.blocks[1].mlp.fc2.weight, model.blocks[1].mlp.fc2.weight)


# -----------------------------------------------------------------------------
# 5. The views: each batched op equals torchvision's on real images (uint8 tensor ops; the crop
# against its float path, rounded), and the view pipeline applies each op with its probability.
@pytest.fixture(scope='module')
def images(cifar10_dir):
    return data.load_cifar(cifar10_dir, 'cifar10', False, 200)[0]  # (200, 3, 32, 32) uint8


def per_image(fn, images, values):
    return torch.stack([fn(img, v) for img, v in zip(images, values)]).float()


def test_hue_and_color_jitter_match_torchvision(images):
    """Hue per image over its whole range; ColorJitter's four ops in a per-image order (brightness,
    contrast, saturation: tested in test_augment.py; the order and hue here)."""
    B, g = len(images), torch.Generator().manual_seed(0)
    hue = torch.rand(B, generator=g) - 0.5  # [-0.5, 0.5)
    assert torch.equal(augment.adjust_hue(images.float(), hue.view(B, 1, 1)),
                       per_image(TF.adjust_hue, images, hue.tolist()))
    factors = torch.stack([0.6 + 0.8 * torch.rand(B, generator=g, dtype=torch.float64) for _ in range(3)]
                          + [0.2 * torch.rand(B, generator=g, dtype=torch.float64) - 0.1], 1)
    order = torch.rand(B, 4, generator=g).argsort(1)
    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    ref = []
    for img, f, o in zip(images, factors.tolist(), order.tolist()):
        for k in o:
            img = ops[k](img, f[k])
        ref.append(img)
    assert torch.equal(augment.color_jitter(images.float(), factors, order), torch.stack(ref).float())


def test_gaussian_blur_matches_torchvision(images):
    sigma = 0.1 + 1.9 * torch.rand(len(images), generator=torch.Generator().manual_seed(1))
    for k in (5, 23):  # 32 px and 224 px views
        theirs = per_image(lambda img, s: TF.gaussian_blur(img, [k, k], [s, s]), images, sigma.tolist())
        assert torch.equal(augment.gaussian_blur(images.float(), sigma, k), theirs), k


def test_resized_crop_flip_matches_torchvision(images):
    B, g = len(images), torch.Generator().manual_seed(2)
    h, w = (torch.randint(3, 33, (B,), generator=g).double() for _ in range(2))  # any aspect ratio
    top = (torch.rand(B, generator=g, dtype=torch.float64) * (33 - h)).floor()
    left = (torch.rand(B, generator=g, dtype=torch.float64) * (33 - w)).floor()
    flip = torch.rand(B, generator=g) < 0.5
    ours = augment.resized_crop_rect_flip(images.float(), top, left, h, w, 32, flip)
    ref = [TF.resized_crop(img, *map(int, (t, l, a, c)), [32, 32], antialias=True)
           for img, t, l, a, c in zip(images.float(), top, left, h, w)]
    ref = torch.stack([TF.horizontal_flip(r) if f else r for r, f in zip(ref, flip)]).round()
    assert torch.equal(ours, ref)  # (torchvision's uint8 kernel rounds in fixed point: +-1 on ~15% of pixels)


def test_view_applies_ops_with_their_probabilities(images, monkeypatch):
    """With every other op off and whole-image crops, view 0 never solarizes (p 0) and view 1 does
    on ~20% of the images (p 0.2); the flip on ~50%."""
    for key, value in (('p_jitter', 0.0), ('p_gray', 0.0), ('p_blur', (0.0, 0.0)), ('ratio', (1.0, 1.0))):
        monkeypatch.setitem(augment.MOCO_AUG, key, value)
    x = images.repeat(10, 1, 1, 1).float()  # 2,000 images
    mean, std = torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)
    g = torch.Generator().manual_seed(3)
    for view, p in ((0, 0.0), (1, 0.2)):
        v = (255 * augment.moco_view(x, g, len(x), 0, len(x), view, 32, 1.0, mean, std)).round()  # crop_min 1: whole
        sol = torch.where(x >= 128, 255 - x, x)  # PIL's solarize
        match = lambda ref: (v == ref).flatten(1).all(1)
        kept, solarized = match(x) | match(x.flip(3)), match(sol) | match(sol.flip(3))
        mirrored = match(x.flip(3)) | match(sol.flip(3))
        assert (kept | solarized).all()  # nothing else happened
        assert abs((solarized & ~kept).float().mean().item() - p) < 0.03, view
        assert abs(mirrored.float().mean().item() - 0.5) < 0.04, view


# -----------------------------------------------------------------------------
# 6. Bad input: one clear line, a non-zero exit, no traceback; an existing run is never overwritten.
@pytest.mark.parametrize('case', ['no-data', 'unknown-model', 'bad-model-kw', 'missing-resume', 'resume-not-ours',
                                  'checkpoint-without-eval-only', 'corrupt-resume', 'batch-not-divisible',
                                  'out-holds-run', 'out-is-file', 'warmup', 'batch-1', 'lr-nan', 'wd-nan',
                                  'clip-grad-nan', 'rho-inf', 'rho-without-sam', 'resume-cifar-run',
                                  'C16-seed-over-64-bits', 'O03-eval-a-cifar-run', 'O04-eval-an-imagenet-run',
                                  'img-size-0', 'resume-damaged-args', 'T03-linear-flags-with-knn',
                                  'T04-knn-flags-with-linear', 'T05-knn-t-below-float32', 'tau-below-float32',
                                  'subset-of-imagenet', 'stop-after-past-epochs', 'U05-resume-proj-dim',
                                  'U03-resume-no-freeze', 'U04-resume-pos-embed', 'resume-model-kw'])
def test_bad_input_in_process(case, tmp_path, monkeypatch):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'metrics.jsonl').write_text('{}\n')
    (tmp_path / 'file').write_text('x')
    (tmp_path / 'bad.pt').write_bytes(b'not a checkpoint' * 10)
    torch.save({'model': {}, 'args': {}}, tmp_path / 'sd.pt')  # e.g. train_cifar's, no 'moco'
    args, expect = {
        'no-data': ([], str(tmp_path / 'empty')),
        'unknown-model': (['--model', 'vit_huge'], "unknown ViT config 'vit_huge'"),
        'bad-model-kw': (['--model-kw', 'heads=5'], 'heads=5 does not divide dim=192'),
        'missing-resume': (['--resume', tmp_path / 'nope.pt'], 'nope.pt: no such file'),
        'resume-not-ours': (['--resume', tmp_path / 'sd.pt'], 'is not a train_contrastive.py checkpoint'),
        'checkpoint-without-eval-only': (['--checkpoint', tmp_path / 'sd.pt'], '--checkpoint is for --eval-only'),
        'corrupt-resume': (['--resume', tmp_path / 'bad.pt'], 'is not a readable checkpoint'),
        'batch-not-divisible': (['--batch-size', 100], '--batch-size 100 (global) does not divide by the world size 3'),
        'out-holds-run': (['--out', tmp_path / 'run'], 'already holds a run (metrics.jsonl); use --resume'),
        'out-is-file': (['--out', tmp_path / 'file'], 'is a file'),
        'warmup': (['--epochs', 5], '--warmup-epochs 40 exceeds --epochs 5'),
        # issue 25: tracebacks (BatchNorm of one image; args.json after a whole run) and a misleading message
        'batch-1': (['--batch-size', 1], '--batch-size 1 (global) needs 2 or more images a process'),
        'lr-nan': (['--lr', 'nan'], '--lr must be a finite number >= 0, got nan'),
        'wd-nan': (['--wd', 'nan'], '--wd must be a finite number >= 0, got nan'),
        'clip-grad-nan': (['--clip-grad', 'nan'], '--clip-grad must be a finite number >= 0, got nan'),
        'rho-inf': (['--sam', '--rho', 'inf'], '--rho must be a finite number >= 0, got inf'),
        'rho-without-sam': (['--rho', 0.1], '--rho only acts with --sam: add it, or leave it out'),
        'resume-cifar-run': (['--resume', tmp_path / 'cifar_last.pt'],
                             'cifar_last.pt is a last.pt of train_cifar.py: continue it with train_cifar.py --resume'),
        # issue 34
        'C16-seed-over-64-bits': (['--seed', 99999999999999999999999],
                                  '--seed must be a finite number >= 0 and <= 9223372036854775807'),
        'O03-eval-a-cifar-run': (['--eval-only', '--checkpoint', tmp_path / 'cifar_last.pt'],
                                 'cifar_last.pt is a last.pt of train_cifar.py: evaluate it with train_cifar.py '
                                 '--eval-only'),
        'O04-eval-an-imagenet-run': (['--eval-only', '--checkpoint', tmp_path / 'imagenet_last.pt'],
                                     'is a last.pt of train_imagenet.py: evaluate it with train_imagenet.py --eval-only'),
        'img-size-0': (['--img-size', 0], '--img-size must be a finite number > 0 and <= 1024, got 0'),  # was 32
        'resume-damaged-args': (['--resume', tmp_path / 'damaged.pt'],
                                f"--lr must be a number, got 'fast' (from the args stored in {tmp_path / 'damaged.pt'}"),
        # issue 42 (bad-inputs-3): flags acting on nothing, an edge float32 cannot compute, an architecture changed
        'T03-linear-flags-with-knn': (['--eval', 'knn', '--linear-wd', 0.5],  # (--linear-epochs: PROBE's)
                                      '--linear-epochs, --linear-wd only act with --eval linear: add it, or leave'),
        'T04-knn-flags-with-linear': (['--eval', 'linear', '--knn-k', 5, '--knn-t', 0.5],
                                      '--knn-k, --knn-t only act with --eval knn'),
        'T05-knn-t-below-float32': (['--knn-t', 1e-39], "--knn-t 1e-39 is below float32's smallest normal number "
                                                        '(1.18e-38): cos / T would overflow'),
        'tau-below-float32': (['--tau', 1e-40], "--tau 1e-40 is below float32's smallest normal number"),
        'subset-of-imagenet': (['--dataset', 'imagenet', '--train-subset', 100],
                               '--train-subset only acts with --dataset cifar10 or cifar100'),
        'stop-after-past-epochs': (['--stop-after-epoch', 60], '--stop-after-epoch 60 exceeds --epochs 50'),
        'U05-resume-proj-dim': (['--resume', tmp_path / 'moco.pt', '--proj-dim', 32],
                                f'{tmp_path / "moco.pt"} is a run with --proj-dim 64: its weights are of that '
                                'architecture; leave --proj-dim out (or start a new run)'),
        'U03-resume-no-freeze': (['--resume', tmp_path / 'moco.pt', '--no-freeze-patch-embed'],
                                 'is a run with --freeze-patch-embed: its weights are of that architecture; leave '
                                 '--no-freeze-patch-embed out'),
        'U04-resume-pos-embed': (['--resume', tmp_path / 'moco.pt', '--pos-embed', 'learned'],
                                 'is a run with --pos-embed sincos: its weights'),
        'resume-model-kw': (['--resume', tmp_path / 'moco.pt', '--model-kw', 'dim=32', 'depth=2', 'heads=2'],
                            'is a run with --model-kw depth=2 dim=64 heads=2 patch_size=8: its weights'),
    }[case]
    arch = {'model': 'vit_ti16', 'model_kw': TINY[3:7], 'proj_dim': 64, 'pos_embed': 'sincos',
            'freeze_patch_embed': True}
    torch.save({'model': {}, 'optimizer': {}, 'scaler': {}, 'epoch': 1, 'step': 1, 'history': [], 'moco': {},
                'args': arch}, tmp_path / 'moco.pt')  # a run of ours: only what refuses it is read
    run_keys = {'model': {}, 'optimizer': {}, 'scaler': {}, 'epoch': 1, 'step': 1, 'history': [], 'args': {}}
    torch.save(run_keys, tmp_path / 'cifar_last.pt')  # what train_cifar.py's last.pt holds
    torch.save({**run_keys, 'steps_per_epoch': 1}, tmp_path / 'imagenet_last.pt')
    torch.save({**run_keys, 'moco': {}, 'args': {'lr': 'fast'}}, tmp_path / 'damaged.pt')  # hand-edited args
    if case == 'batch-not-divisible':  # torchrun's environment for rank 0 of 3: checked before any process group
        monkeypatch.setenv('WORLD_SIZE', '3')
    for proxy in ('http_proxy', 'https_proxy', 'HTTP_PROXY', 'HTTPS_PROXY'):  # offline: no CIFAR download
        monkeypatch.setenv(proxy, 'http://127.0.0.1:9')
    argv = ['--data', tmp_path / 'empty', '--out', tmp_path / 'out', '--epochs', 50, *TINY, *PROBE, *args]
    with pytest.raises(utils.UserError) as e:  # the one user-error class of every script
        tc.main([str(a) for a in argv])
    assert expect in str(e.value), str(e.value)
    assert (tmp_path / 'run' / 'metrics.jsonl').read_text() == '{}\n'


def test_bad_input_subprocess(tmp_path):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'last.pt').write_bytes(b'x')
    procs = [start('--model', 'vit_huge', '--out', tmp_path / 'a'), start('--out', tmp_path / 'run')]
    for p in procs:
        _, err = finish(p, ok=False)
        assert p.returncode == 1 and 'Traceback' not in err
        assert len(err.strip().splitlines()) == 1 and err.startswith('train_contrastive.py: error: '), err
    assert (tmp_path / 'run' / 'last.pt').read_bytes() == b'x'


def test_infonce_logits_are_fp32_under_bf16_autocast():
    """At tau = 0.2 the logits q.k / tau are ~5 apart at most: in bf16 (8 bits of mantissa) they resolve to ~0.02,
    so the loss under the training autocast must equal the fp32 one (it did not when the matmul ran in bf16)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    want = tc.contrastive_loss(q, k, 0.2)
    with torch.autocast('cpu', torch.bfloat16):
        got = tc.contrastive_loss(q.bfloat16(), k.bfloat16(), 0.2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, tc.contrastive_loss(q.bfloat16().float(), k.bfloat16().float(), 0.2),
                               rtol=1e-5, atol=1e-5)  # (fp32 rounding; a bf16 matmul was ~0.02 off)
    assert abs(got - want) < 0.05  # (the inputs themselves were rounded to bf16)


# -----------------------------------------------------------------------------
# 7. issue 34: resumed flags applied, --lr 0 kept, a one-step warm-up trains, data folders
def tiny_run(*argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        tc.main([str(a) for a in argv])
    return out.getvalue()


def test_resumed_rho_and_wd_reach_the_optimizer(cifar10_dir, tmp_path):
    """S13: `changed: --wd 0.1 -> 0.9, --rho 0.05 -> 0.5` is what AdamW and SAM then use: last.pt's optimizer
    says what its args say, and the weights differ from a plain resume of the same state. Issue 37: --workers,
    --channels-last, --eval-batch-size describe the machine (runs.MACHINE_FLAGS): each resume takes them from its
    command line (here unset: this node's defaults), not from the run (stored as another node's), and says so."""
    common = ['--data', cifar10_dir, '--train-subset', 32, '--test-subset', 20, '--batch-size', 32,
              '--warmup-epochs', 0, *TINY, '--eval', 'knn']
    tiny_run(*common, '--epochs', 1, '--sam', '--out', tmp_path / 'first')
    ckpt = torch.load(tmp_path / 'first' / 'last.pt', weights_only=True)
    ckpt['args'].update(workers=31, channels_last=True, eval_batch_size=5)  # a 32-core node's run
    torch.save(ckpt, tmp_path / 'first' / 'last.pt')
    final = {}
    for name, flags in (('plain', []), ('changed', ['--rho', 0.5, '--wd', 0.9])):
        shutil.copytree(tmp_path / 'first', tmp_path / name)
        log = tiny_run('--resume', tmp_path / name / 'last.pt', '--epochs', 2, *flags)
        final[name] = torch.load(tmp_path / name / 'last.pt', weights_only=True)
        assert (f'machine flags from this command line, not the run: --workers {tc.node_workers()} (the run: 31), '
                '--channels-last None (the run: True), --eval-batch-size 256 (the run: 5)\n') in log, log
        args = final[name]['args']
        assert (args['workers'], args['channels_last'], args['eval_batch_size']) == (tc.node_workers(), None, 256)
    for ckpt in final.values():
        group = ckpt['optimizer']['param_groups'][0]
        assert (group['rho'], group['weight_decay']) == (ckpt['args']['rho'], ckpt['args']['wd'])
    assert (final['changed']['args']['rho'], final['changed']['args']['wd']) == (0.5, 0.9)
    key = 'base_encoder.0.blocks.0.mlp.fc1.weight'
    assert not torch.equal(final['plain']['moco'][key], final['changed']['moco'][key])


def test_lr_0_is_kept_and_a_one_step_warm_up_is_refused(cifar10_dir, tmp_path):
    """C10: --lr 0 trains at LR 0 (it was replaced by the MoCo v3 default), even where the schedule alone would give
    0 too. S01's kind: a run of one step whose warm-up spans it is refused in one line, no folder left: MoCo v3 sets
    a step's LR at the step's start, the warm-up's 0, so it would train nothing."""
    common = ['--data', cifar10_dir, '--train-subset', 32, '--test-subset', 20, '--batch-size', 32, '--epochs', 1,
              *TINY, '--eval', 'knn']
    log = tiny_run(*common, '--warmup-epochs', 0, '--lr', 0, '--out', tmp_path / 'zero')
    assert '| AdamW lr 0 wd 0.1 |' in log
    zero = torch.load(tmp_path / 'zero' / 'last.pt', weights_only=True)
    assert [r['lr'] for r in zero['history'] if r['kind'] == 'train'] == [0]
    tiny_run(*common, '--warmup-epochs', 1, '--lr', 0, '--out', tmp_path / 'zero_warm')  # explicit 0: not refused
    p = start(*common, '--warmup-epochs', 1, '--lr', 1e-3, '--out', tmp_path / 'one')
    _, err = finish(p, ok=False)
    assert p.returncode == 1 and 'Traceback' not in err and err.count('\n') == 1, err
    assert err == ("train_contrastive.py: error: --epochs 1 with 1 step an epoch: MoCo v3's warm-up gives the run's "
                   'only step LR 0 (it would train nothing): raise --epochs or pass --warmup-epochs 0\n'), err
    assert not (tmp_path / 'one').exists()


def test_data_folders_one_class_16_bit_and_a_decompression_bomb(cifar10_dir, tmp_path):
    """H28: a folder of one class is refused naming only this script's flags (no --classes here); H29: 16-bit
    PNGs are their levels / 257 (PIL's convert made them near white); H14: a decompression bomb is one line."""
    from PIL import Image
    from conftest import write_bomb_png
    root = tmp_path / 'data'
    for split in ('train', 'test'):
        for c in sorted((cifar10_dir / split).iterdir()):
            (root / split / c.name).mkdir(parents=True)
            for f in sorted(c.iterdir())[:2]:
                shutil.copy(f, root / split / c.name / f.name)
    level = np.random.default_rng(0).integers(0, 65536, (32, 32), dtype=np.uint16)
    for f in (root / 'train' / 'cat').iterdir():
        f.unlink()
        Image.fromarray(level).save(f.with_suffix('.png'))
    args = tc.get_args(['--data', str(root), *TINY, *PROBE])
    loaded = tc.load_data(args, 'cpu')
    cats = loaded['train'][loaded['train_y'] == 3]
    assert torch.equal(cats, torch.from_numpy(np.round(level / 257).astype(np.uint8)).expand(2, 3, 32, 32))
    for flag in ('--train-subset', '--test-subset'):  # the probes on 5 of the 10 classes said done (bad-inputs-3)
        with pytest.raises(utils.UserError, match=f'{flag} 5 leaves 5 of the 10 classes without an image'):
            tc.load_data(tc.get_args(['--data', str(root), *TINY, *PROBE, flag, '5']), 'cpu')
    write_bomb_png(root / 'train' / 'cat' / 'zz_bomb.png')
    with pytest.raises(utils.UserError, match=r"cannot decode .*zz_bomb.png: it has more than 178,956,970 pixels"):
        tc.load_data(args, 'cpu')
    one = tmp_path / 'one'
    for split in ('train', 'test'):
        shutil.copytree(root / split / 'airplane', one / split / 'airplane')
    with pytest.raises(utils.UserError) as e:
        tc.load_data(tc.get_args(['--data', str(one), *TINY, *PROBE]), 'cpu')
    assert 'has 1 class folders, cifar10 has 10: --data must hold all 10' in str(e.value)
    assert '--classes' not in str(e.value)


# -----------------------------------------------------------------------------
# 8. Issue 48 (2, 3): MoCo v3's recipe pinned to its official code (facebookresearch/moco-v3 at c349e6e, read with
# the fetch tool, typed in here): the views, the momentum schedule, the defaults. Issue 42: the k-NN votes at a
# small T, the probes' data, a resume's architecture.
MOCO_V3_VIEWS = dict(  # main_moco.py lines 262-285: augmentation1 (view 0), augmentation2 (view 1)
    ratio=(3 / 4, 4 / 3),  # transforms.RandomResizedCrop(224, scale=(args.crop_min, 1.)): torchvision's default ratio
    jitter=(0.4, 0.4, 0.2, 0.1), p_jitter=0.8,  # RandomApply([ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8)
    p_gray=0.2,  # RandomGrayscale(p=0.2)
    blur_sigma=(0.1, 2.0), p_blur=(1.0, 0.1),  # RandomApply([GaussianBlur([.1, 2.])], p=1.0 / 0.1)
    p_solarize=(0.0, 0.2),  # view 1 only: RandomApply([Solarize()], p=0.2)
    p_flip=0.5)  # RandomHorizontalFlip()


def test_the_views_take_moco_v3_s_constants():
    """A saturation of 0.4 for the recipe's 0.2 (issue 48 (2)) passed every test: no test held the recipe."""
    assert augment.MOCO_AUG == MOCO_V3_VIEWS


def test_a_view_s_saturation_moves_as_moco_v3_s_jitter_does(images, monkeypatch):
    """The views' colour statistics against the recipe run by torchvision (RandomApply(ColorJitter(0.4, 0.4, 0.2,
    0.1), p=0.8) per image): the spread over 600 views of log(chroma / luma std), whose ratio to the image's is the
    saturation factor (brightness and contrast scale both; a hue rotation moves it a little). Measured: 0.136 here,
    0.131 torchvision's; saturation 0.4 gives 0.231 (torchvision's 0.234; standard error ~0.005)."""
    for key, value in (('p_gray', 0.0), ('p_blur', (0.0, 0.0)), ('p_solarize', (0.0, 0.0)), ('ratio', (1.0, 1.0))):
        monkeypatch.setitem(augment.MOCO_AUG, key, value)  # the jitter alone (whole-image crops, the flip)
    x = images.repeat(3, 1, 1, 1)

    def spread(v):  # (N, 3, H, W) in [0, 1] -> std over images of log(q(view) / q(image))
        def q(t):
            luma = (0.299 * t[:, 0] + 0.587 * t[:, 1] + 0.114 * t[:, 2]).flatten(1).std(1)
            return (t.max(1).values - t.min(1).values).mean((1, 2)), luma
        (c0, l0), (c1, l1) = q(x.float() / 255), q(v)
        keep = (c0 > 0.03) & (l0 > 0.03)  # (not grey or flat)
        return ((c1 / l1) / (c0 / l0)).log()[keep].std().item()
    torch.manual_seed(0)
    recipe = v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8)
    want = spread(torch.stack([recipe(img) for img in x]).float() / 255)
    zero, one = torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)
    view = lambda: augment.moco_view(x, torch.Generator().manual_seed(1), len(x), 0, len(x), 0, 32, 1.0, zero, one)
    assert abs(spread(view()) - want) < 0.03, (spread(view()), want)
    monkeypatch.setitem(augment.MOCO_AUG, 'jitter', (0.4, 0.4, 0.4, 0.1))  # what this test is to see
    assert spread(view()) - want > 0.06


def test_the_defaults_are_moco_v3_s_vit_small_recipe_and_dino_s_knn():
    """CONFIG.md, "ViT-Small, 4-node (32-GPU) pre-training": main_moco.py -a vit_small --optimizer=adamw --lr=1.5e-4
    --weight-decay=.1 --epochs=300 --warmup-epochs=40 --stop-grad-conv1 --moco-m-cos --moco-t=.2, and main_moco.py's
    defaults: --batch-size 4096 (global), --moco-m 0.99, --moco-mlp-dim 4096, --moco-dim 256, --crop-min 0.08,
    lr = lr x batch / 256 (line 190). DINO's eval_knn.py: --temperature 0.07, k 20 of its --nb_knn."""
    args = tc.get_args([])
    assert (args.batch_size, args.lr, args.wd, args.epochs, args.warmup_epochs) == (4096, 1.5e-4 * 4096 / 256, 0.1,
                                                                                    300, 40)
    assert (args.freeze_patch_embed, args.tau, args.moco_m, args.proj_hidden, args.proj_dim, args.crop_min) == (
        True, 0.2, 0.99, 4096, 256, 0.08)
    assert (args.knn_k, args.knn_t, args.pos_embed) == (20, 0.07, 'sincos')
    assert tc.get_args(['--batch-size', '1024']).lr == 1.5e-4 * 1024 / 256


def test_momentum_follows_moco_v3_s_cosine_from_the_first_step_to_the_last(cifar10_dir, tmp_path, monkeypatch):
    """Issue 48 (3): the schedule inverted (1 - cos for 1 + cos: m from 1 down to --moco-m) passed every test: the one
    run they checked took its single update at the half-way point, where both give (1 + m0) / 2. main_moco.py's
    adjust_moco_momentum at iteration g of N: m_g = 1 - (1 + cos(pi g / N)) / 2 x (1 - m0); f_k updated with m_g
    before iteration g's keys (g = 0 a no-op: f_k = f_q). Here f_k follows each step with m_{g+1} before the next
    step's keys: the updates of a 2-epoch run of 4 steps an epoch are m_1 .. m_8, the last 1. The same run's k-NN at
    T = 0.005 (T09: exp(cos / T) overflowed float32 there, a nan accuracy, then a traceback) is written whole."""
    m0, N, seen = 0.9, 8, []
    update = tc.MoCo.update_momentum_encoder
    monkeypatch.setattr(tc.MoCo, 'update_momentum_encoder', lambda self, m: seen.append(m) or update(self, m))
    tiny_run('--data', cifar10_dir, '--train-subset', 40, '--test-subset', 20, '--batch-size', 10, '--epochs', 2,
             '--warmup-epochs', 0, '--moco-m', m0, *TINY, '--eval', 'knn', '--knn-t', 0.005, '--out', tmp_path / 'r')
    closed = [1 - (1 + math.cos(math.pi * g / N)) / 2 * (1 - m0) for g in range(1, N + 1)]
    assert seen == pytest.approx(closed, rel=0, abs=1e-12) and seen[-1] == 1.0
    assert seen[0] == pytest.approx(0.9 + 0.05 * (1 - math.cos(math.pi / 8)), abs=1e-12)  # 0.90381, not 0.99619
    knn, = rows(tmp_path / 'r', 'eval')
    assert knn['protocol'] == 'knn' and knn['n'] == 20 and math.isfinite(knn['loss']) and 0 <= knn['top1'] <= 100


def test_knn_votes_at_a_small_t_equal_an_fp64_oracle():
    """T09: DINO's weights exp(cos / T) in float32 overflow once cos / T > 88.7 (T below ~0.0113 with a neighbour near
    cos 1): inf / inf = nan. The vote shares at T = 0.005, neighbours at cos ~0.99 (cos / T ~200), equal exp(cos / T)
    written out in float64 (which holds exp(200)), to float32's resolution of cos / T."""
    g = torch.Generator().manual_seed(0)
    train_f, train_y = torch.randn(300, 16, generator=g), torch.randint(0, 5, (300,), generator=g)
    test_f = train_f[:40] + 0.05 * torch.randn(40, 16, generator=g)
    got = tc.knn_scores(train_f, train_y, test_f, 5, 20, 0.005)
    a, b = (f.double() / f.double().norm(dim=1, keepdim=True) for f in (train_f, test_f))
    sim, idx = (b @ a.T).topk(20, dim=1)
    assert (sim[:, 0] / 0.005 > 88.8).all()  # where float32's exp overflows
    votes = torch.zeros(40, 5, dtype=torch.float64).scatter_add_(1, train_y[idx], (sim / 0.005).exp())
    torch.testing.assert_close(got.double(), votes / votes.sum(1, keepdim=True), rtol=0, atol=1e-4)


def test_probes_need_two_classes_and_finite_features_and_a_resume_takes_model_kw_in_any_order(cifar10_dir, tmp_path):
    """T21: --eval linear linear ran the probe twice. "Data that cannot train a classifier": one training image of one
    class (--train-subset 1) was probed (100% of nothing); a backbone of nan weights printed nan accuracies (a run:
    then a traceback at metrics.jsonl). Each now one line. A resume's --model-kw in another order is the run's."""
    assert tc.get_args(['--eval', 'linear', 'linear', 'knn']).eval == ['linear', 'knn']
    common = ['--data', cifar10_dir, '--test-subset', 10, '--eval-only', *TINY, '--eval', 'knn']
    with pytest.raises(utils.UserError, match='--train-subset 1 leaves 9 of the 10 classes without an image'):
        tc.main([str(a) for a in [*common, '--train-subset', 1]])  # (refused where the subset is read)
    model = models.build_model('vit_ti16', 10, 32, models.parse_model_kw(TINY[3:7]), cifar=True)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight.fill_(float('nan'))
    torch.save(model.state_dict(), tmp_path / 'nan.pt')
    with pytest.raises(utils.UserError, match="the backbone's features are not finite \\(inf/nan\\) at epoch 0"):
        tc.main([str(a) for a in [*common, '--train-subset', 20, '--checkpoint', tmp_path / 'nan.pt']])
    tiny_run('--data', cifar10_dir, '--train-subset', 20, '--test-subset', 10, '--batch-size', 10, '--epochs', 1,
             '--warmup-epochs', 0, *TINY, '--eval', 'knn', '--stop-after-epoch', 1, '--out', tmp_path / 'run')
    kw = TINY[3:7]
    args = tc.get_args(['--resume', str(tmp_path / 'run' / 'last.pt'), '--epochs', '2', '--model-kw', *kw[::-1]])
    assert args.model_kw == kw[::-1] and args.proj_dim == 64
