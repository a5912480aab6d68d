"""gpu_check.py, the prepared command for a lent GPU (10 minutes a command, 8 files back), must fit the lease before
a GPU ever sees it: its dry run (every part at a toy size, on the CPU) stops inside --budget-s, skips and names what
would not fit, leaves one JSON and one log archive under --out, merges a second call into that JSON, and takes
--data / --out relative to the caller's folder. Without CUDA the real run refuses in one line."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO

PARTS = ('versions', 'augment', 'memory', 'syncs', 'cifar', 'bench', 'smoke', 'compile')
# The ops issue 33 lists: torchvision RandAugment's 14, the MoCo v3 view's, and whole pipelines.
RANDAUGMENT = ('Identity', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate', 'Brightness', 'Color', 'Contrast',
               'Sharpness', 'Posterize', 'Solarize', 'AutoContrast', 'Equalize')
LISTED = ('gaussian_blur', 'adjust_hue', 'color_jitter', 'resized_crop_rect_flip', 'random_erasing',
          'resized_crop_flip', 'pad_crop_flip', 'Augment.__call__ (strong)', 'Augment.__call__ (locuslab)',
          'Augment.__call__ (basic)', 'moco_view 0', 'moco_view 1')


def run(cwd, *args):
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'CUDA_VISIBLE_DEVICES': '', 'TMPDIR': str(cwd / 'tmp')}
    (cwd / 'tmp').mkdir(exist_ok=True)
    t = time.time()
    r = subprocess.run([sys.executable, str(REPO / 'gpu_check.py'), *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    return r, time.time() - t


@pytest.fixture(scope='module')
def two_calls(cifar10_dir, tmp_path_factory):
    """Call 1: a budget too short for most parts; call 2: the augment and cifar parts, merged into the same JSON.
    Both from a folder outside the repo, with --data and --out relative to it (W11, W12)."""
    home = tmp_path_factory.mktemp('caller')
    for split, n in (('train', 20), ('test', 10)):  # a small copy (W01): the dry run sizes itself to it
        for c in sorted(os.listdir(cifar10_dir / split)):
            (home / 'd' / 'cifar10' / split / c).mkdir(parents=True)
            for f in sorted(os.listdir(cifar10_dir / split / c))[:n]:
                shutil.copy(cifar10_dir / split / c / f, home / 'd' / 'cifar10' / split / c)
    data = os.path.join('d', 'cifar10')  # relative to the caller's folder (W11, W12)
    first = run(home, '--dry-run', '--data', data, '--out', 'gc', '--budget-s', 60, '--parts', 'versions', 'memory',
                'syncs', 'bench', 'smoke', 'compile')
    after_first = json.loads((home / 'gc' / 'gpu_check.json').read_text())
    second = run(home, '--dry-run', '--data', data, '--out', 'gc', '--parts', 'augment', 'cifar')
    return home, first, after_first, second, json.loads((home / 'gc' / 'gpu_check.json').read_text())


def test_a_short_budget_stops_in_time_and_names_every_skipped_part(two_calls):
    home, (r, wall), got, _, _ = two_calls
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert got['calls'][0]['wall_s'] <= 60 - 10  # from the process's start: the budget less the last writes' margin
    assert wall < 60  # the whole process, as the caller sees it
    assert set(got['parts']) == set(PARTS)  # every part named, the ones not asked for too
    status = {p: got['parts'][p]['status'] for p in PARTS}
    assert status == dict(versions='ok', memory='ok', syncs='skipped', bench='skipped', smoke='skipped',
                          compile='skipped', augment='not run', cifar='not run'), status
    for part in ('syncs', 'bench', 'smoke'):  # (each needs 90 s, at most 50 are left)
        assert 'needs ~' in got['parts'][part]['reason'] and '--budget-s 60' in got['parts'][part]['reason']
        assert any(line.startswith(part) and 'skipped' in line and 'needs ~' in line for line in r.stdout.splitlines())
    assert 'dry run does not compile' in got['parts']['compile']['reason']
    assert r.stdout.splitlines()[-1].startswith('done | 2 ok | 0 failed | 4 skipped (syncs, bench, smoke, compile)')


def test_a_second_call_merges_and_files_stay_under_out_and_few(two_calls):
    home, _, first, (r, _), got = two_calls
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert len(got['calls']) == 2 and got['parts']['versions'] == first['parts']['versions']  # kept from call 1
    assert {p: got['parts'][p]['status'] for p in ('versions', 'memory', 'augment', 'cifar')} == dict.fromkeys(
        ('versions', 'memory', 'augment', 'cifar'), 'ok')
    files = [p for p in (home / 'gc').rglob('*')]
    assert sorted(p.name for p in files) == ['gpu_check.json', 'gpu_check_logs.tar.gz']  # <= 8, the lease's limit
    assert not [f for f in os.listdir(home / 'tmp') if f.startswith('gpu_check')]  # run folders, tiny ImageNet: gone
    assert not (REPO / 'gc').exists()
    cifar = got['parts']['cifar']
    assert 0 < cifar['eager']['test_acc'] <= 100 and cifar['source']['data'] == str(home / 'd' / 'cifar10')
    assert cifar['source']['images'] == '200 train / 100 test'
    assert cifar['source']['format'].startswith('JPEG') and '92.5%' in cifar['reference']
    assert cifar['eager']['channels_last'] is False and cifar['eager_other_layout']['channels_last'] is True  # (CPU)
    import tarfile
    with tarfile.open(home / 'gc' / 'gpu_check_logs.tar.gz') as tar:
        assert 'cifar.log' in tar.getnames()


# augment.py's other functions and the compared ops they run inside (a new op must be compared, or listed here)
INSIDE = dict(per_image='RandAugment', grayscale='Color', smooth='Sharpness', blend_ops='color_jitter',
              posterize='Posterize', solarize='Solarize', affine_basis='Rotate', ra_magnitudes='Augment.__call__',
              apply_ra_ops='RandAugment', normalize='Augment.__call__', no_tf32='gaussian_blur',
              make_augment='Augment.__call__', check_settings='Augment.__call__', moco_view='moco_view 0')


def test_the_augment_part_compares_every_listed_op(two_calls):
    import inspect

    import augment
    got = two_calls[-1]['parts']['augment']['differing_pixels']
    assert set(RANDAUGMENT) == set(augment.RA_OPS)  # the names gpu_check takes the ops by
    assert set(got) == set(RANDAUGMENT) | set(LISTED)
    assert all(v == 0 for v in got.values())  # the CPU against itself: the plumbing, not the GPU
    functions = {n for n, f in vars(augment).items() if inspect.isfunction(f) and f.__module__ == 'augment'}
    assert functions - set(INSIDE) <= set(LISTED), functions - set(INSIDE) - set(LISTED)


def test_fixed_draws_are_replayed_whatever_the_generator():
    """The device run gets the CPU run's draws (a CUDA generator would draw others): replayed in order."""
    import torch
    import gpu_check
    draws = []
    with gpu_check.fixed_draws(draws):
        a = torch.rand(3, generator=torch.Generator().manual_seed(0)), torch.randint(0, 9, (4,))
    with gpu_check.fixed_draws(draws, 'cpu'):
        b = torch.rand(3, generator=torch.Generator().manual_seed(1)), torch.randint(0, 9, (4,))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not draws


