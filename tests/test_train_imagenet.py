"""train_imagenet.py on a tiny ImageNet-layout set built from the shared CIFAR-10 JPEGs.

Oracles: an uninterrupted run (for resumes: bit-identical at an epoch boundary, the same images in
the same order mid-epoch), a single-process evaluation and an independent PIL/torchvision evaluation
written here (for the distributed one), one batch of 16 (for 2 x 8 accumulation), a single-process
simulation of SAM in which each replica's eps-hat comes from its own shard (for the 2-process step),
the closed-form LR schedules, and timm / torchvision models (for --eval-only on foreign checkpoints).
"""
import contextlib
import hashlib
import io
import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms as T

import train_imagenet as ti
import vit
from conftest import REPO, write_bomb_png
from sam import SAM
from toys import free_port

IMG = 64
VAL_PER_CLASS = [4, 3, 3, 3, 4, 3, 3, 4, 3, 3]  # 33 validation images: odd, and uneven over 2 ranks
TRAIN_PER_CLASS = 20
TINY_VIT = ['--model', 'vit_ti16', '--model-kw', 'depth=2', 'dim=64', 'heads=2', '--img-size', IMG]
TINY_MIXER = ['--model', 'mixer_s16', '--model-kw', 'depth=2', 'dim=64', 'tokens_mlp_dim=32',
              'channels_mlp_dim=128', '--img-size', IMG]
# global batch 20 -> 10 optimizer steps per epoch on 200 training images
SCHEDULE = ['--batch-size', 20, '--epochs', 2, '--lr', 0.01, '--log-every', 5, '--eval-batch-size', 8]
TRAIN_KEYS = {'kind', 'epoch', 'step', 'lr', 'loss', 'img_per_s', 'elapsed_s'}
EVAL_KEYS = {'kind', 'epoch', 'step', 'loss', 'top1', 'top5', 'correct', 'n', 'elapsed_s'}
TIMING = ('img_per_s', 'elapsed_s')


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """In-process work on one thread, like the OMP_NUM_THREADS=1 subprocesses: tiny ops gain nothing
    from a second thread, lose a lot to contention on a shared 2-core machine, and in-process runs
    can then be compared bit for bit with subprocess runs."""
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


