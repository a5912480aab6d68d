"""train_imagenet.py on a tiny ImageNet-layout set built from the shared CIFAR-10 JPEGs.

Oracles: an uninterrupted run (for the mid-epoch resume), a single-process evaluation and an
independent PIL/torchvision evaluation written here (for the distributed one), one batch of 16
(for 2 x 8 accumulation), the closed-form LR schedules, and timm / torchvision models (for
--eval-only on foreign checkpoints).
"""
import contextlib
import json
import math
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

import train_imagenet as ti
from conftest import REPO
from sam import SAM

IMG = 64
VAL_PER_CLASS = [4, 3, 3, 3, 4, 3, 3, 4, 3, 3]  # 33 validation images: odd, and uneven over 2 ranks
TRAIN_PER_CLASS = 20
TINY_VIT = ['--model', 'vit_ti16', '--model-kw', 'depth=2', 'dim=64', 'heads=2', '--img-size', str(IMG)]
TINY_MIXER = ['--model', 'mixer_s16', '--model-kw', 'depth=2', 'dim=64', 'tokens_mlp_dim=32',
              'channels_mlp_dim=128', '--img-size', str(IMG)]
# global batch 20 -> 10 optimizer steps per epoch on 200 training images
SCHEDULE = ['--batch-size', '20', '--epochs', '2', '--lr', '0.01', '--lr-batch', '20', '--log-every', '5',
            '--eval-batch-size', '8']


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """In-process work on one thread, like the OMP_NUM_THREADS=1 subprocesses: tiny ops gain nothing
    from a second thread, and lose a lot to contention on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope='module')
def tiny_imagenet(cifar10_dir, tmp_path_factory):
    """DIR/{train,val}/<class>/*.JPEG: 10 classes x 20 train, 33 val (CIFAR test images), upscaled to 64 px."""
    root = tmp_path_factory.mktemp('tiny_imagenet')
    classes = sorted(os.listdir(cifar10_dir / 'train'))
    for split, src, counts in (('train', 'train', [TRAIN_PER_CLASS] * 10), ('val', 'test', VAL_PER_CLASS)):
        for c, n in zip(classes, counts):
            (root / split / c).mkdir(parents=True)
            for f in sorted(os.listdir(cifar10_dir / src / c))[:n]:
                img = Image.open(cifar10_dir / src / c / f).convert('RGB').resize((IMG, IMG), Image.BICUBIC)
                img.save(root / split / c / (f.rsplit('.', 1)[0] + '.JPEG'), quality=90)
    return root


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def run(args, nproc=1, expect_ok=True):
    """The script as a user runs it: python, or torchrun with 2 gloo processes on CPU."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(nproc),
        '--master_port', str(free_port())]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    p = subprocess.run(launcher + [str(REPO / 'train_imagenet.py')] + [str(a) for a in args],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert p.returncode == 0, f'exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}'
    return p


def rows(out, kind):
    with open(out / 'metrics.jsonl') as f:
        return [r for r in map(json.loads, f) if r['kind'] == kind]


def load(path):
    return torch.load(path, map_location='cpu', weights_only=True)


def eval_in_process(argv):
    """--eval-only through main() in this process (single process); returns its result dict."""
    return ti.main(['--eval-only', '--workers', '0', '--eval-batch-size', '8'] + [str(a) for a in argv])


def oracle_counts(model, val_dir, mean, std, crop_pct=0.875, img=IMG):
    """Top-1/top-5 counts of `model` over every image in val_dir, preprocessed independently of the
    script (torchvision v1 PIL transforms), in one batch."""
    tf = T.Compose([T.Resize(int(img / crop_pct)), T.CenterCrop(img), T.ToTensor(), T.Normalize(mean, std)])
    xs, ys = [], []
    for label, c in enumerate(sorted(os.listdir(val_dir))):
        for f in sorted(os.listdir(val_dir / c)):
            xs.append(tf(Image.open(val_dir / c / f).convert('RGB')))
            ys.append(label)
    with torch.no_grad():
        top5 = model.eval()(torch.stack(xs)).topk(5, dim=1).indices
    hit = top5 == torch.tensor(ys)[:, None]
    return int(hit[:, 0].sum()), int(hit.any(1).sum()), len(ys)


# -----------------------------------------------------------------------------------------------
# 1. End to end, distributed: two epochs, a mid-epoch resume, and --eval-only.
@pytest.fixture(scope='module')
def vit_runs(tiny_imagenet, tmp_path_factory):
    """A: 2 x gloo, two epochs uninterrupted. B: the same run "preempted" after step 13 with
    --save-every 4, so its last checkpoint is step 12 (2 of 10 into epoch 2), then resumed with a
    different worker count."""
    tmp = tmp_path_factory.mktemp('vit_runs')
    # warmup 6: logged steps (every 5) fall inside it; mixup: training draws from the global RNG,
    # so a resume that did not restore it would not be exact
    common = ['--data', tiny_imagenet] + TINY_VIT + SCHEDULE + ['--warmup-steps', '6', '--mixup', '0.2']
    run(common + ['--workers', '0', '--out', tmp / 'A'], nproc=2)
    run(common + ['--workers', '0', '--out', tmp / 'B', '--save-every', '4', '--max-steps', '13'], nproc=2)
    mid = load(tmp / 'B' / 'checkpoint.pt')
    resumed = run(common + ['--workers', '1', '--resume', tmp / 'B' / 'checkpoint.pt'], nproc=2)
    return dict(A=tmp / 'A', B=tmp / 'B', mid=mid, resumed=resumed)


def test_ddp_vit_trains_two_epochs_with_closed_form_lr(vit_runs):
    A = vit_runs['A']
    evals = rows(A, 'eval')
    assert [r['epoch'] for r in evals] == [1, 2] and all(r['n'] == 33 for r in evals)
    ckpt = load(A / 'checkpoint.pt')
    assert (ckpt['epoch'], ckpt['step'], len(ckpt['rng'])) == (2, 20, 2)
    assert not any(k.startswith(('module.', '_orig_mod.')) for k in ckpt['model'])
    # SAM-paper schedule: linear warmup over 6 steps, then linear decay to 0 at step 20;
    # the row of step s logs the LR step s used.
    for r in rows(A, 'train'):
        s = r['step'] - 1
        expected = 0.01 * ((s + 1) / 6 if s < 6 else (20 - s) / (20 - 6))
        assert r['lr'] == pytest.approx(expected, rel=1e-9)
        assert math.isfinite(r['loss']) and r['img_per_s'] > 0 and 0 <= r['data_time'] <= r['step_time']
    args = json.loads((A / 'args.json').read_text())
    assert (args['world_size'], args['micro_batch'], args['steps_per_epoch']) == (2, 10, 10)
    assert args['norm'] == 'jax' and args['amp'] == 'off'


def test_resume_mid_epoch_continues_exactly(vit_runs):
    mid = vit_runs['mid']
    assert (mid['epoch'], mid['step']) == (1, 12)  # the --save-every checkpoint, mid-epoch
    assert 'at epoch 1, step 12 (2 of 10 in this epoch)' in vit_runs['resumed'].stdout
    final_a, final_b = load(vit_runs['A'] / 'checkpoint.pt'), load(vit_runs['B'] / 'checkpoint.pt')
    for key, value in final_a['model'].items():  # same data, augmentation, RNG: bit-identical weights
        assert torch.equal(value, final_b['model'][key]), key
    for key in ('step', 'epoch'):
        assert final_a[key] == final_b[key]
    assert rows(vit_runs['A'], 'eval')[-1] == rows(vit_runs['B'], 'eval')[-1]


def test_eval_only_reproduces_final_accuracy_and_is_exact(vit_runs, tiny_imagenet):
    """2. Distributed evaluation (rank r takes images r, r+2, ...) = single-process evaluation = an
    independent evaluation written here = the accuracy the training run logged; 33 images counted once."""
    final = rows(vit_runs['A'], 'eval')[-1]
    ckpt = vit_runs['A'] / 'checkpoint.pt'
    argv = ['--data', tiny_imagenet, '--checkpoint', ckpt] + TINY_VIT
    p = run(['--eval-only', '--workers', '0', '--eval-batch-size', '8'] + argv, nproc=2)
    dist_res = json.loads(p.stdout.strip().splitlines()[-1])
    single = eval_in_process(argv)
    model = ti.build_model('vit_ti16', 10, IMG, dict(depth=2, dim=64, heads=2))
    model.load_state_dict(load(ckpt)['model'])
    oracle = oracle_counts(model, tiny_imagenet / 'val', (0.5,) * 3, (0.5,) * 3)
    for res in (dist_res, single):
        assert (res['correct1'], res['correct5'], res['n']) == oracle
        assert (res['correct1'], res['correct5'], res['n']) == (final['correct1'], final['correct5'], 33)
        assert res['loss'] == pytest.approx(final['loss'], rel=1e-5)


def test_ddp_mixer_convmixer_recipe_sam_accumulation(tiny_imagenet, tmp_path):
    """Tiny Mixer, 2 x gloo, ConvMixer recipe (RandAugment, mixup/cutmix, erasing, smoothing, one-cycle)
    with SAM and 2 accumulation steps: two epochs, and the saved weights evaluate to the logged numbers."""
    out = tmp_path / 'mixer'
    run(['--data', tiny_imagenet, '--recipe', 'convmixer', '--sam', '--accum-steps', '2', '--workers', '1',
         '--out', out] + TINY_MIXER + SCHEDULE, nproc=2)
    evals = rows(out, 'eval')
    assert [r['epoch'] for r in evals] == [1, 2] and all(r['n'] == 33 for r in evals)
    args = json.loads((out / 'args.json').read_text())
    assert (args['micro_batch'], args['sched'], args['norm'], args['smoothing']) == (5, 'onecycle', 'imagenet', 0.1)
    for r in rows(out, 'train'):  # np.interp one-cycle over 2 epochs of 10 steps, t = (s + 1) / 10
        t = r['step'] / 10
        assert r['lr'] == pytest.approx(0.01 * np.interp(t, [0, 0.8, 1.6, 2], [0, 1, 0.05, 0]), rel=1e-9)
        assert math.isfinite(r['loss'])
    single = eval_in_process(['--data', tiny_imagenet, '--checkpoint', out / 'checkpoint.pt', '--recipe',
                              'convmixer'] + TINY_MIXER)
    assert (single['correct1'], single['correct5']) == (evals[-1]['correct1'], evals[-1]['correct5'])


def test_ddp_batchnorm_convmixer_sam_eval_matches_its_checkpoint(tiny_imagenet, tmp_path):
    """BatchNorm under DDP + SAM: each rank's running statistics drift apart in training; the epoch's
    distributed evaluation must still be that of the saved (rank-0) weights and statistics."""
    out = tmp_path / 'convmixer'
    tiny = ['--model', 'convmixer_256_8', '--model-kw', 'dim=32', 'depth=2', 'patch_size=8', '--img-size', IMG]
    run(['--data', tiny_imagenet, '--sam', '--workers', '0', '--out', out, '--epochs', '1', '--batch-size', '20',
         '--lr', '0.01', '--lr-batch', '20', '--warmup-steps', '2', '--eval-batch-size', '8'] + tiny, nproc=2)
    logged = rows(out, 'eval')[-1]
    single = eval_in_process(['--data', tiny_imagenet, '--checkpoint', out / 'checkpoint.pt'] + tiny)
    assert (single['correct1'], single['correct5'], single['n']) == (logged['correct1'], logged['correct5'], 33)
    assert single['loss'] == pytest.approx(logged['loss'], rel=1e-6)


# -----------------------------------------------------------------------------------------------
# 3. Accumulation: 2 micro-batches of 8 give the same step as one batch of 16, with and without SAM.
def tiny_layernorm_model():
    torch.manual_seed(0)
    model = ti.build_model('vit_ti16', 10, 32, dict(depth=2, dim=32, heads=2, patch_size=8))
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the zero-init head would leave the body still
    return model


def three_steps(model, sam, micro_batches):
    """Three optimizer steps of the script's train_step on fixed data; returns the flat weights.

    SGD base: its update is linear in the gradient, so a missing 1/k or a per-micro-batch
    perturbation shows (Adam's first steps are nearly sign(g) and would hide both)."""
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.5) if sam else \
        torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler('cpu', enabled=False)
    g, losses = torch.Generator().manual_seed(1), []
    for _ in range(3):
        x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        micro = [(x[i:i + 16 // micro_batches], y[i:i + 16 // micro_batches])
                 for i in range(0, 16, 16 // micro_batches)]
        loss, _ = ti.train_step(model, opt, scaler, micro, torch.nn.functional.cross_entropy,
                                contextlib.nullcontext, sam=sam, clip_grad=0)
        losses.append(loss)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), torch.stack(losses)


@pytest.mark.parametrize('n,batch', [(10, 6), (1000, 24), (97, 12)])
def test_sampler_steps_and_order_do_not_depend_on_world_size(n, batch):
    """Every world size W takes N // batch steps of one global permutation (no padded repeats):
    step s covers the same `batch` distinct images whatever W, and rank r's share is its seeds."""
    steps_of = {}
    for world in [w for w in (1, 2, 3, 4, 6, 8) if batch % w == 0]:
        per_rank = [list(ti.ResumableSampler(list(range(n)), world, r, seed=0, per_step=batch // world))
                    for r in range(world)]
        assert all(len(p) == (n // batch) * (batch // world) for p in per_rank)
        steps = []
        for s in range(n // batch):
            images = [idx for p in per_rank for idx, _ in p[s * batch // world:(s + 1) * batch // world]]
            assert len(set(images)) == batch
            steps.append(sorted(images))
        steps_of[world] = steps
        seeds = [seed for p in per_rank for _, seed in p]
        assert len(set(seeds)) == len(seeds)
    assert all(steps == steps_of[1] for steps in steps_of.values())


@pytest.mark.parametrize('sam', [False, True], ids=['plain', 'sam'])
def test_accumulation_2x8_equals_one_batch_of_16(sam):
    w16, loss16 = three_steps(tiny_layernorm_model(), sam, micro_batches=1)
    w8x2, loss8x2 = three_steps(tiny_layernorm_model(), sam, micro_batches=2)
    torch.testing.assert_close(w8x2, w16, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss8x2, loss16, rtol=1e-5, atol=1e-6)
    w0 = torch.cat([p.detach().flatten() for p in tiny_layernorm_model().parameters()])
    assert (w16 - w0).abs().max() > 1e-2  # the steps moved the weights


def test_sam_step_differs_from_plain_step():
    """Control for the test above: with rho = 0.5 the SAM steps differ from plain SGD, so the SAM
    case compares something SAM-specific."""
    w_plain, _ = three_steps(tiny_layernorm_model(), False, micro_batches=2)
    w_sam, _ = three_steps(tiny_layernorm_model(), True, micro_batches=2)
    assert (w_plain - w_sam).abs().max() > 1e-3


# -----------------------------------------------------------------------------------------------
# --eval-only on foreign checkpoints, against the foreign model itself.
def test_eval_only_timm_vit_state_dict(tiny_imagenet, tmp_path):
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    timm_model = VisionTransformer(img_size=IMG, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=10)
    with torch.no_grad():
        for p in timm_model.parameters():
            p.add_(0.2 * torch.randn_like(p))  # away from init: predictions that depend on every weight
    torch.save(timm_model.state_dict(), tmp_path / 'timm_vit.pth')
    res = eval_in_process(['--data', tiny_imagenet, '--checkpoint', tmp_path / 'timm_vit.pth',
                           '--norm', 'jax'] + TINY_VIT)
    assert (res['correct1'], res['correct5'], res['n']) == oracle_counts(
        timm_model, tiny_imagenet / 'val', (0.5,) * 3, (0.5,) * 3)


def test_eval_only_official_jax_npz_vit_and_mixer(tiny_imagenet, tmp_path):
    """.npz files in the official layouts, written by the loader tests' writers; oracles: timm's ViT
    with the source weights, and timm's Mixer given the same arrays (32 px, 8 px patches, as there)."""
    import test_checkpoints as tc
    jax = ['--data', tiny_imagenet, '--norm', 'jax', '--img-size', tc.IMG]
    vit_source = tc.randomise(tc.timm_vit())
    np.savez(tmp_path / 'ViT.npz', **tc.vit_npz_arrays(vit_source.state_dict()))
    res = eval_in_process(jax + ['--checkpoint', tmp_path / 'ViT.npz', '--model', 'vit_ti16', '--model-kw',
                                 f'depth={tc.DEPTH}', f'dim={tc.DIM}', f'heads={tc.HEADS}', f'patch_size={tc.PATCH}'])
    assert (res['correct1'], res['correct5'], res['n']) == oracle_counts(
        vit_source, tiny_imagenet / 'val', (0.5,) * 3, (0.5,) * 3, img=tc.IMG)
    arrays = tc.mixer_npz_arrays()
    np.savez(tmp_path / 'Mixer.npz', **arrays)
    res = eval_in_process(jax + ['--checkpoint', tmp_path / 'Mixer.npz', '--model', 'mixer_s16', '--model-kw',
                                 f'depth={tc.DEPTH}', f'dim={tc.DIM}', f'patch_size={tc.PATCH}',
                                 f'tokens_mlp_dim={tc.DIM // 2}', f'channels_mlp_dim={4 * tc.DIM}'])
    assert (res['correct1'], res['correct5'], res['n']) == oracle_counts(
        tc.timm_mixer_from_arrays(arrays), tiny_imagenet / 'val', (0.5,) * 3, (0.5,) * 3, img=tc.IMG)


def test_eval_only_refuses_a_head_for_other_classes(tiny_imagenet, tmp_path, capsys):
    from timm.models.vision_transformer import VisionTransformer
    torch.save(VisionTransformer(img_size=IMG, patch_size=16, embed_dim=64, depth=2, num_heads=2,
                                 num_classes=1000).state_dict(), tmp_path / 'in1k.pth')
    err = user_error(capsys, ['--data', tiny_imagenet, '--eval-only', '--workers', '0', '--checkpoint',
                              tmp_path / 'in1k.pth'] + TINY_VIT)
    assert '1000 classes' in err and 'untrained head' in err


def test_eval_only_torchvision_resnet_state_dict(tiny_imagenet, tmp_path):
    import torchvision
    torch.manual_seed(0)
    resnet = torchvision.models.resnet50(num_classes=10)
    with torch.no_grad():
        for m in resnet.modules():  # non-trivial BatchNorm statistics, so eval mode matters
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 2.0)
    torch.save({'module.' + k: v for k, v in resnet.state_dict().items()}, tmp_path / 'r50.pth')  # DDP-style
    res = eval_in_process(['--data', tiny_imagenet, '--checkpoint', tmp_path / 'r50.pth', '--model', 'resnet50',
                           '--img-size', 32, '--norm', 'imagenet'])  # 32 px: ResNet-50 is slow on 2 cores
    mean, std = ti.MEANS['imagenet']
    assert (res['correct1'], res['correct5'], res['n']) == oracle_counts(resnet, tiny_imagenet / 'val', mean, std,
                                                                         img=32)


# -----------------------------------------------------------------------------------------------
# 4. Bad input: a clear message on stderr and a non-zero exit, no traceback.
def test_bad_data_path_subprocess_gives_layout_and_no_traceback(tmp_path):
    p = run(['--data', tmp_path / 'nowhere'] + TINY_VIT, expect_ok=False)
    assert p.returncode != 0 and 'Traceback' not in p.stderr
    assert 'DIR/train/<wnid>/*.JPEG' in p.stderr and str(tmp_path / 'nowhere') in p.stderr


def user_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        ti.main([str(a) for a in argv])
    assert e.value.code not in (0, None)
    return capsys.readouterr().err


def test_unflat_val_folder_is_explained(tmp_path, capsys):
    (tmp_path / 'train' / 'n01440764').mkdir(parents=True)
    (tmp_path / 'val').mkdir()
    Image.new('RGB', (8, 8)).save(tmp_path / 'train' / 'n01440764' / 'a.JPEG')
    Image.new('RGB', (8, 8)).save(tmp_path / 'val' / 'ILSVRC2012_val_00000001.JPEG')  # unsorted val
    err = user_error(capsys, ['--data', tmp_path, '--workers', '0'] + TINY_VIT)
    assert "Couldn't find any class folder" in err and 'valprep.sh' in err


def test_unknown_model_lists_valid_names(tiny_imagenet, capsys):
    err = user_error(capsys, ['--data', tiny_imagenet, '--model', 'vit_huge'])
    assert "unknown model 'vit_huge'" in err
    for name in ('vit_b16', 'mixer_b16', 'convmixer_1536_20', 'resnet152'):
        assert name in err


def test_missing_checkpoint_and_resume_file(tiny_imagenet, tmp_path, capsys):
    err = user_error(capsys, ['--data', tiny_imagenet, '--eval-only', '--checkpoint', tmp_path / 'no.pt'] + TINY_VIT)
    assert f'--checkpoint: no such file: {tmp_path / "no.pt"}' in err
    err = user_error(capsys, ['--data', tiny_imagenet, '--resume', tmp_path / 'no.pt'] + TINY_VIT)
    assert f'--resume: no such file: {tmp_path / "no.pt"}' in err  # never a silent fresh start
    assert not (tmp_path / 'metrics.jsonl').exists()


def test_wrong_architecture_names_key_and_shapes(vit_runs, tiny_imagenet, capsys):
    ckpt = vit_runs['A'] / 'checkpoint.pt'
    narrow = ['--model', 'vit_ti16', '--model-kw', 'depth=2', 'dim=32', 'heads=2', '--img-size', IMG]
    err = user_error(capsys, ['--data', tiny_imagenet, '--eval-only', '--workers', '0', '--checkpoint', ckpt]
                     + narrow)
    assert 'cls_token' in err and '(1, 1, 64)' in err and '(1, 1, 32)' in err
    err = user_error(capsys, ['--data', tiny_imagenet, '--workers', '0', '--resume', ckpt, '--out',
                              vit_runs['A'].parent / 'never'] + narrow + SCHEDULE)
    assert "shape mismatch at 'cls_token': checkpoint (1, 1, 64), model (1, 1, 32)" in err
