"""The house: three layers (leaves, shared library modules, scripts) with imports only downwards, the reading
budgets, and the library's own behaviour: one build_model for every model name of every script, one
load_weights for every checkpoint format, against torchvision / timm-keyed models and the source model's logits."""
import ast
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision

import convmixer
import models
import vit
from conftest import REPO

LEAVES = {'vit', 'mixer', 'convmixer', 'sam', 'pgd', 'augment', 'hessian', 'gsam', 'matfree', 'looksam', 'msam'}
SAM_SUCCESSORS = {'gsam', 'looksam', 'msam'}  # leaves that may import `sam` (and nothing else of the repo): copied
# with sam.py, they work. hessian.py may import matfree.py (its algorithms on any symmetric operator; issue 46):
# copied with it, it works
LIBRARY = {'utils': {'flags', 'runs', 'images', 'loader', 'data', 'models', 'figures', 'anchors'},
           'anchors': {'flags', 'runs', 'images', 'loader', 'data', 'models', 'figures'},  # (geometry --compare's)
           'flags': {'runs', 'images', 'loader', 'data', 'models', 'figures'},
           'runs': {'images', 'loader', 'data', 'models', 'figures'},
           'images': {'runs', 'loader', 'data', 'models', 'figures'}, 'loader': {'runs', 'data', 'models', 'figures'},
           'data': {'models', 'figures'}, 'models': {'figures'}, 'figures': {'images', 'loader', 'data', 'models'},
           # robustness.py's corruption cache; train_contrastive.py's probes of frozen features (issue 43)
           'corruptions': {'flags', 'images', 'loader', 'data', 'models', 'figures', 'probes'},
           'probes': {'flags', 'runs', 'loader', 'data', 'models', 'figures', 'corruptions'}}
# (module: the library modules it may NOT import: utils < flags, utils < runs < data < models, utils < images < loader < data,
# runs < figures; no cycles)
SCRIPTS = {'train_cifar': 430, 'train_imagenet': 480, 'train_contrastive': 560, 'geometry': 700, 'table1': 320,
           'robustness': 640, 'bench': 500, 'gpu_check': 520, 'gpu_probe': 170}  # lines: reading targets; "a little
# over is fine where the code earns it": 5%. Issue 43 (2026-12-07): back to the targets of the before-stop hook;
# geometry's Table 1 runner is table1.py, robustness's corruption cache corruptions.py, the contrastive probes
# probes.py. Issue 45: bench 500 (the JSON's numbers, no timm, rows saved as they finish; issue 44: LookSAM's and
# MSAM's columns), gpu_probe.py new (gpu_check's in-process parts, each a process its deadline can end).
OUTSIDE = {'torch', 'torchvision', 'einops', 'numpy'}  # what a leaf may import, besides the standard library


