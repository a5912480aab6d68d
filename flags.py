"""The command-line rules every script shares, one place each (issue 34): the range of a flag of the same name,
which flags act only with another, which flags this command line set, and a schedule that would train nothing.
A broken rule is a utils.UserError: one line, exit 1."""
import argparse
import math
import numbers

from utils import UserError

# The upper bounds of flags that mean the same in every script (check_ranges applies them wherever the flag is
# checked): torch.manual_seed takes seeds below 2**64 (a sampler adds the epoch: 2**63 leaves room); probabilities
# and fractions are at most 1; RandAugment has 31 magnitude bins (0..30); an image side above 1024 px is no
# experiment of this repo and would ask for gigabytes per batch (a CIFAR batch of 50 upsampled to 2048 px is
# 2.5 GB); an attack's radius and step in pixel levels /255 are at most the whole range (pgd.py refuses more).
SHARED_AT_MOST = dict(seed=2 ** 63 - 1, img_size=1024, randaug_m=30, scale=1, crop_min=1, crop_pct=1, reprob=1,
                      label_smoothing=1, moco_m=1, adv_eps=255, adv_alpha=255)
SHARED_POSITIVE = {'img_size', 'crop_pct'}  # (crop_pct: a fraction; img_size / crop_pct is resized)


def given(parser, argv, *dests):
    """Which of dests this command line sets (abbreviated too): argv parsed once more with each of them preset to a
    marker that only a flag on the command line replaces (argparse fills only what a namespace lacks)."""
    marker = object()
    ns = parser.parse_args(argv, namespace=argparse.Namespace(**{d: marker for d in dests}))
    return [f'--{d.replace("_", "-")}' for d in dests if getattr(ns, d) is not marker]


def check_ranges(args, positive, non_negative, at_most, stored_in=None, stored=()):
    """Every flag named is a finite number, > 0 (positive) or >= 0, and at most at_most[flag] or SHARED_AT_MOST[flag]
    where given. stored_in: the checkpoint whose stored args filled some flags (a non-number can only come from it);
    stored: flags known to come from it, not from this command line (a range error then names the file too)."""
    at_most = {**SHARED_AT_MOST, **at_most}
    for key in positive + non_negative:
        v, most = getattr(args, key), at_most.get(key, math.inf)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise UserError(f'--{key.replace("_", "-")} must be a number, got {v!r}' + (
                f' (from the args stored in {stored_in}: a damaged or hand-edited file)' if stored_in else ''))
        if not (math.isfinite(v) and (v > 0 if key in positive else v >= 0) and v <= most):
            raise UserError(f'--{key.replace("_", "-")} must be a finite number {"> 0" if key in positive else ">= 0"}'
                            + (f' and <= {most}' if key in at_most else '') + f', got {v}'
                            + (f' (from the args stored in {stored_in})' if key in stored else ''))


def check_shared_ranges(args, *keys):
    """check_ranges for the flags in keys, those set (not None) only: > 0 for SHARED_POSITIVE, else >= 0, and at
    most SHARED_AT_MOST. For scripts whose flags may be unset (taken from a checkpoint later)."""
    keys = [k for k in keys if getattr(args, k, None) is not None]
    check_ranges(args, [k for k in keys if k in SHARED_POSITIVE], [k for k in keys if k not in SHARED_POSITIVE], {})


def refuse_loose(parser, argv, rules):
    """rules: [(on, what, dests)]: when `on` is false, a dest the command line sets acts on nothing: one line
    naming them and `what` (e.g. '--attack'), as train_cifar.py refuses --rho without --sam."""
    for on, what, dests in rules:
        if not on and (loose := given(parser, argv, *dests)):
            raise UserError(f'{", ".join(loose)} only act{"s" * (len(loose) == 1)} with {what}: add it, or leave '
                            f'{"them" if len(loose) > 1 else "it"} out')


def check_lr_not_all_zero(lrs, args, steps, start, schedule, change):
    """Refuse a run whose every optimizer step has LR 0 under its schedule: it would train nothing, then say `done`
    (bad-inputs-2 S01: --epochs 1 of one step, where locuslab's LR at the step's end is the cycle's final 0). lrs: the
    LR of each step this run takes, from its first or resumed step, lazily (the first positive one ends the scan).
    An explicit --lr 0 (args.lr) trains at LR 0 as asked: not refused. steps an epoch, start (> 0: resumed), the
    schedule's name and the flags to change: for the message."""
    n = 0
    for n, lr in enumerate(lrs if args.lr > 0 else (), 1):
        if lr > 0:
            return
    if n:
        left = ' left' * bool(start)
        what = f"the run's only step{left}" if n == 1 else f'all {n} steps{left} of the run'
        raise UserError(f'--epochs {args.epochs} with {steps} step{"s" * (steps > 1)} an epoch: {schedule} gives '
                        f'{what} LR 0 (it would train nothing): {change}')