def test_a_subprocess_past_the_budget_is_stopped_there(tmp_path):
    import argparse
    import gpu_check
    args = argparse.Namespace(deadline=time.time() + 3, budget_s=99)
    t = time.time()
    with pytest.raises(gpu_check.OutOfTime, match='end of --budget-s 99'):
        gpu_check.script(args, 'train_cifar.py', [], tmp_path / 'x.log', wrapper='import time; time.sleep(60)')
    assert time.time() - t < 10


def test_data_it_cannot_use_is_one_line_before_any_part(tmp_path, monkeypatch):
    import gpu_check
    from utils import UserError
    (tmp_path / 'tiny' / 'train' / 'a').mkdir(parents=True)  # an ImageNet layout (W08)
    (tmp_path / 'tiny' / 'val' / 'a').mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        gpu_check.get_args(['--dry-run', '--data', 'tiny', '--out', 'gc'])
    assert str(e.value) == (f'--data {tmp_path / "tiny"}: expected CIFAR-10 as DIR/train/<class>/*, '
                            "DIR/test/<class>/* or torchvision's DIR/cifar-10-batches-py")


def test_without_cuda_the_real_run_is_one_line(cifar10_dir, tmp_path):
    r, _ = run(tmp_path, '--data', cifar10_dir, '--out', tmp_path)
    assert r.returncode == 1 and 'Traceback' not in r.stderr
    assert r.stderr.strip().splitlines() == ['gpu_check.py: error: no CUDA device: this check is for a GPU (pass '
                                             '--dry-run to exercise it on the CPU)']