def run(args, nproc=1, expect_ok=True, script=REPO / 'train_imagenet.py'):
    """The script as a user runs it: python, or torchrun with `nproc` gloo processes on CPU."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(nproc),
        '--master_port', str(free_port())]
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / 'tests')]))
    p = subprocess.run(launcher + [str(script)] + [str(a) for a in args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    if expect_ok:
        assert p.returncode == 0, f'exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}'
    return p


def strict_json(line):
    return json.loads(line, parse_constant=lambda c: pytest.fail(f'{c} in metrics.jsonl'))


def rows(out, kind=None):
    with open(out / 'metrics.jsonl') as f:
        return [r for r in map(strict_json, f) if kind in (None, r['kind'])]


def load(path):
    return torch.load(path, map_location='cpu', weights_only=True)


def main(argv):
    return ti.main([str(a) for a in argv])


def eval_in_process(argv):
    """--eval-only through main() in this process (single process); returns its result dict."""
    return main(['--eval-only', '--workers', 0, '--eval-batch-size', 8] + argv)


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


def counts(res):
    return res['correct'], round(res['top5'] * res['n'] / 100), res['n']


# -----------------------------------------------------------------------------------------------
# 1. End to end, distributed: two epochs, a mid-epoch resume, and --eval-only.
COPY_AT_STEP_12 = '''
import shutil, sys, train_imagenet as ti
real_save_run = ti.save_run
def save_run(out, model, optimizer, scaler, step, *rest):  # rank 0: the run "preempted" after this save
    real_save_run(out, model, optimizer, scaler, step, *rest)
    if step == 12:
        shutil.copytree(out, sys.argv[1])
ti.save_run = save_run
ti.main(sys.argv[2:])
'''


@pytest.fixture(scope='module')
def vit_runs(tiny_imagenet, tmp_path_factory):
    """A: 2 x gloo, two epochs uninterrupted, --save-every 4. B: A's folder as it was right after the
    step-12 checkpoint (2 of 10 into epoch 2), as if preempted there, then resumed from the checkpoint
    alone (every flag from the run) on another world size: one process, in this one."""
    tmp = tmp_path_factory.mktemp('vit_runs')
    # warmup 6: logged steps (every 5) fall inside it; mixup: the resumed run re-seeds its RNG
    common = ['--data', tiny_imagenet] + TINY_VIT + SCHEDULE + ['--warmup-steps', 6, '--mixup', 0.2, '--workers', 0]
    (tmp / 'copy_at_12.py').write_text(COPY_AT_STEP_12)
    a = run([tmp / 'B'] + common + ['--out', tmp / 'A', '--save-every', 4], nproc=2, script=tmp / 'copy_at_12.py')
    mid = load(tmp / 'B' / 'last.pt')
    with contextlib.redirect_stdout(io.StringIO()) as resumed:
        main(['--resume', tmp / 'B' / 'last.pt', '--workers', 0])
    return dict(A=tmp / 'A', B=tmp / 'B', mid=mid, resumed=resumed.getvalue(), log=a.stdout)


def test_ddp_vit_trains_two_epochs_with_closed_form_lr(vit_runs):
    A = vit_runs['A']
    evals = rows(A, 'eval')
    assert [r['epoch'] for r in evals] == [1, 2] and all(r['n'] == 33 for r in evals)
    ckpt = load(A / 'last.pt')
    assert (ckpt['epoch'], ckpt['step'], len(ckpt['history'])) == (2, 20, 6)
    assert not any(k.startswith(('module.', '_orig_mod.')) for k in ckpt['model'])
    # SAM-paper schedule: linear warmup over 6 steps, then linear decay to 0 at step 20; the row of
    # step s logs the LR step s used; epochs count from 1.
    train = rows(A, 'train')
    assert [(r['epoch'], r['step']) for r in train] == [(1, 5), (1, 10), (2, 15), (2, 20)]
    for r in train:
        s = r['step'] - 1
        assert r['lr'] == pytest.approx(0.01 * ((s + 1) / 6 if s < 6 else (20 - s) / (20 - 6)), rel=1e-9)
        assert math.isfinite(r['loss']) and r['img_per_s'] > 0 and r.keys() == TRAIN_KEYS
    assert all(r.keys() == EVAL_KEYS for r in evals)
    assert ckpt['history'] == rows(A)
    args = json.loads((A / 'args.json').read_text())
    assert (args['world_size'], args['micro_batch'], args['steps_per_epoch']) == (2, 10, 10)
    assert args['norm'] == 'jax' and args['recipe'] == 'sam'
    lines = vit_runs['log'].splitlines()
    assert re.fullmatch(r'ep 1/2 step 5/10 \| loss \d\.\d{4} \| lr 8\.33e-03 \| [\d,]+ img/s \| eta \d+:\d\d', lines[2])
    assert re.fullmatch(r'ep 2/2 \| train loss \d\.\d{4} \| test loss \d\.\d{4} acc \d+\.\d\d% top-5 \d+\.\d\d% \| '
                        r'\d+\.\d s \| eta 0:00', lines[-2])
    assert lines[-1].startswith(f'done | vit_ti16 on imagenet | epoch 2/2 | test acc {evals[-1]["top1"]:.2f}% (best ')
    assert lines[-1].endswith(f' wall | {A / "last.pt"}')


def test_ddp_resume_mid_epoch_on_one_process_continues_the_run(vit_runs):
    """Bit-identical up to the checkpoint; then the same steps, rows and schedule, each row once."""
    mid = vit_runs['mid']
    assert (mid['epoch'], mid['step']) == (1, 12)  # the --save-every checkpoint, mid-epoch
    assert 'at epoch 2, step 12 (2 of 10 in this epoch)' in vit_runs['resumed']
    a, b = rows(vit_runs['A']), rows(vit_runs['B'])
    assert [(r['kind'], r['epoch'], r['step'], r.get('lr')) for r in a] == \
           [(r['kind'], r['epoch'], r['step'], r.get('lr')) for r in b]
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}
    assert [strip(r) for r in a[:3]] == [strip(r) for r in b[:3]]  # before the checkpoint: the same run
    assert b[-1]['n'] == 33 and math.isfinite(b[-1]['loss'])
    final = load(vit_runs['B'] / 'last.pt')
    assert (final['epoch'], final['step']) == (2, 20)


def test_eval_only_on_3_ranks_takes_everything_from_our_checkpoint_and_is_exact(vit_runs, tiny_imagenet):
    """Distributed evaluation (rank r takes images r, r+3, ...) = single-process evaluation = an
    independent evaluation written here = the accuracy the training run logged; 33 images counted once.
    Neither the model flags nor a batch size that divides by 3 are needed (the recipe's is 4096)."""
    final = rows(vit_runs['A'], 'eval')[-1]
    ckpt = vit_runs['A'] / 'last.pt'
    p = run(['--eval-only', '--workers', 0, '--eval-batch-size', 8, '--checkpoint', ckpt], nproc=3)
    dist_res = json.loads(p.stdout.strip().splitlines()[-1])
    single = eval_in_process(['--checkpoint', ckpt])
    model = ti.build_model('vit_ti16', 10, IMG, dict(depth=2, dim=64, heads=2))
    model.load_state_dict(load(ckpt)['model'])
    oracle = oracle_counts(model, tiny_imagenet / 'val', (0.5,) * 3, (0.5,) * 3)
    for res in (dist_res, single):
        assert counts(res) == oracle == counts(final)
        assert res['loss'] == pytest.approx(final['loss'], rel=1e-5)


def test_ddp_convmixer_recipe_sam_accumulation_batchnorm_eval_matches_its_checkpoint(tiny_imagenet, tmp_path):
    """Tiny ConvMixer (BatchNorm), 2 x gloo, ConvMixer recipe (RandAugment, mixup/cutmix, erasing, smoothing,
    one-cycle) with SAM and 2 accumulation steps, loader workers. Each rank's BatchNorm statistics drift apart
    in training (no broadcast inside a step: DDP's default broadcast them in forwards, every step); the epoch's
    distributed evaluation must still be that of the saved (rank-0) weights and statistics (utils.sync_buffers): a
    single-process --eval-only of last.pt (model flags from it) gives the logged numbers."""
    out = tmp_path / 'convmixer'
    tiny = ['--model', 'convmixer_256_8', '--model-kw', 'dim=32', 'depth=2', 'patch_size=8', '--img-size', IMG]
    run([tmp_path / 'casts', REPO / 'train_imagenet.py', '--data', tiny_imagenet, '--recipe', 'convmixer', '--sam',
         '--accum-steps', 2, '--workers', 1, '--out', out] + tiny + SCHEDULE, nproc=2,
        script=REPO / 'tests' / 'ddp_broadcasts.py')  # (the profiler counts the broadcasts)
    for rank in (0, 1):  # 20 steps x 2 micro-batches x 2 SAM passes
        casts = json.loads((tmp_path / f'casts.{rank}.json').read_text())
        assert casts['forwards'] == 80 and casts['in_forward'] <= 2, casts  # (tests/ddp_broadcasts.py)
    evals = rows(out, 'eval')
    assert [r['epoch'] for r in evals] == [1, 2] and all(r['n'] == 33 for r in evals)
    args = json.loads((out / 'args.json').read_text())
    assert (args['micro_batch'], args['sched'], args['norm'], args['label_smoothing']) == \
           (5, 'onecycle', 'imagenet', 0.1)
    train = rows(out, 'train')
    assert len(train) == 4
    for r in train:  # locuslab's integer breakpoints at 2 epochs: 2*2//5 = 0, 2*4//5 = 1; t = (s + 1) / 10
        assert r['lr'] == pytest.approx(0.01 * np.interp(r['step'] / 10, [0, 0, 1, 2], [0, 1, 0.05, 0]), rel=1e-9)
        assert math.isfinite(r['loss'])
    single = eval_in_process(['--checkpoint', out / 'last.pt'])  # the model flags come from that run
    assert counts(single) == counts(evals[-1])
    # the 2 ranks' loss sums meet in another order than one process's (fp32: ~1e-7 relative, CPU-dependent)
    assert single['loss'] == pytest.approx(evals[-1]['loss'], rel=1e-5)


# -----------------------------------------------------------------------------------------------
# 2. Resume: data order, Ctrl-C, a kill during a save, the GradScaler.
def test_mid_epoch_resume_keeps_the_data_order_and_ctrl_c_says_how_to_resume(tiny_imagenet, tmp_path, monkeypatch,
                                                                             capsys):
    """The images each step loads, recorded: a run interrupted (Ctrl-C) in step 13, with a checkpoint
    at step 12, then resumed, loads exactly the uninterrupted run's images in its order."""
    seen, real_getitem, real_step = [], ti.ImageFolder.__getitem__, ti.train_step

    def getitem(self, index):
        if self.root.endswith('train'):
            seen.append(index[0])  # (index, the seed of its augmentation)
        return real_getitem(self, index)
    monkeypatch.setattr(ti.ImageFolder, '__getitem__', getitem)
    argv = ['--data', tiny_imagenet] + TINY_VIT + SCHEDULE + ['--workers', 0, '--save-every', 4]
    main(argv + ['--out', tmp_path / 'full'])
    full = list(seen)
    assert sorted(full[:200]) == sorted(full[200:]) == list(range(200)) and full[:200] != full[200:]

    def interrupted_step(*a, **k):
        interrupted_step.calls += 1
        if interrupted_step.calls == 13:
            raise KeyboardInterrupt
        return real_step(*a, **k)
    interrupted_step.calls = 0
    monkeypatch.setattr(ti, 'train_step', interrupted_step)
    seen.clear()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv + ['--out', tmp_path / 'cut'])
    assert e.value.code == 130
    last = tmp_path / 'cut' / 'last.pt'
    assert capsys.readouterr().err == f'train_imagenet.py: interrupted in epoch 2; the last checkpoint is {last} ' \
                                      f'(step 12); continue with --resume {last}\n'
    cut = list(seen)
    monkeypatch.setattr(ti, 'train_step', real_step)
    seen.clear()
    main(['--resume', last, '--workers', 0])
    assert cut[:12 * 20] + seen == full


