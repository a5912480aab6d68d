"""gpu_check.py, the one prepared command for a lent GPU, must not crash before a GPU ever sees it: its dry run
(every part at a toy size, on the CPU) runs end to end here, and on a machine without CUDA the real run refuses
in one line."""
import json
import os
import subprocess
import sys

from conftest import REPO

PARTS = ('versions', 'cifar', 'syncs', 'augment', 'memory', 'bench', 'smoke')


def run(*args):
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'CUDA_VISIBLE_DEVICES': ''}
    return subprocess.run([sys.executable, str(REPO / 'gpu_check.py'), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def test_dry_run_runs_every_part_and_writes_its_json(cifar10_dir, tmp_path):
    r = run('--dry-run', '--data', cifar10_dir, '--out', tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    got = {p: json.loads((tmp_path / f'{p}.json').read_text()) for p in PARTS}
    assert all(g['status'] == 'ok' for g in got.values()), {p: g.get('error') for p, g in got.items()}
    assert got['versions']['torch'] and got['versions']['dry_run'] is True
    assert set(got['syncs']) >= {'default', 'sam', 'sam_fp16', 'pgd'}
    assert set(got['smoke']) - {'status', 'seconds'} == {'imagenet_synthetic', 'imagenet_folder', 'contrastive_sam',
                                                         'robustness_pgd'}
    assert 0 < got['cifar']['eager']['test_acc'] <= 100 and got['bench']['rows']
    assert got['augment']['differing_pixels']['Rotate'] == 0  # the CPU against itself: the plumbing, not the GPU


def test_without_cuda_the_real_run_is_one_line(cifar10_dir, tmp_path):
    r = run('--data', cifar10_dir, '--out', tmp_path)
    assert r.returncode == 1 and 'Traceback' not in r.stderr
    assert r.stderr.strip().splitlines() == ['gpu_check.py: error: no CUDA device: this check is for a GPU (pass '
                                             '--dry-run to exercise it on the CPU)']