def imports(name):
    """The top-level names a root file imports, anywhere in it (function-level imports included)."""
    tree = ast.parse((REPO / f'{name}.py').read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split('.')[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.add(node.module.split('.')[0])
    return out


def test_every_root_file_is_in_one_layer():
    files = {p.stem for p in REPO.glob('*.py')}
    assert files == LEAVES | set(LIBRARY) | set(SCRIPTS)


# A leaf's reading target in lines (the before-stop hook's list; 5% over is fine where the code earns it), and each
# exception with its reason: looksam.py carries issue 44's per-tensor option, its fp16 overflow guard, DDP and resume
# state, and the provenance of each line (the paper's text could not be read); pgd.py its argument checks (issue 42:
# a library that trusts its caller); matfree.py is hessian.py's algorithms on any operator, split out (issue 46).
LEAF_LINES = dict(vit=330, mixer=250, convmixer=160, sam=300, gsam=200, looksam=200, msam=160, augment=420,
                  hessian=300, matfree=330, pgd=90)


@pytest.mark.parametrize('name', sorted(LEAVES))
def test_a_leaf_reads_in_its_budget(name):
    lines = (REPO / f'{name}.py').read_text().splitlines()
    assert len(lines) <= 1.05 * LEAF_LINES[name] and max(map(len, lines)) <= 120


@pytest.mark.parametrize('name', sorted(LEAVES))
def test_a_leaf_imports_no_file_of_the_repo(name):
    """Copying one leaf into another project just works: torch, torchvision, einops, numpy, the standard library
    (and a SAM successor's sam.py)."""
    got = imports(name) - ({'sam'} if name in SAM_SUCCESSORS else set()) - ({'matfree'} if name == 'hessian' else set())
    assert not got & (LEAVES | set(LIBRARY) | set(SCRIPTS)), got
    assert got - OUTSIDE <= set(sys.stdlib_module_names), got - OUTSIDE


ONE_STEP = {  # a SAM successor's loop, as its docstring writes it: one step of a tiny model in an empty folder
    'gsam': '''
import torch, torch.nn.functional as F
from gsam import GSAM
from sam import first_pass, second_pass
torch.manual_seed(0)
model, x, y = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)), \
    torch.randn(16, 4), torch.randint(0, 3, (16,))
optimizer = GSAM(model.parameters(), torch.optim.SGD, rho=0.1, rho_min=0.05, alpha=0.3, lr_max=0.1, lr_min=0.0, lr=0.1)
w0 = [p.detach().clone() for p in model.parameters()]
with first_pass(model):
    F.cross_entropy(model(x), y).backward()
optimizer.first_step(zero_grad=True)
with second_pass(model, sync=False):
    F.cross_entropy(model(x), y).backward()
optimizer.gsam_gradient()
optimizer.second_step(zero_grad=True)
assert all(torch.isfinite(p).all() for p in model.parameters())
print(sum((p - q).norm() for p, q in zip(model.parameters(), w0)).item())
''', 'looksam': '''
import contextlib, torch, torch.nn.functional as F
from looksam import LookSAM
from sam import first_pass, second_pass
torch.manual_seed(0)
model, x, y = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)), \
    torch.randn(16, 4), torch.randint(0, 3, (16,))
optimizer = LookSAM(model.parameters(), torch.optim.SGD, rho=0.1, k=2, alpha=0.7, lr=0.1)
w0 = [p.detach().clone() for p in model.parameters()]
for t in range(2):  # a refresh (two passes), then a reuse step (one)
    two = optimizer.refresh
    with first_pass(model) if two else contextlib.nullcontext():
        F.cross_entropy(model(x), y).backward()
    if two:
        optimizer.first_step(zero_grad=True)
        with second_pass(model):
            F.cross_entropy(model(x), y).backward()
    optimizer.look_gradient()
    optimizer.second_step(zero_grad=True)
assert all(torch.isfinite(p).all() for p in model.parameters())
print(sum((p - q).norm() for p, q in zip(model.parameters(), w0)).item())
''', 'msam': '''
import torch, torch.nn.functional as F
from msam import MSAM
torch.manual_seed(0)
model, x, y = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)), \
    torch.randn(16, 4), torch.randint(0, 3, (16,))
optimizer = MSAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1, momentum=0.9)
w0 = [p.detach().clone() for p in model.parameters()]
for t in range(2):  # (the first step has no momentum yet: no move)
    optimizer.perturb()
    F.cross_entropy(model(x), y).backward()
    optimizer.second_step(zero_grad=True)
assert all(torch.isfinite(p).all() for p in model.parameters())
print(sum((p - q).norm() for p, q in zip(model.parameters(), w0)).item())
'''}


@pytest.mark.parametrize('name', sorted(SAM_SUCCESSORS))
def test_a_sam_successor_copied_with_sam_py_into_an_empty_folder_trains_a_step(name, tmp_path):
    """Issue 43: each successor imports only torch and sam.py. In a subprocess that sees only the two copied files
    (no PYTHONPATH, the folder as its working directory), its docstring's loop takes a step that moves w."""
    for f in (name, 'sam'):
        shutil.copy(REPO / f'{f}.py', tmp_path)
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    code = f'import {name}, sam; assert {name}.__file__.startswith({str(tmp_path)!r})' + ONE_STEP[name]
    proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.split()[-1]) > 0


@pytest.mark.parametrize('name', sorted(LIBRARY))
def test_a_library_module_imports_leaves_and_lower_library_modules_only(name):
    got = imports(name) & (LEAVES | set(LIBRARY) | set(SCRIPTS))
    assert not got & set(SCRIPTS) and not got & LIBRARY[name], got
    assert len((REPO / f'{name}.py').read_text().splitlines()) <= (290 if name == 'utils' else 250)  # (utils: issue 36's
    # memory sizing beside issue 34's shared flag rules and LR check)


@pytest.mark.parametrize('name', sorted(SCRIPTS))
def test_no_script_imports_another_script_and_each_reads_in_its_budget(name):
    assert not imports(name) & set(SCRIPTS), imports(name) & set(SCRIPTS)
    lines = (REPO / f'{name}.py').read_text().splitlines()
    assert len(lines) <= 1.05 * SCRIPTS[name]
    assert max(map(len, lines)) <= 120


@pytest.mark.parametrize('name', sorted(LEAVES | set(LIBRARY) | set(SCRIPTS)))
def test_no_function_is_over_120_lines(name):
    tree = ast.parse((REPO / f'{name}.py').read_text())
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 120}
    assert not long


# -----------------------------------------------------------------------------
# models.build_model: every name of every script.
@pytest.mark.parametrize('name', models.NAMES)
def test_build_model_builds_every_name(name):
    """On the meta device (no memory): the class count and the output shape; ImageNet configs at their size."""
    with torch.device('meta'):
        model = models.build_model(name, 7, 224)
        out = model(torch.empty(2, 3, 224, 224))
    assert out.shape == (2, 7)