KILLER = '''
import os, runpy, signal, sys
real_fsync, calls = os.fsync, []
def fsync(fd):  # runs.save_atomic writes PATH.tmp, then fsyncs it: kill it there, half written
    path = os.readlink(f'/proc/self/fd/{fd}')
    if path.endswith('last.pt.tmp'):
        calls.append(path)
        if len(calls) == 2:  # the end-of-epoch-2 checkpoint: half of it written, then SIGKILL
            os.truncate(path, os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(fd)
os.fsync = fsync
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def test_kill_during_a_save_then_resume_equals_the_uninterrupted_fp16_run(tiny_imagenet, tmp_path):
    """SIGKILL while last.pt.tmp is half written; --resume continues from the previous last.pt, and
    because the RNGs are re-seeded per epoch and the GradScaler state is restored, the run ends
    bit-identical to one never interrupted (fp16 autocast with an enabled GradScaler on CPU)."""
    argv = ['--data', tiny_imagenet] + TINY_VIT + SCHEDULE + ['--workers', 0, '--amp', 'fp16', '--warmup-steps', 2]
    main(argv + ['--out', tmp_path / 'full'])
    (tmp_path / 'killer.py').write_text(KILLER)
    p = run([REPO / 'train_imagenet.py'] + argv + ['--out', tmp_path / 'cut'], expect_ok=False,
            script=tmp_path / 'killer.py')
    assert p.returncode == -9, p.stderr
    assert (tmp_path / 'cut' / 'last.pt.tmp').exists() and load(tmp_path / 'cut' / 'last.pt')['step'] == 10
    main(['--resume', tmp_path / 'cut' / 'last.pt', '--workers', 0])
    full, cut = load(tmp_path / 'full' / 'last.pt'), load(tmp_path / 'cut' / 'last.pt')
    assert full['scaler'] == cut['scaler'] and full['scaler']['_growth_tracker'] > 0
    for key, value in full['model'].items():
        assert torch.equal(value, cut['model'][key]), key
    # the same rows, once each; the evaluation's fp16 loss may differ in the 7th digit between processes
    strip = lambda h: [{k: v if k != 'loss' or r['kind'] == 'train' else round(v, 5) for k, v in r.items()
                        if k not in TIMING} for r in h]
    assert strip(rows(tmp_path / 'full')) == strip(rows(tmp_path / 'cut')) == strip(cut['history'])
    assert sorted(os.listdir(tmp_path / 'cut')) == ['.lock', 'args.json', 'last.pt', 'metrics.jsonl']  # no .tmp


def test_resume_with_sam_of_a_run_without_it_says_so_and_takes_the_machine_flags_from_its_command_line(
        vit_runs, tmp_path, capsys):
    """A changed --sam is named. Issue 37: --workers, --decode, --max-micro-batch describe the machine
    (runs.MACHINE_FLAGS): the resume takes them from its command line (given, or this node's default), not from the
    run, stored here as an 8-core GPU node's (7 workers, decoding on the GPU, 4096 images a micro-batch), and says
    so. Oracle: the flag given, the defaults on this CPU (decode cpu, micro-batches of at most 256)."""
    shutil.copytree(vit_runs['A'], tmp_path / 'run')
    ckpt = load(tmp_path / 'run' / 'last.pt')
    ckpt['args'].update(workers=7, decode='gpu', max_micro_batch=4096)
    torch.save(ckpt, tmp_path / 'run' / 'last.pt')
    main(['--resume', tmp_path / 'run' / 'last.pt', '--sam', '--epochs', 3, '--workers', 0])
    out = capsys.readouterr().out
    assert 'at epoch 3, step 20 (0 of 10 in this epoch); changed: --sam False -> True, --epochs 2 -> 3\n' in out
    line = next(line for line in out.splitlines() if line.startswith('machine flags from this command line, not '))
    for took in ('--workers 0 (the run: 7)', '--decode cpu (the run: gpu)', '--max-micro-batch 256 (the run: 4096)'):
        assert took in line, line
    args = load(tmp_path / 'run' / 'last.pt')['args']
    assert (args['workers'], args['decode'], args['max_micro_batch']) == (0, 'cpu', 256)
    assert args['sam'] is True and rows(tmp_path / 'run')[-1]['epoch'] == 3


# -----------------------------------------------------------------------------------------------
# 3. The sampler, accumulation and the SAM step.
@pytest.mark.parametrize('n,batch', [(10, 6), (1000, 24), (97, 12)])
def test_sampler_steps_and_order_do_not_depend_on_world_size(n, batch):
    """Every world size W takes N // batch steps of one global permutation (no padded repeats): step s
    covers the same `batch` distinct images whatever W, and a resume at step s on another world size
    continues with the rest of the epoch (nothing twice, nothing skipped)."""
    def steps_of(world, start=0):
        per_rank = []
        for r in range(world):
            sampler = ti.ResumableSampler(n, world, r, seed=0, per_step=batch // world)
            sampler.set_epoch(3)
            sampler.start = start
            per_rank.append([i for i, _ in sampler])  # (index, the seed of its augmentation)
            assert len(per_rank[-1]) == len(sampler) == (n // batch - start) * (batch // world)
        b = batch // world
        return [sorted(i for p in per_rank for i in p[s * b:(s + 1) * b]) for s in range(n // batch - start)]
    worlds = [w for w in (1, 2, 3, 4, 6, 8) if batch % w == 0]
    one = steps_of(1)
    assert all(len(set(s)) == batch for s in one) and len({i for s in one for i in s}) == (n // batch) * batch
    for w in worlds:
        assert steps_of(w) == one
        for other in worlds:
            start = n // batch // 2
            assert one[:start] + steps_of(other, start) == one


def tiny_layernorm_model():
    torch.manual_seed(0)
    model = ti.build_model('vit_ti16', 10, 32, dict(depth=2, dim=32, heads=2, patch_size=8))
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the zero-init head would leave the body still
    return model


def fixed_batches(steps=3, size=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g))
            for _ in range(steps)]


def three_steps(model, sam, micro_batches):
    """Three optimizer steps of the script's train_step on fixed data; returns the flat weights.

    SGD base: its update is linear in the gradient, so a missing 1/k or a per-micro-batch
    perturbation shows (Adam's first steps are nearly sign(g) and would hide both)."""
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.5) if sam else \
        torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler('cpu', enabled=False)
    losses, k = [], 16 // micro_batches
    for x, y in fixed_batches():
        x = x.to(next(model.parameters()).dtype)
        loss = ti.train_step(model, opt, scaler, [(x[i:i + k], y[i:i + k]) for i in range(0, 16, k)],
                             sam=sam, clip_grad=0)
        losses.append(loss)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), torch.stack(losses)


@pytest.mark.parametrize('sam', [False, True], ids=['plain', 'sam'])
def test_accumulation_2x8_equals_one_batch_of_16(sam):
    """In float64: 2 micro-batches sum in another order than one batch of 16, which fp32 rounds apart by a
    CPU-dependent ~1e-7; in float64 the rounding is ~1e-16, and a missing 1/k or a per-micro-batch eps-hat
    moves the weights by > 1e-3 (the control below)."""
    w16, loss16 = three_steps(tiny_layernorm_model().double(), sam, micro_batches=1)
    w8x2, loss8x2 = three_steps(tiny_layernorm_model().double(), sam, micro_batches=2)
    assert w16.dtype == loss16.dtype == torch.float64
    torch.testing.assert_close(w8x2, w16, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss8x2, loss16, rtol=0, atol=1e-12)
    w0 = torch.cat([p.detach().flatten() for p in tiny_layernorm_model().parameters()])
    assert (w16 - w0).abs().max() > 1e-2  # the steps moved the weights


def test_sam_step_differs_from_plain_step():
    """Control for the test above: with rho = 0.5 the SAM steps differ from plain SGD, so the SAM
    case compares something SAM-specific."""
    w_plain, _ = three_steps(tiny_layernorm_model(), False, micro_batches=2)
    w_sam, _ = three_steps(tiny_layernorm_model(), True, micro_batches=2)
    assert (w_plain - w_sam).abs().max() > 1e-3


def test_m_sharpness_in_train_step_is_per_group_sam_by_hand():
    """--sam-m 4 on 16 images in 2 micro-batches of 8: four groups, each perturbed by rho g_j / ||g_j|| from its own
    gradient, the four g_SAM averaged, one SGD step; computed here with torch.autograd.grad in float64."""
    torch.manual_seed(0)
    model = tiny_layernorm_model().double()
    (x, y), = fixed_batches(steps=1)
    x, rho, lr = x.double(), 0.5, 0.5
    w = [p.detach().clone().requires_grad_() for p in model.parameters()]
    g_sam = [torch.zeros_like(p) for p in w]
    for j in range(4):  # the oracle: Foret et al. Sec. 4.1, group by group
        xj, yj = x[4 * j:4 * j + 4], y[4 * j:4 * j + 4]
        g = torch.autograd.grad(F.cross_entropy(torch.func.functional_call(model, dict(zip(
            [n for n, _ in model.named_parameters()], w)), (xj,)), yj), w)
        norm = torch.sqrt(sum((gi ** 2).sum() for gi in g))
        moved = [(wi + rho * gi / norm).detach() for wi, gi in zip(w, g)]
        gs = torch.autograd.grad(F.cross_entropy(torch.func.functional_call(model, dict(zip(
            [n for n, _ in model.named_parameters()], [m.requires_grad_() for m in moved])), (xj,)), yj), moved)
        g_sam = [a + b / 4 for a, b in zip(g_sam, gs)]
    want = torch.cat([(wi - lr * gi).detach().flatten() for wi, gi in zip(w, g_sam)])
    opt = SAM(model.parameters(), torch.optim.SGD, rho=rho, lr=lr)
    ti.train_step(model, opt, torch.amp.GradScaler('cpu', enabled=False), [(x[:8], y[:8]), (x[8:], y[8:])],
                  sam=True, clip_grad=0, sam_m=4)
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64 throughout (fp16/bf16 logits alone go fp32)
    whole = tiny_layernorm_model().double()  # control: eps-hat from all 16 images moves elsewhere
    ti.train_step(whole, SAM(whole.parameters(), torch.optim.SGD, rho=rho, lr=lr),
                  torch.amp.GradScaler('cpu', enabled=False), [(x[:8], y[:8]), (x[8:], y[8:])], sam=True, clip_grad=0)
    assert (torch.cat([p.detach().flatten() for p in whole.parameters()]) - want).abs().max() > 1e-4


SAM_RANKS = '''
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import train_imagenet as ti, test_train_imagenet as t
from sam import SAM
dist.init_process_group('gloo')
rank, model = dist.get_rank(), t.tiny_layernorm_model().double()  # float64: see the test
opt, ddp = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.5), DDP(model)
for x, y in t.fixed_batches():  # rank r: images 8r ... 8r + 7, as 2 micro-batches of 4
    x, y = x[8 * rank:8 * rank + 8].double(), y[8 * rank:8 * rank + 8]
    ti.train_step(ddp, opt, torch.amp.GradScaler('cpu', enabled=False), [(x[:4], y[:4]), (x[4:], y[4:])],
                  sam=True, clip_grad=0)