def test_torchvision_resnets_are_torchvisions_and_the_cifar_ones_have_the_cifar_stem():
    ours, theirs = models.build_model('resnet50', 1000, 224), torchvision.models.resnet50()
    shapes = lambda m: [(k, v.shape) for k, v in m.state_dict().items()]  # noqa: E731
    assert shapes(ours) == shapes(theirs)
    r18 = models.build_model('resnet18', 10, 32)
    assert r18.conv1.kernel_size == (3, 3) and r18.conv1.stride == (1, 1) and isinstance(r18.maxpool, torch.nn.Identity)
    assert sum(p.numel() for p in models.build_model('resnet20', 10, 32).parameters()) == 269_722  # He et al.: 0.27M


def test_cifar_adaptation_only_where_asked():
    """cifar=True at 32 px: ViT/Mixer patch p/4, ConvMixer p/7; train_imagenet's (cifar=False) keeps the config."""
    stride = lambda *a, **k: models.build_model('vit_s16', *a, **k).patch_embed.proj.stride  # noqa: E731
    assert stride(10, 32, cifar=True) == (4, 4) and stride(10, 32) == stride(10, 64, cifar=True) == (16, 16)
    assert models.build_model('mixer_b16', 10, 32, cifar=True).stem.proj.stride == (4, 4)
    cm = models.build_model('convmixer_1536_20', 10, 32, cifar=True)
    assert cm.stem[0].stride == (1, 1)  # p7 // 7


@pytest.mark.parametrize('kw, words', [({'num_classes': 5}, ['num_classes=5', 'class count comes from --data']),
                                       ({'img_size': 64}, ['img_size=64', '--img-size']),
                                       ({'depth': 0}, ['--model vit_ti16', 'depth'])])
def test_build_model_refuses_what_the_flags_own_and_names_bad_settings(kw, words):
    with pytest.raises(models.UserError) as e:
        models.build_model('vit_ti16', 10, 32, kw)
    assert all(w in str(e.value) for w in words), e.value


def test_unknown_name_lists_every_script_name():
    with pytest.raises(models.UserError) as e:
        models.build_model('vit_huge', 10, 224)
    assert all(n in str(e.value) for n in ('vit_b16', 'mixer_b16', 'convmixer_256_8', 'resnet20', 'resnet152'))


# -----------------------------------------------------------------------------
# models.load_weights: every format into one model, the logits of the source model each time.
def tiny_vit():  # the shape test_checkpoints' .npz writer is for
    return vit.create('vit_ti16', num_classes=10, img_size=32, patch_size=8, dim=64, depth=2, heads=4)


@pytest.mark.parametrize('fmt', ['our-last.pt', 'state_dict-key', 'bare', 'ddp-prefix', 'compile-prefix', 'npz'])
def test_load_weights_reads_every_format(fmt, tmp_path):
    torch.manual_seed(0)
    source, x = tiny_vit(), torch.randn(2, 3, 32, 32)
    for p in source.parameters():  # no zero head: a wrong load would show in the logits
        torch.nn.init.normal_(p, std=0.1)
    sd = source.state_dict()
    path = tmp_path / ('w.npz' if fmt == 'npz' else 'w.pt')
    if fmt == 'npz':
        import test_checkpoints  # the official layout, written independently of the loader
        np.savez(path, **test_checkpoints.vit_npz_arrays(sd))
    else:
        prefix = {'ddp-prefix': 'module.', 'compile-prefix': '_orig_mod.'}.get(fmt, '')
        sd = {prefix + k: v for k, v in sd.items()}
        torch.save({'our-last.pt': {'model': sd, 'args': {}}, 'state_dict-key': {'state_dict': sd}}.get(fmt, sd), path)
    torch.manual_seed(1)
    target = tiny_vit()
    models.load_weights(target, path)
    assert torch.allclose(target.eval()(x), source.eval()(x), atol=1e-6)


def test_load_weights_converts_locuslab_convmixer_keys(tmp_path):
    torch.manual_seed(0)
    source = convmixer.create('convmixer_256_8', dim=16, depth=2, kernel_size=3, patch_size=2)
    # locuslab's flat nn.Sequential: 0 conv, 1 act, 2 BN, block i at 3 + i (inner names as ours), the head last
    rename = {'stem.0': '0', 'stem.2': '2', 'head': '7'}  # head: depth + 5
    sd = {}
    for k, v in source.state_dict().items():
        for ours, theirs in rename.items():
            k = k.replace(ours + '.', theirs + '.', 1) if k.startswith(ours + '.') else k
        if k.startswith('blocks.'):
            _, i, rest = k.split('.', 2)
            k = f'{3 + int(i)}.{rest}'
        sd[k] = v
    torch.save({'state_dict': sd}, tmp_path / 'locuslab.pth.tar')
    target = convmixer.create('convmixer_256_8', dim=16, depth=2, kernel_size=3, patch_size=2)
    models.load_weights(target, tmp_path / 'locuslab.pth.tar')
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(target.eval()(x), source.eval()(x))


# -----------------------------------------------------------------------------
# Where a process runs (issue: GPU-ready without a GPU), observable on the CPU.
def test_the_suite_hides_every_gpu():
    """The asserts are calibrated on the CPU in fp32: conftest hides GPUs from this process and, through the
    environment, from every torchrun and script subprocess (which would put rank 1 on cuda:1, autocast in bf16)."""
    import os
    assert os.environ['CUDA_VISIBLE_DEVICES'] == '' and not torch.cuda.is_available()


def test_setup_refuses_more_processes_than_gpus(monkeypatch):
    import utils
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setenv('LOCAL_RANK', '1')
    with pytest.raises(utils.UserError, match=r'LOCAL_RANK 1, but this machine has 1 GPU\(s\): pass --nproc_per_node'):
        utils.setup()


def test_nccl_is_bound_to_the_process_gpu_with_a_timeout(monkeypatch):
    """device_id: NCCL would otherwise guess the GPU from the global rank (wrong on multi-node runs with fewer
    processes than GPUs per node); the timeout: ranks wait while rank 0 saves or evaluates."""
    import datetime
    import utils
    seen = {}
    monkeypatch.setattr(utils.dist, 'init_process_group', lambda backend, **kw: seen.update(backend=backend, **kw))
    proc = utils.Process(9, 1, 16, torch.device('cuda', 1), 'bf16', torch.bfloat16, None, True)
    utils.init_group(proc)
    assert seen == dict(backend='nccl', device_id=torch.device('cuda', 1), timeout=datetime.timedelta(minutes=60))