if rank == 0:
    torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), sys.argv[1])
dist.barrier()  # leave together: gloo aborts a rank whose peer tore down first ("terminate called ...")
dist.destroy_process_group()
'''


def sam_simulation(per_replica_eps):
    """SGD-SAM over 2 simulated replicas, written out with torch.func: eps-hat from each replica's own
    shard (m-sharpness, the official code) or from the all-reduced gradient; g_SAM averaged. In float64."""
    model = tiny_layernorm_model().double()
    w = {n: p.detach() for n, p in model.named_parameters()}

    def grad(w, x, y):
        w = {n: v.requires_grad_() for n, v in w.items()}
        loss = F.cross_entropy(torch.func.functional_call(model, w, (x,)), y)
        return dict(zip(w, torch.autograd.grad(loss, list(w.values()))))
    for x, y in fixed_batches():
        shards = [(x[8 * r:8 * r + 8].double(), y[8 * r:8 * r + 8]) for r in (0, 1)]
        gs = [grad({n: v.detach().clone() for n, v in w.items()}, *s) for s in shards]
        if not per_replica_eps:
            gs = [{n: (gs[0][n] + gs[1][n]) / 2 for n in w}] * 2
        g_sam = []
        for g, shard in zip(gs, shards):
            norm = torch.sqrt(sum((v ** 2).sum() for v in g.values()))
            g_sam.append(grad({n: (w[n] + 0.5 * g[n] / (norm + 1e-12)).detach() for n in w}, *shard))
        w = {n: (w[n] - 0.5 * (g_sam[0][n] + g_sam[1][n]) / 2).detach() for n in w}
    return torch.cat([v.flatten() for v in w.values()])


def test_ddp_sam_each_replica_perturbs_with_its_own_gradient(tmp_path):
    """2 gloo processes run train_step (SAM, 2 micro-batches each); the weights must be those of the
    simulation in which each replica's eps-hat comes from its own shard, not from the averaged gradient.
    Both in float64: in fp32 the 2 processes' gloo sums and micro-batch accumulation round differently from the
    simulation's one backward, by ~1e-6 after 3 steps on one CPU and more on another (vector width, threads),
    while the two readings of SAM differ by > 1e-3. In float64 that rounding is ~1e-15 relative, so 1e-10 is
    eight orders of magnitude from the difference under test and far above the noise of any CPU."""
    (tmp_path / 'sam_ranks.py').write_text(SAM_RANKS)
    p = run([tmp_path / 'w.pt'], nproc=2, script=tmp_path / 'sam_ranks.py', expect_ok=False)
    assert p.returncode == 0, p.stderr
    w = load(tmp_path / 'w.pt')
    own, averaged = sam_simulation(per_replica_eps=True), sam_simulation(per_replica_eps=False)
    assert w.dtype == torch.float64 and (own - averaged).abs().max() > 1e-3  # the two readings differ here
    torch.testing.assert_close(w, own, rtol=0, atol=1e-10)


# -----------------------------------------------------------------------------------------------
# 4. --eval-only on foreign checkpoints, against the foreign model itself; load_weights(finetune=True).
def test_eval_only_timm_vit_state_dict(tiny_imagenet, tmp_path):
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    timm_model = VisionTransformer(img_size=IMG, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=10)
    with torch.no_grad():
        for p in timm_model.parameters():
            p.add_(0.2 * torch.randn_like(p))  # away from init: predictions that depend on every weight
    torch.save({'state_dict': {'module.' + k: v for k, v in timm_model.state_dict().items()}}, tmp_path / 'timm.pth')
    res = eval_in_process(['--data', tiny_imagenet, '--checkpoint', tmp_path / 'timm.pth', '--norm', 'jax'] + TINY_VIT)
    assert counts(res) == oracle_counts(timm_model, tiny_imagenet / 'val', (0.5,) * 3, (0.5,) * 3)


def test_eval_only_official_jax_npz_vit_and_mixer(tiny_imagenet, tmp_path):
    """.npz files in the official layouts, written by the loader tests' writers; oracles: timm's ViT
    with the source weights, and timm's Mixer given the same arrays (32 px, 8 px patches, as there)."""
    import test_checkpoints as tc
    jax = ['--data', tiny_imagenet, '--norm', 'jax', '--img-size', tc.IMG]
    vit_source = tc.randomise(tc.timm_vit())
    np.savez(tmp_path / 'ViT.npz', **tc.vit_npz_arrays(vit_source.state_dict()))
    res = eval_in_process(jax + ['--checkpoint', tmp_path / 'ViT.npz', '--model', 'vit_ti16', '--model-kw',
                                 f'depth={tc.DEPTH}', f'dim={tc.DIM}', f'heads={tc.HEADS}', f'patch_size={tc.PATCH}'])
    assert counts(res) == oracle_counts(vit_source, tiny_imagenet / 'val', (0.5,) * 3, (0.5,) * 3, img=tc.IMG)
    arrays = tc.mixer_npz_arrays()
    np.savez(tmp_path / 'Mixer.npz', **arrays)
    res = eval_in_process(jax + ['--checkpoint', tmp_path / 'Mixer.npz', '--model', 'mixer_s16', '--model-kw',
                                 f'depth={tc.DEPTH}', f'dim={tc.DIM}', f'patch_size={tc.PATCH}',
                                 f'tokens_mlp_dim={tc.DIM // 2}', f'channels_mlp_dim={4 * tc.DIM}'])
    assert counts(res) == oracle_counts(tc.timm_mixer_from_arrays(arrays), tiny_imagenet / 'val', (0.5,) * 3,
                                        (0.5,) * 3, img=tc.IMG)


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
    assert counts(res) == oracle_counts(resnet, tiny_imagenet / 'val', mean, std, img=32)


def test_pretrained_vit_at_32px_fine_tunes_at_48px_with_the_vit_paper_recipe(tiny_imagenet, tmp_path, monkeypatch):
    """--pretrained + --recipe finetune at a higher resolution (ViT paper Sec. 3.2, App. B.1.1). Oracles:
    timm's resample_abs_pos_embed and vit.resample_pos_embed for the position embedding, the source
    weights for the body, the model's own zero head (the 1000-class head cannot fit 10 classes), the
    closed-form warmup + cosine schedule, and the paper's SGD (momentum 0.9, no weight decay)."""
    from timm.layers import resample_abs_pos_embed
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    source = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=1000)
    torch.nn.init.normal_(source.pos_embed)
    torch.nn.init.normal_(source.head.weight)
    torch.save({'state_dict': source.state_dict()}, tmp_path / 'in1k.pth')  # timm's train-checkpoint layout
    loaded, real_step = [], ti.train_step

    def first_step(model, *a, **k):  # the weights as loaded, before the first optimizer step changes them
        if not loaded:
            loaded.append({n: v.detach().clone() for n, v in model.state_dict().items()})
        return real_step(model, *a, **k)
    monkeypatch.setattr(ti, 'train_step', first_step)
    out = tmp_path / 'ft'
    main(['--data', tiny_imagenet, '--recipe', 'finetune', '--pretrained', tmp_path / 'in1k.pth', '--model', 'vit_ti16',
          '--model-kw', 'depth=2', 'dim=64', 'heads=2', 'patch_size=8', '--img-size', 48, '--batch-size', 20,
          '--lr', 0.01, '--warmup-steps', 2, '--epochs', 1, '--log-every', 1, '--workers', 0,
          '--eval-batch-size', 8, '--out', out])
    w = loaded[0]
    expected = resample_abs_pos_embed(source.pos_embed.detach(), (6, 6), num_prefix_tokens=1)
    torch.testing.assert_close(w['pos_embed'], expected)
    assert torch.equal(w['pos_embed'], vit.resample_pos_embed(source.pos_embed.detach(), (6, 6), 1))
    assert torch.equal(w['blocks.1.mlp.fc2.weight'], source.blocks[1].mlp.fc2.weight)
    assert not w['head.weight'].any() and w['head.weight'].shape == (10, 64)  # re-initialised (zero, as built)
    train = rows(out, 'train')
    for r in train:  # 10 steps: linear warmup over 2, then cosine to 0 (vit_jax's schedule)
        s = r['step'] - 1
        t = (s - 2) / 8
        assert r['lr'] == pytest.approx(0.01 * ((s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * t))), rel=1e-9)
        assert math.isfinite(r['loss'])
    assert len(train) == 10 and rows(out, 'eval')[0]['n'] == 33
    group = load(out / 'last.pt')['optimizer']['param_groups'][0]
    assert (group['momentum'], group['weight_decay'], group['nesterov']) == (0.9, 0.0, False)
    args = json.loads((out / 'args.json').read_text())
    assert (args['clip_grad'], args['crop_min'], args['norm'], args['sched']) == (1.0, 0.05, 'jax', 'cosine')


def test_pretrained_mixer_of_another_token_count_is_a_clear_error(tmp_path):
    source = ti.build_model('mixer_s16', 10, 32, dict(depth=1, dim=16, tokens_mlp_dim=8, channels_mlp_dim=16))
    torch.save(source.state_dict(), tmp_path / 'mixer32.pth')
    model = ti.build_model('mixer_s16', 10, 64, dict(depth=1, dim=16, tokens_mlp_dim=8, channels_mlp_dim=16))
    with pytest.raises(ti.UserError, match=r"is a Mixer of 4 tokens, this one has 16: its token-mixing MLP is tied"):
        ti.load_weights(model, str(tmp_path / 'mixer32.pth'), finetune=True)


def test_synthetic_trains_a_sam_vit_without_data(tmp_path):
    """--synthetic: random images of the model's size and 1000 classes (the GPU throughput check runs
    `--synthetic --model vit_b16 --sam`); the step count is ImageNet-1k's."""
    out = tmp_path / 'synthetic'
    main(['--synthetic', '--model', 'vit_ti16', '--model-kw', 'depth=1', 'dim=32', 'heads=2', '--img-size', 32,
          '--sam', '--batch-size', 8, '--max-steps', 2, '--log-every', 1, '--workers', 0, '--save-every', 2,
          '--out', out])
    train = rows(out, 'train')
    assert [r['step'] for r in train] == [1, 2] and all(r['img_per_s'] > 0 and math.isfinite(r['loss']) for r in train)
    assert train[0]['loss'] == pytest.approx(math.log(1000), rel=1e-3)  # zero head: uniform over 1000 classes
    ckpt = load(out / 'last.pt')
    assert ckpt['steps_per_epoch'] == 1_281_167 // 8 and ckpt['model']['head.weight'].shape == (1000, 32)


def test_synthetic_serves_the_models_layout(tmp_path, monkeypatch):
    """--synthetic with a channels_last ConvMixer (the default on a GPU): the one batch is made in that layout once;
    it was NCHW, so every step converted it (issue 45). The model's input, read by a hook, is NHWC."""
    seen, build = [], ti.build_model

    def hooked(*a, **k):
        model = build(*a, **k)
        model.register_forward_pre_hook(lambda m, x: seen.append(x[0].is_contiguous(memory_format=torch.channels_last)))
        return model
    monkeypatch.setattr(ti, 'build_model', hooked)
    main(['--synthetic', '--model', 'convmixer_768_32', '--model-kw', 'dim=8', 'depth=1', 'patch_size=4',
          '--img-size', 16, '--batch-size', 4, '--max-steps', 2, '--log-every', 0, '--workers', 0, '--channels-last',
          '--out', tmp_path / 'syn'])
    assert seen == [True, True]


def test_convmixer_recipe_randaugment_is_timms_m9_on_both_scripts_scale():
    """timm's rand-m9 scales each op's maximum by m / 10 = 0.9. --randaug-m is torchvision's bin of 0..30 (as in
    train_cifar.py), so the recipe's default must land on the same 0.9, and the op gets the recipe's n."""
    args = ti.get_args(['--synthetic', '--recipe', 'convmixer'])
    ra = [t for t in ti.train_transform(args, ti.MEANS[args.norm][0]).transforms if type(t).__name__ == 'RandAugment']
    assert len(ra) == 1 and ra[0].num_ops == 2 == args.randaug_n
    assert torch.linspace(0.0, 1.0, ra[0].num_magnitude_bins)[ra[0].magnitude].item() == pytest.approx(9 / 10)


def test_each_rank_draws_its_own_augmentation_and_a_resume_draws_the_same():
    def draws(epoch, rank, start=0):  # mixup, erasing, dropout: this process's RNG
        ti.seed_epoch(0, epoch, rank, start)
        return torch.rand(8)
    assert torch.equal(draws(3, 1), draws(3, 1))
    for other in (draws(3, 0), draws(4, 1), draws(3, 1, start=5)):
        assert not torch.isclose(draws(3, 1), other).any()

    def seeds(world, epoch):  # each image's crop/flip/RandAugment seed, gathered over the ranks
        out = {}
        for r in range(world):
            sampler = ti.ResumableSampler(96, world, r, seed=0, per_step=12 // world)
            sampler.set_epoch(epoch)
            out.update(sampler)
        return out
    assert seeds(1, 3) == seeds(2, 3) == seeds(3, 3)  # the same image, the same draws, whatever the world size
    assert len(set(seeds(1, 3).values())) == 96 and not set(seeds(1, 3).values()) & set(seeds(1, 4).values())


def test_an_images_augmentation_comes_from_its_own_seed_whatever_the_worker(tiny_imagenet):
    """(index, seed) -> the same uint8 image in the main process and in 2 loader workers, with any batch size;
    another seed draws another crop; the caller's RNG is left as it was."""
    args = ti.get_args(['--data', str(tiny_imagenet), '--img-size', '32', '--recipe', 'convmixer'])
    ds = ti.ImageFolder(tiny_imagenet, 'train', ti.train_transform(args, ti.MEANS['imagenet'][0]), 32)
    items = [(i, 1000 + i) for i in range(0, 60, 5)]
    state = torch.get_rng_state()
    alone = torch.stack([ds[it][0] for it in items])
    assert torch.equal(torch.get_rng_state(), state) and alone.dtype == torch.uint8
    loader = torch.utils.data.DataLoader(ds, batch_size=5, sampler=items, num_workers=2)
    assert torch.equal(torch.cat([x for x, _ in loader]), alone)
    assert not torch.equal(torch.stack([ds[(i, s + 1)][0] for i, s in items]), alone)


# -----------------------------------------------------------------------------------------------
# 5. Bad input and faults: one clear line on stderr, a non-zero exit, no traceback, --out untouched.
@pytest.fixture(scope='module')
def bad_data(tiny_imagenet, tmp_path_factory):
    """Broken copies of the tiny set, one per fault."""
    root = tmp_path_factory.mktemp('bad_data')
    (root / 'unflat' / 'train' / 'n01440764').mkdir(parents=True)  # val not sorted into class folders
    (root / 'unflat' / 'val').mkdir()
    Image.new('RGB', (8, 8)).save(root / 'unflat' / 'train' / 'n01440764' / 'a.JPEG')
    Image.new('RGB', (8, 8)).save(root / 'unflat' / 'val' / 'ILSVRC2012_val_00000001.JPEG')
    for name in ('empty_class', 'renamed', 'corrupt', 'truncated', 'bomb'):
        shutil.copytree(tiny_imagenet, root / name)
    for split in ('train', 'val'):  # one class: a classifier of one output learns nothing (loss 0, accuracy 100%)
        shutil.copytree(tiny_imagenet / split / 'cat', root / 'one_class' / split / 'cat')
    write_bomb_png(root / 'bomb' / 'train' / 'cat' / 'zz_bomb.png')  # 201 training images: 3 batches of 67
    for f in (root / 'empty_class' / 'train' / 'cat').iterdir():
        f.unlink()
    (root / 'renamed' / 'val' / 'airplane').rename(root / 'renamed' / 'val' / 'zz_airplane')
    bad = sorted((root / 'corrupt' / 'train' / 'dog').iterdir())[3]
    bad.write_bytes(b'not a JPEG at all')
    cut = sorted((root / 'truncated' / 'val' / 'ship').iterdir())[1]
    cut.write_bytes(cut.read_bytes()[:len(cut.read_bytes()) // 2])
    with zipfile.ZipFile(root / 'malformed.npz', 'w') as z:  # an .npz whose first array is not an .npy
        z.writestr('embedding/kernel.npy', b'\x93NUMPY garbage')
    torch.save({'head.weight': torch.zeros(10, 4)}, root / 'state_dict.pth')
    # train_cifar.py's last.pt layout (tc.RUN_KEYS): one of our runs, but not of this script
    torch.save({'model': {}, 'optimizer': {}, 'scaler': {}, 'epoch': 1, 'step': 1, 'history': [],
                'args': {'model': 'vit_ti16', 'model_kw': []}}, root / 'cifar_last.pt')
    return root


def read_only_dir(tmp_path):
    path = tmp_path / 'read_only'
    path.mkdir()
    path.chmod(0o555)
    if os.access(path, os.W_OK):  # root: permission bits do not apply; sysfs refuses writes to root too
        path = '/sys/kernel'
        if not os.path.isdir(path):
            pytest.skip('no folder that refuses writes')
    return path


# --log-every 0: rows (and metrics.jsonl writes) at the epoch's end only, so that nothing in --out changes
BASE = ['--data', '{data}'] + TINY_VIT + ['--batch-size', 20, '--epochs', 1, '--workers', 0,
                                          '--eval-batch-size', 8, '--log-every', 0, '--out', '{out}', '--overwrite']
RESUME = ['--resume', '{out}/last.pt', '--workers', 0, '--log-every', 0, '--epochs', 3]
EVAL = ['--eval-only', '--workers', 0, '--eval-batch-size', 8, '--data', '{data}']
BAD_INPUTS = {  # name: (argv, fragments the message must hold)
    'batch-size-0': (BASE + ['--batch-size', 0], ['--batch-size must be a finite number > 0, got 0']),
    'batch-size-negative': (BASE + ['--batch-size', -20], ['--batch-size must be a finite number > 0, got -20']),
    'accum-steps-negative': (BASE + ['--accum-steps', -1], ['--accum-steps must be a finite number >= 0, got -1']),
    'micro-batch-over-cap': (BASE + ['--accum-steps', 1, '--max-micro-batch', 8],
                             ['--accum-steps 1 makes micro-batches of 20 images, more than --max-micro-batch 8']),
    'sam-m-not-dividing': (BASE + ['--sam', '--sam-m', 3], ['--sam-m 3 must divide the micro-batch of 20 images']),
    'sam-m-negative': (BASE + ['--sam', '--sam-m', -2], ['--sam-m must be a finite number >= 0, got -2']),
    'batch-not-divisible': (BASE + ['--accum-steps', 3], ['--batch-size 20 (global) must divide', '--accum-steps (3)']),
    'log-every-negative': (BASE + ['--log-every', -1], ['--log-every must be a finite number >= 0, got -1']),
    'workers-negative': (BASE + ['--workers', -1], ['--workers must be a finite number >= 0, got -1']),
    'lr-negative': (BASE + ['--lr', -0.1, '--batch-size', 40], ['--lr must be a finite number > 0, got -0.1']),
    'epochs-0': (BASE + ['--epochs', 0], ['--epochs must be a finite number > 0, got 0']),
    'randaug-m-31': (BASE + ['--randaug-m', 31], ['--randaug-m must be a finite number >= 0 and <= 30, got 31']),
    'lr-nan': (BASE + ['--lr', 'nan'], ['--lr must be a finite number > 0, got nan']),
    'img-size-30-patch-16': (BASE + ['--img-size', 30], ['--img-size 30', 'patch_size=16']),
    'depth-0': (BASE + ['--model-kw', 'depth=0'], ['--model-kw depth=0', 'depth']),
    'dim-abc': (BASE + ['--model-kw', 'dim=abc'], ['dim=abc', 'dim must be']),
    'heads-not-dividing-dim': (BASE + ['--model-kw', 'dim=64', 'heads=5'], ['heads=5 does not divide dim=64']),
    'unknown-model-kw': (BASE + ['--model-kw', 'foo=1'], ["'foo'"]),
    'num-classes-by-hand': (BASE + ['--model-kw', 'num_classes=5'], ['num_classes=5', 'class count comes from --data']),
    'unknown-model': (BASE + ['--model', 'vit_huge'], ["unknown model 'vit_huge'", 'vit_b16', 'mixer_b16',
                                                       'convmixer_1536_20', 'resnet152']),
    'no-data': ([a for a in BASE if a not in ('--data', '{data}')], ['give --data DIR', 'DIR/train/<wnid>/*.JPEG']),
    'data-missing': (BASE + ['--data', '{bad}/nowhere'], ['{bad}/nowhere/val', 'DIR/train/<wnid>/*.JPEG']),
    'val-not-in-class-folders': (BASE + ['--data', '{bad}/unflat'], ["Couldn't find any class folder", 'valprep.sh']),
    'empty-class-folder': (BASE + ['--data', '{bad}/empty_class'], ['Found no valid file', 'cat']),
    'class-names-differ': (BASE + ['--data', '{bad}/renamed'], ['class folders of train (10) and val (10) differ']),
    'corrupt-image-in-a-worker': (BASE + ['--data', '{bad}/corrupt', '--workers', 1],
                                  ['cannot decode the image {bad}/corrupt/train/dog/']),
    'truncated-image': (EVAL + ['--data', '{bad}/truncated', '--checkpoint', '{out}/last.pt'],
                        ['cannot decode the image {bad}/truncated/val/ship/']),
    'out-holds-a-run': ([a for a in BASE if a != '--overwrite'], [
        '--out {out} already holds a run (last.pt, metrics.jsonl, args.json); use --resume {out}/last.pt, or pick '
        'another --out, or pass --overwrite']),
    'out-is-a-file': (BASE + ['--out', '{out}/args.json'], ['--out {out}/args.json is a file']),
    'out-read-only': (BASE + ['--out', '{read_only}'], ['--out {read_only} is not writable']),
    'disk-full': (RESUME, ['could not write {out}/last.pt: No space left on device; the previous last.pt is intact']),
    'diverged': (RESUME + ['--lr', 1e30], ['training diverged: the loss is not finite from epoch 3, step 2/10 on; '
                                           'nothing was saved after it; the last checkpoint is {out}/last.pt '
                                           '(step 20)']),
    'resume-and-overwrite': (RESUME + ['--overwrite'], ['--resume and --eval-only load their own weights; --overwrite '
                                                       'or --pretrained would start a new run']),
    'resume-and-pretrained': (RESUME + ['--pretrained', '{out}/last.pt'], ['--overwrite or --pretrained would start']),
    'pretrained-missing': (BASE + ['--pretrained', '{out}/nothing.pt'], ['--pretrained: no such file: {out}/nothing.pt']),
    'eval-checkpoint-and-resume': (EVAL + ['--checkpoint', '{out}/last.pt', '--resume', '{out}/last.pt'],
                                   ['--eval-only evaluates --checkpoint PATH (not --resume)']),
    'resume-missing': (RESUME + ['--resume', '{out}/nothing.pt'], ['--resume: no such file: {out}/nothing.pt']),
    'resume-not-ours': (RESUME + ['--resume', '{bad}/state_dict.pth'], ['is not a last.pt of train_imagenet.py']),
    'resume-a-cifar-run': (RESUME + ['--resume', '{bad}/cifar_last.pt'], ['is not a last.pt of train_imagenet.py']),
    # issue 25
    'data-is-a-file': (BASE + ['--data', '{bad}/cifar_last.pt'], ['--data {bad}/cifar_last.pt', 'Not a directory']),
    'eval-a-cifar-run': (EVAL + ['--checkpoint', '{bad}/cifar_last.pt'],
                         ['is a last.pt of train_cifar.py: evaluate it with train_cifar.py --eval-only']),
    'eval-a-cifar-run-with-model': (EVAL + ['--checkpoint', '{bad}/cifar_last.pt'] + TINY_VIT,
                                    ['is a last.pt of train_cifar.py']),
    'rho-without-sam': (BASE + ['--rho', 0.1, '--sam-m', 4], ['--rho, --sam-m only act with --sam']),
    'eval-only-and-pretrained': (EVAL + ['--checkpoint', '{out}/last.pt', '--pretrained', '{out}/last.pt'],
                                 ['--overwrite or --pretrained would start a new run']),
    'resume-other-batch': (RESUME + ['--batch-size', 40],
                           ['--batch-size 20 and 10 steps per epoch, this one 40 and 5']),
    'resume-other-width': (RESUME + ['--model-kw', 'depth=2', 'dim=32', 'heads=2'],  # (issue 42: short, the flags)
                           ['--resume {out}/last.pt does not fit this run: ', 'of another shape (cls_token [1, 1, 64], '
                            'here [1, 1, 32]); its run had --model vit_ti16 --model-kw depth=2 dim=64 heads=2']),
    'eval-without-checkpoint': (EVAL, ['--eval-only evaluates --checkpoint PATH']),
    'checkpoint-without-eval': (BASE + ['--checkpoint', '{out}/last.pt'], ['--checkpoint is for --eval-only']),
    'eval-other-width': (EVAL + ['--checkpoint', '{out}/last.pt', '--model-kw', 'depth=2', 'dim=32', 'heads=2'],
                         ['of another shape (cls_token [1, 1, 64], here [1, 1, 32]); its run had --model vit_ti16 '
                          '--model-kw depth=2 dim=64 heads=2']),
    'eval-head-for-1000-classes': (EVAL + ['--checkpoint', '{bad}/in1k.pth'] + TINY_VIT,
                                   ['does not fit this --model', '2 of another shape (head.weight [1000, 64], here '
                                    '[10, 64])']),
    'eval-malformed-npz': (EVAL + ['--checkpoint', '{bad}/malformed.npz'] + TINY_VIT,
                           ['cannot read {bad}/malformed.npz', "'embedding/kernel'"]),
    # issue 34
    'B30-batchnorm-one-value': (['--data', '{data}', '--model', 'resnet50', '--img-size', 32, '--batch-size', 20,
                                 '--max-micro-batch', 1, '--epochs', 1, '--workers', 0, '--out', '{out}',
                                 '--overwrite'],
                                ['--max-micro-batch 1: forward passes of 1 image(s) give BatchNorm layer layer4.',
                                 'of resnet50 at 32 px', 'one value per channel']),
    'B11-synthetic-eval-only': (['--synthetic', '--eval-only', '--checkpoint', '{out}/last.pt', '--workers', 0],
                                ['--eval-only needs --data DIR: --synthetic has no validation set']),
    'S01-onecycle-one-step': (BASE + ['--batch-size', 200, '--sched', 'onecycle'],  # 200 images: one step in all
                              ["--epochs 1 with 1 step an epoch: --sched onecycle gives the run's only step LR 0 (it "
                               'would train nothing): raise --epochs, lower --batch-size, or pass --sched linear']),
    'H12-bomb': (BASE + ['--data', '{bad}/bomb', '--batch-size', 67], [
        "cannot decode the image {bad}/bomb/train/cat/zz_bomb.png (it has more than 178,956,970 pixels, PIL's "
        'decompression-bomb limit']),
    'H13-bomb-in-a-worker': (BASE + ['--data', '{bad}/bomb', '--batch-size', 67, '--workers', 1],
                             ['cannot decode the image {bad}/bomb/train/cat/zz_bomb.png (it has more than']),
    # issue 42: --decode gpu refuses what --decode cpu refuses, in the same words (its workers read the header)
    'H12-bomb-decode-gpu': (BASE + ['--data', '{bad}/bomb', '--batch-size', 67, '--decode', 'gpu'], [
        "cannot decode the image {bad}/bomb/train/cat/zz_bomb.png (it has more than 178,956,970 pixels, PIL's "
        'decompression-bomb limit']),
    'corrupt-image-decode-gpu': (BASE + ['--data', '{bad}/corrupt', '--workers', 1, '--decode', 'gpu'],
                                 ['cannot decode the image {bad}/corrupt/train/dog/', '(corrupt or truncated)']),
    'one-class': (BASE + ['--data', '{bad}/one_class'],
                  ['--data {bad}/one_class: val holds 1 class folder (cat); a classifier (or a probe) needs 2 or more']),
    'seed-over-64-bits': (BASE + ['--seed', 2 ** 64],
                          ['--seed must be a finite number >= 0 and <= 9223372036854775807']),
}


def cli(argv, capsys):
    """train_imagenet.py as a script (its __main__ block) in this process: (exit status, all output)."""
    sys.argv, old = ['train_imagenet.py'] + [str(a) for a in argv], sys.argv
    try:
        runpy.run_path(str(REPO / 'train_imagenet.py'), run_name='__main__')
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = old
    out = capsys.readouterr()
    if isinstance(code, str):  # sys.exit(message): Python prints the message on stderr, exit status 1
        assert '\n' not in code and code.startswith('train_imagenet.py: error: ')
        return 1, out.out + out.err + code
    return code, out.out + out.err


def snapshot(folder):
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in os.listdir(folder)
            if not f.endswith('.tmp')}


@pytest.mark.parametrize('name', BAD_INPUTS)
def test_bad_input_gives_one_clear_line_and_leaves_out_untouched(name, vit_runs, tiny_imagenet, bad_data, tmp_path,
                                                                  capsys):
    out = tmp_path / 'out'
    shutil.copytree(vit_runs['A'], out)  # a finished run of 2 epochs (20 steps): nothing may change it
    if name == 'disk-full':
        os.symlink('/dev/full', out / 'last.pt.tmp')  # every write to it fails with ENOSPC
    if name == 'eval-head-for-1000-classes':
        from timm.models.vision_transformer import VisionTransformer
        torch.save(VisionTransformer(img_size=IMG, patch_size=16, embed_dim=64, depth=2, num_heads=2,
                                     num_classes=1000).state_dict(), bad_data / 'in1k.pth')
    argv, fragments = BAD_INPUTS[name]
    where = dict(data=tiny_imagenet, out=out, bad=bad_data,
                 read_only=read_only_dir(tmp_path) if name == 'out-read-only' else '')
    before = snapshot(out)
    code, text = cli([str(a).format(**where) for a in argv], capsys)
    assert code != 0 and 'Traceback' not in text, text
    for fragment in fragments:
        assert fragment.format(**where) in text, text
    assert name != 'lr-negative' or '-0.2' not in text  # the value given, not the batch-scaled one
    assert snapshot(out) == before and not (out / 'last.pt.tmp').exists()



def test_the_loader_sends_uint8_micro_batches_and_synthetic_sends_nothing(tiny_imagenet, monkeypatch):
    """The recipe's 4096 images at 224 px as float32 through shared memory were 2.4 GB a step: the workers now send
    uint8 micro-batches (a quarter of the bytes, --max-micro-batch at most), normalised on the device; --synthetic
    serves one batch made on the device instead of decoding PIL images."""
    import utils
    monkeypatch.delenv('WORLD_SIZE', raising=False)
    proc = utils.setup('off')
    args = ti.get_args([str(a) for a in ['--data', tiny_imagenet, *TINY_VIT, '--batch-size', 40, '--workers', 0,
                                         '--max-micro-batch', 8]])
    per_step, k, m = ti.split_batch(args, 1)
    assert (per_step, k) == (40, 5)  # the fewest micro-batches of at most 8 images
    val_loader, _, train_loader, sampler, _ = ti.make_data(args, proc, per_step // k)
    x, y = next(iter(train_loader))
    assert x.dtype == torch.uint8 and x.shape == (8, 3, IMG, IMG) and train_loader.persistent_workers is False
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in ti.MEANS[args.norm])
    xn, _ = next(ti.on_device(train_loader, mean, std))
    assert xn.dtype == torch.float32 and xn.abs().max() <= 1.0 + 1e-6  # jax norm: (x - 0.5) / 0.5
    syn = ti.get_args([str(a) for a in ['--synthetic', *TINY_VIT, '--batch-size', 16, '--max-micro-batch', 8,
                                        '--workers', 0]])
    _, _, batches, _, _ = ti.make_data(syn, proc, 8)
    first, second = [b for _, b in zip(range(2), batches)]
    assert first[0] is second[0] and first[0].shape == (8, 3, IMG, IMG)  # one batch, made once


# -----------------------------------------------------------------------------
# issue 34
def test_mixup_and_cutmix_one_of_them_per_batch(monkeypatch):
    """--mixup and --cutmix both on: each batch gets ONE of them, p 0.5 (timm's switch; v2.RandomChoice), never
    both (v2.Compose would cut a box out of an already mixed batch). Oracle: torchvision's definitions, read off
    each output: MixUp is lam x + (1 - lam) x.roll(1) for the lam of its soft labels; CutMix takes every pixel
    from the image or its partner, (1 - lam) of them from the partner."""
    import utils
    monkeypatch.delenv('WORLD_SIZE', raising=False)
    args = ti.get_args([str(a) for a in ['--synthetic', *TINY_VIT, '--batch-size', 8, '--workers', 0, '--mixup', 0.8,
                                         '--cutmix', 1.0]])
    *_, mix = ti.make_data(args, utils.setup('off'), 8)
    torch.manual_seed(0)
    x, y = torch.rand(8, 3, 16, 16), torch.arange(8)
    partner, kinds = x.roll(1, 0), []
    for _ in range(12):
        out, soft = mix(x, y)
        lam = soft[0, 0].item()  # image 0 (label 0) is mixed with image 7 (label 7): soft[0] = lam, 1 - lam
        assert soft[0, 7].item() == pytest.approx(1 - lam, abs=1e-6)
        if torch.allclose(out, lam * x + (1 - lam) * partner, rtol=0, atol=1e-6):
            kinds.append('mixup')
            continue
        assert ((out == x) | (out == partner)).all()  # cutmix: a pure box; mixup then cutmix: blended pixels
        assert (out != x).any(1).float().mean((1, 2))[0].item() == pytest.approx(1 - lam, abs=1e-6)
        kinds.append('cutmix')
    assert set(kinds) == {'mixup', 'cutmix'}, kinds


def test_a_resumed_rho_wd_opt_eps_reach_the_optimizer(tiny_imagenet, tmp_path):
    """S12, S12d: `changed: --rho 0.05 -> 0.5, --wd 0.3 -> 0.9` (or --opt-eps) is what the optimizer uses after a
    resume: both groups (decay, no decay) hold the flags given, and the weights differ from a plain resume."""
    first = tmp_path / 'first'
    small = ['--data', tiny_imagenet, '--model', 'vit_ti16', '--model-kw', 'depth=1', 'dim=32', 'heads=2', '--img-size',
             32, '--batch-size', 40, '--warmup-steps', 2, '--workers', 0, '--log-every', 0, '--eval-batch-size', 33]
    with contextlib.redirect_stdout(io.StringIO()):
        main(small + ['--epochs', 1, '--sam', '--out', first])
        final = {}
        for name, flags in {'plain': [], 'rho_wd': ['--rho', 0.5, '--wd', 0.9], 'eps': ['--opt-eps', 0.5]}.items():
            shutil.copytree(first, tmp_path / name)
            main(['--resume', tmp_path / name / 'last.pt', '--epochs', 2, '--workers', 0, *flags])  # (machine)
            final[name] = load(tmp_path / name / 'last.pt')
    for name, ckpt in final.items():
        args, (decay, no_decay) = ckpt['args'], ckpt['optimizer']['param_groups']
        assert (decay['rho'], decay['weight_decay'], no_decay['weight_decay'], decay['eps']) == \
               (args['rho'], args['wd'], 0.0, args['opt_eps'])
        assert name == 'plain' or not torch.equal(ckpt['model']['head.weight'], final['plain']['model']['head.weight'])
    assert (final['rho_wd']['args']['rho'], final['rho_wd']['args']['wd'], final['eps']['args']['opt_eps']) == \
           (0.5, 0.9, 0.5)