# -----------------------------------------------------------------------------
# runs.py: the run folder (issue: a new user's mistakes).
def test_a_second_run_into_one_out_is_refused_until_the_first_ends(tmp_path):
    """Two runs into one --out once both said "done" and one of them was lost. The lock is flock's: a killed run
    (whose open files close with it) leaves nothing stuck; the same process may come back (a resume in-process)."""
    import argparse
    import runs
    args = argparse.Namespace(out=str(tmp_path / 'same'), overwrite=False, resume=None)
    first = subprocess.Popen([sys.executable, '-c', 'import argparse, sys, time, runs; runs.prepare_out(argparse.'
                              f'Namespace(out={args.out!r}, overwrite=False, resume=None)); print("locked", flush=True);'
                              ' time.sleep(60)'], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == 'locked'
    with pytest.raises(runs.UserError, match=r'is in use by another run now .*\.lock\); pick another --out'):
        runs.prepare_out(args)
    first.kill()
    first.wait()
    runs.prepare_out(args)
    runs.prepare_out(args)  # this process again: its own lock
    runs.LOCKS.pop((tmp_path / 'same').resolve()).close()


# Every script with an --out folder, parsed from its -h (and each subcommand's): the argv of a tiny run of it (DATA: a
# CIFAR image folder of 15 + 15 images a class, IMAGENET: its ImageNet layout, CKPT: a tiny train_cifar.py last.pt,
# CIFAR: the suite's CIFAR-10 extract). A script or subcommand with an --out
# and no entry here fails the test below: add one.
TINY_RUNS = {
    'train_cifar': ['--data', '{DATA}', '--epochs', 1, '--batch-size', 10, '--model-kw', 'dim=8', 'depth=1',
                    '--log-every', 0],
    'train_imagenet': ['--data', '{IMAGENET}', '--model', 'vit_ti16', '--model-kw', 'depth=1', 'dim=16', 'heads=2',
                       '--img-size', 32, '--batch-size', 4, '--epochs', 1, '--workers', 0, '--log-every', 0],
    'train_contrastive': ['--data', '{DATA}', '--model', 'vit_ti16', '--model-kw', 'dim=16', 'depth=1', 'heads=2',
                          'patch_size=8', '--proj-hidden', 16, '--proj-dim', 8, '--batch-size', 10, '--epochs', 1,
                          '--warmup-epochs', 0, '--log-every', 0],
    **{f'geometry {sub}': [sub, '--data', '{DATA}', '--images', 4, '--model', 'convmixer_256_8', '--model-kw', 'dim=8',
                           'depth=1'] for sub in ('hessian', 'ntk', 'landscape', 'flatness', 'neurons')},
    'geometry attention': ['attention', '--data', '{DATA}', '--images', 2, '--model', 'vit_ti16', '--model-kw',
                           'dim=16', 'depth=1', 'heads=2', 'patch_size=8'],
    'table1': ['--data', '{CIFAR}', '--train-subset', 256, '--hessian-n', 4, '--ntk-n', 4,
               '--corruption-n', 0],
    'robustness': ['--benchmark', 'corrupt', '--data', '{DATA}', '--checkpoint', '{CKPT}', '--subset', 10,
                   '--corruptions', 'gaussian_noise', '--no-plot', '--workers', 0],
    'gpu_check': ['--data', '{DATA}', '--dry-run', '--parts', 'versions'],
}


class WentOn(BaseException):  # a second run that went past where its lock should have stopped it (no script catches it)
    pass


def run_in_process(script, argv, capsys):
    """script's __main__ block in this process (as `python script.py argv`) -> (exit code or message, output)."""
    import runpy
    sys.argv, old = [f'{script}.py'] + [str(a) for a in argv], sys.argv
    try:
        runpy.run_path(str(REPO / f'{script}.py'), run_name='__main__')
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return code, out.out + out.err


def scripts_with_out(capsys):
    """{'script' or 'script subcommand': the -h text} of every root file whose -h (or a subcommand's) has --out DIR."""
    import re
    found = {}
    for path in sorted(REPO.glob('*.py')):
        if "__name__ == '__main__'" not in path.read_text():
            continue
        _, text = run_in_process(path.stem, ['-h'], capsys)
        listed = text.partition('positional arguments:')[2].partition('options:')[0]  # (argparse's subcommands)
        subs = re.findall(r'^ {4}(\w+)(?: |$)', listed, re.M)
        for sub, help_text in ([(s, run_in_process(path.stem, [s, '-h'], capsys)[1]) for s in subs] or [('', text)]):
            if re.search(r'--out DIR', help_text):
                found[f'{path.stem} {sub}'.strip()] = help_text
    return found


@pytest.fixture(scope='module')
def tiny_data(cifar10_dir, tmp_path_factory):
    """15 train + 15 test images a class of the CIFAR-10 copy (the fewest every script takes): DATA (train/, test/),
    IMAGENET (train/, val/), and CKPT, a train_cifar.py last.pt of a ConvMixer of width 8, depth 1."""
    import shutil
    root = tmp_path_factory.mktemp('tiny')
    for split, dst in (('train', 'DATA/train'), ('test', 'DATA/test'), ('train', 'IMAGENET/train'),
                       ('test', 'IMAGENET/val')):
        for c in sorted((cifar10_dir / split).iterdir()):
            (root / dst / c.name).mkdir(parents=True)
            for f in sorted(c.iterdir())[:15]:
                shutil.copy(f, root / dst / c.name / (f.stem + ('.JPEG' if 'IMAGENET' in dst else f.suffix)))
    net = models.build_model('convmixer_256_8', 10, 32, {'dim': 8, 'depth': 1}, cifar=True)
    torch.save(dict(model=net.state_dict(), optimizer={}, scaler={}, epoch=1, step=1, history=[], args=dict(
        model='convmixer_256_8', model_kw=['dim=8', 'depth=1'], dataset='cifar10', img_size=32)), root / 'last.pt')
    return {'DATA': root / 'DATA', 'IMAGENET': root / 'IMAGENET', 'CKPT': root / 'last.pt', 'CIFAR': cifar10_dir}


def test_every_script_with_an_out_folder_has_a_tiny_run_in_this_test(capsys):
    assert set(scripts_with_out(capsys)) == set(TINY_RUNS)


@pytest.mark.parametrize('name', sorted(TINY_RUNS))
def test_a_second_run_into_the_out_of_a_running_one_is_refused_in_one_line(name, tiny_data, tmp_path, capsys,
                                                                          monkeypatch, one_thread):
    """Issue 42 (K14, K15: two robustness runs into one --out both said done, one result lost; geometry the same):
    every script that writes an --out folder takes runs.lock_out's lock before any work, so a second run while the
    first lives is refused in one line naming the folder. The first run here is this test holding OUT/.lock as a
    running script holds it (flock); the second stops at its first subprocess, file write or 60 s if it went on."""
    import fcntl
    import signal
    import subprocess
    import runs
    out = tmp_path / 'out'
    out.mkdir()
    held = open(out / '.lock', 'a')
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def went_on(*args, **kwargs):
        raise WentOn
    monkeypatch.setattr(subprocess.Popen, '__init__', went_on)
    monkeypatch.setattr(runs, 'save_atomic', went_on)
    old = signal.signal(signal.SIGALRM, went_on)
    signal.setitimer(signal.ITIMER_REAL, 60)
    script, argv = name.split()[0], [str(a).format(**tiny_data) for a in TINY_RUNS[name]]
    try:
        code, text = run_in_process(script, [*argv, '--out', out], capsys)
    except WentOn:
        code, text = None, capsys.readouterr().out
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        runs.NEW_DIRS.clear()
        held.close()
    assert isinstance(code, str) and '\n' not in code, f'{name} was not refused: {code!r}, {text[-500:]}'
    assert code == f'{script}.py: error: --out {out} is in use by another run now (it holds {out / ".lock"}); ' \
                   'pick another --out'
    assert os.listdir(out) == ['.lock']


def test_a_folder_made_for_a_run_that_failed_at_once_is_removed_again(tmp_path):
    import argparse
    import runs
    runs.prepare_out(argparse.Namespace(out=str(tmp_path / 'new' / 'out'), overwrite=False, resume=None))
    (tmp_path / 'kept').mkdir()
    (tmp_path / 'kept' / 'x').write_text('a user file')
    runs.NEW_DIRS.append(tmp_path / 'kept')  # not empty: left alone
    runs.LOCKS.pop((tmp_path / 'new' / 'out').resolve()).close()
    runs.discard_new_dirs()
    assert not (tmp_path / 'new').exists() and (tmp_path / 'kept' / 'x').exists()  # (new/ was made for out/ too)
    runs.NEW_DIRS.clear()


def test_random_bytes_as_a_checkpoint_is_one_short_line_that_invites_no_unsafe_load(tmp_path):
    import runs
    (tmp_path / 'x.pt').write_bytes(bytes(range(256)) * 40)
    with pytest.raises(runs.UserError) as e:
        runs.read_checkpoint(tmp_path / 'x.pt', '--resume')
    assert 'weights_only' not in str(e.value) and len(str(e.value)) < 250 and '\n' not in str(e.value)


def test_a_full_disk_is_named_as_such_and_keeps_the_last_checkpoint(tmp_path):
    """torch.save into a file reports ENOSPC as its zip writer's RuntimeError ('enforce fail ... unexpected pos'):
    the checkpoint is serialised in memory and written by one f.write, whose OSError names the cause."""
    import runs
    runs.save_atomic(tmp_path / 'last.pt', {'w': torch.ones(3)})
    (tmp_path / 'last.pt.tmp').symlink_to('/dev/full')
    with pytest.raises(runs.UserError, match='No space left on device; the previous last.pt is intact'):
        runs.save_atomic(tmp_path / 'last.pt', {'w': torch.zeros(10_000)})
    assert torch.equal(torch.load(tmp_path / 'last.pt')['w'], torch.ones(3))


@pytest.mark.parametrize('failure', ['disk full', 'writer error', 'not finite', 'ctrl-c'])
def test_a_failed_save_leaves_the_previous_file_whole_and_no_tmp_behind(failure, tmp_path):
    """Issue 42, mutant 8: however a write ends (ENOSPC, a writer's OSError mid-file, a NaN metric, Ctrl-C), the
    folder holds what it held before, byte for byte, and no PATH.tmp (a leftover blocks nothing, but fills a disk
    and reads as a half-written checkpoint); a failure is one line naming the file. Oracle: the folder before."""
    import errno
    import os
    import runs

    def half_then(error):  # a writer (np.save, fig.savefig) that writes a little, then fails
        def write(f):
            f.write(b'half a file')
            raise error
        return write
    name, obj = {'disk full': ('last.pt', {'w': torch.zeros(10_000)}),
                 'writer error': ('x.npy', half_then(OSError(errno.EIO, os.strerror(errno.EIO)))),
                 'not finite': ('metrics.jsonl', [{'step': 1, 'loss': float('nan')}]),
                 'ctrl-c': ('fig.png', half_then(KeyboardInterrupt()))}[failure]
    (tmp_path / name).write_bytes(b'the previous file')
    if failure == 'disk full':
        (tmp_path / f'{name}.tmp').symlink_to('/dev/full')  # every write to it fails with ENOSPC
    with pytest.raises(KeyboardInterrupt if failure == 'ctrl-c' else runs.UserError) as e:
        runs.save_atomic(tmp_path / name, obj)
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_bytes() == b'the previous file'
    if failure != 'ctrl-c':
        assert str(e.value).startswith(f'could not write {tmp_path / name}: ') and '\n' not in str(e.value)
        assert str(e.value).endswith(f'the previous {name} is intact')


def test_a_resume_whose_optimizer_state_does_not_fit_names_the_flags_that_changed():
    """U03/U04 of bad-inputs-3: a flag that changes which parameters train (train_contrastive.py's
    --no-freeze-patch-embed) made torch's "parameter group that doesn't match the size" the whole message."""
    import argparse
    import runs
    net = torch.nn.Linear(2, 2)
    saved = torch.optim.AdamW(net.parameters()).state_dict()  # the run trained weight and bias
    args = argparse.Namespace(resume='r/last.pt', freeze_bias=True, lr=0.1, epochs=3,
                              saved_args=dict(freeze_bias=False, lr=0.1))
    ckpt = dict(optimizer=saved, scaler={}, epoch=1, step=1, history=[])
    with pytest.raises(runs.UserError, match=r"^--resume r/last.pt: its optimizer state does not fit \(.*\); changed "
                                             r"since the run: --freeze-bias False -> True: pass the run's values$"):
        runs.restore(ckpt, torch.optim.AdamW([net.weight]), torch.amp.GradScaler('cpu', enabled=False), args, (),
                     print)


@pytest.mark.parametrize('flag', ['--train-subset', '--test-subset'])
def test_a_subset_that_leaves_a_class_without_an_image_is_refused(flag, cifar10_dir, tmp_path):
    """Issue 42, data that cannot train a classifier: train_cifar.py --train-subset 7 trained a 10-class model on 7
    classes (3 never seen, only pushed down) and said done; --test-subset 7 scored 7 classes as "test acc". Oracle:
    balanced_subset's own quota, n // 10 (+1 for the first n % 10) of each class: 0 for 3 classes."""
    import data
    import train_cifar as tc
    labels = data.load_cifar(cifar10_dir, 'cifar10', flag == '--train-subset', 7)[1]
    assert len(set(labels.tolist())) == 7  # (what the library gives when no flag asks for every class)
    with pytest.raises(data.UserError, match=f'^{flag} 7 leaves 3 of the 10 classes without an image .*: pass 0 '
                                             r'\(all\) or 10 or more$'):
        tc.main(['--data', str(cifar10_dir), '--train-subset', '10', '--test-subset', '10', flag, '7', '--epochs', '1',
                 '--batch-size', '1', '--model-kw', 'dim=8', 'depth=1', '--log-every', '0', '--out', str(tmp_path)])
    with pytest.raises(data.UserError, match=f'^{flag} 1 leaves 1 of the 2 classes'):  # --classes: k of them
        data.load_cifar(cifar10_dir, 'cifar10', True, 1, [3, 5], '--classes', flag)


def test_an_image_a_measurement_cannot_read_is_named_and_a_transform_error_is_not_blamed_on_a_file(tmp_path):
    """geometry.py's ImageNet images (data.measurement_images) said "cannot decode an image of DIR"; the loaders'
    data.ImageFolder took a transform's error for an unreadable file ("corrupt or truncated" of a good image)."""
    from PIL import Image
    import data
    for c in ('a', 'b'):
        (tmp_path / 'train' / c).mkdir(parents=True)
        Image.new('RGB', (40, 30), (200, 10, 10)).save(tmp_path / 'train' / c / 'good.JPEG')
    (tmp_path / 'train' / 'b' / 'zz.JPEG').write_bytes(b'not an image')
    with pytest.raises(data.UserError, match=r'^cannot decode .*/train/b/zz\.JPEG: corrupt or truncated$'):
        data.measurement_images(tmp_path, 'imagenet', True, 3, 32)

    def impossible(image):
        raise ValueError('a crop larger than the image')
    ds = data.ImageFolder(tmp_path, 'train', impossible, 32)
    with pytest.raises(ValueError, match='a crop larger than the image'):
        ds[0]
    assert ds[2][1] == -3  # (zz.JPEG, index 2: unreadable, named by the loaders' check_decoded)


def test_a_split_root_given_as_an_image_folder_is_named_not_read_as_two_classes(cifar10_dir):
    """An ImageNet checkpoint with a CIFAR root (DIR/{train,test}/<class>) read 'train' and 'test' as 2 classes."""
    import data
    with pytest.raises(data.UserError, match=r'holds the splits test, train, not class folders: pass .*/<split>'):
        data.folder_samples(cifar10_dir)
    classes, samples = data.folder_samples(cifar10_dir / 'test', subset=20)
    assert len(classes) == 10 and len(samples) == 20


# -----------------------------------------------------------------------------
# issue 34
@pytest.mark.parametrize('name, obj', [('last.pt', {'w': torch.arange(3000.0)}), ('args.json', {'lr': 0.1}),
                                       ('metrics.jsonl', [{'step': 1}] * 50)])
def test_save_atomic_makes_the_file_durable_before_it_takes_the_final_name(name, obj, tmp_path, monkeypatch):
    """A crash right after os.replace must find the whole file under the final name: at the replace, PATH.tmp
    holds every byte (flushed) and has been fsync'ed. Replacing before flush/fsync left a short or empty file
    under the final name. Oracle: the bytes the file holds once written."""
    import os
    import runs
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(runs.os, 'fsync', lambda fd: events.append(('fsync', os.fstat(fd).st_size)) or fsync(fd))
    monkeypatch.setattr(runs.os, 'replace',
                        lambda a, b: events.append(('replace', os.path.getsize(a))) or replace(a, b))
    runs.save_atomic(tmp_path / name, obj)
    size = (tmp_path / name).stat().st_size
    assert size > 0 and events == [('fsync', size), ('replace', size)]


def test_check_ranges_names_a_non_number_and_where_it_came_from():
    """F10: a hand-edited last.pt with args lr 'fast' was a TypeError traceback inside check_ranges."""
    import argparse
    import flags
    import utils
    args = argparse.Namespace(lr='fast', seed=2 ** 64, img_size=32)
    with pytest.raises(utils.UserError, match=r"--lr must be a number, got 'fast' \(from the args stored in x.pt: a "
                                              r'damaged or hand-edited file\)'):
        flags.check_ranges(args, ['lr'], [], {}, stored_in='x.pt')
    with pytest.raises(utils.UserError, match='--seed must be a finite number >= 0 and <= 9223372036854775807'):
        flags.check_ranges(args, ['img_size'], ['seed'], {})  # the shared bound: torch.manual_seed's 64 bits
    torch.manual_seed(flags.SHARED_AT_MOST['seed'] + 1000)  # (and the bound leaves room for an epoch offset)


def test_load_optimizer_state_takes_the_moments_from_the_file_and_the_settings_from_the_flags():
    """A08, S10-S13: --resume with a changed --rho / --wd / --opt-eps: torch's load_state_dict puts back the file's
    group values; runs.load_optimizer_state keeps the optimizer's own (built from this command line). Oracle: the
    saved moments, and the values given."""
    import runs
    from sam import SAM
    model = torch.nn.Linear(3, 2)
    groups = lambda wd: [dict(params=[model.weight], weight_decay=wd), dict(params=[model.bias], weight_decay=0.0)]
    old = SAM(groups(0.3), torch.optim.AdamW, rho=0.05, lr=0.1, eps=1e-8)
    model(torch.randn(4, 3)).square().sum().backward()
    old.first_step(zero_grad=True)
    model(torch.randn(4, 3)).square().sum().backward()
    old.second_step(zero_grad=True)
    new = SAM(groups(0.9), torch.optim.AdamW, rho=0.5, adaptive=True, lr=0.1, eps=0.5)
    runs.load_optimizer_state(new, old.state_dict())
    assert [(g['rho'], g['adaptive'], g['weight_decay'], g['eps']) for g in new.param_groups] == \
           [(0.5, True, 0.9, 0.5), (0.5, True, 0.0, 0.5)]
    assert torch.equal(new.state[model.weight]['exp_avg'], old.state[model.weight]['exp_avg'])
    assert new.param_groups is new.base_optimizer.param_groups


def test_a_decompression_bomb_or_16_bit_image_in_an_image_folder(cifar10_dir, tmp_path):
    """H07, H12-H16: PIL's DecompressionBombError is no OSError: every reader (load_cifar, data.ImageFolder in loader
    workers, robustness.py's folder_batches) now names the file and the cause in one UserError. A 16-bit PNG is its
    levels / 257 there too (H05, H29)."""
    import shutil
    import data
    from conftest import write_bomb_png
    import loader as loader_module
    from PIL import Image
    root = tmp_path / 'set'
    for c in sorted((cifar10_dir / 'test').iterdir())[:2]:
        (root / 'val' / c.name).mkdir(parents=True)
        for f in sorted(c.iterdir())[:2]:
            shutil.copy(f, root / 'val' / c.name / f.name)
    level = np.random.default_rng(0).integers(0, 65536, (32, 32), dtype=np.uint16)
    Image.fromarray(level).save(root / 'val' / c.name / 'zz_16bit.png')
    classes, samples = data.folder_samples(root / 'val')
    x, y, i = next(data.folder_batches(samples, data.eval_transform(32, 1.0, to_float=False), 8, 0, 0, 1))
    assert torch.equal(x[-1], torch.from_numpy(np.round(level / 257).astype(np.uint8)).expand(3, 32, 32))
    write_bomb_png(root / 'val' / c.name / 'zz_bomb.png')
    classes, samples = data.folder_samples(root / 'val')
    for workers in (0, 1):
        with pytest.raises(data.UserError, match=r"cannot decode .*zz_bomb.png \(it has more than 178,956,970 pixels, "
                                                 r"PIL's decompression-bomb limit\); replace or "
                                                 r"delete it"):
            list(data.folder_batches(samples, data.eval_transform(32, 1.0, to_float=False), 8, workers, 0, 1))
    (root / 'train').symlink_to(root / 'val', target_is_directory=True)
    loader = torch.utils.data.DataLoader(data.ImageFolder(root, 'val', data.eval_transform(32, 1.0, to_float=False),
                                                          32), batch_size=8, num_workers=1)
    with pytest.raises(data.UserError, match=r"cannot decode the image .*zz_bomb.png \(it has more than"):
        list(loader_module.on_device(loader, torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)))


def test_an_image_of_32_bit_or_float_pixels_is_refused_naming_its_mode(tmp_path):
    """PIL's convert('RGB') of a mode I or F image clips it to 0..255 whatever its range: no known 8-bit reading."""
    import images
    from PIL import Image
    Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32)).save(tmp_path / 'f.tiff')
    with pytest.raises(images.UnsupportedImage) as e:
        images.load_rgb(tmp_path / 'f.tiff')
    assert images.unreadable_reason(e.value) == ('F mode (float) pixels of no known range; save it with 8 or 16 bits '
                                                 'per channel')
    Image.fromarray(np.full((8, 8), 200, dtype=np.uint8)).save(tmp_path / 'l.png')  # 8-bit: PIL's own reading
    assert np.asarray(images.load_rgb(tmp_path / 'l.png')).tolist() == np.full((8, 8, 3), 200).tolist()
