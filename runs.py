"""The run folder of a training script: its checkpoints (read safely, written atomically), its lock against a
second run, its resume, and what our last.pt files say about the run that wrote them."""
import fcntl
import io
import json
import os
import tempfile
from argparse import Namespace
from pathlib import Path

import torch

from utils import UserError, one_line

RUN_FILES = ('last.pt', 'metrics.jsonl', 'args.json')  # what a training run writes into its --out
RUN_KEYS = ('model', 'optimizer', 'scaler', 'step', 'history', 'args')  # what every script's last.pt holds


def read_checkpoint(path, flag):
    if not os.path.isfile(path):
        raise UserError(f'{flag} {path}: no such file')
    try:
        with torch.serialization.safe_globals([Namespace]):  # timm's checkpoints hold their args
            return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # zip, pickle, OS or Runtime errors: all mean "unreadable". torch's own text is not
        # shown: it runs to a thousand characters and invites weights_only=False, an unsafe load of untrusted files
        raise UserError(f'{flag} {path} is not a readable checkpoint ({type(e).__name__}); expected a file of '
                        'torch.save: our last.pt, a timm, torchvision or locuslab state_dict')


def written_by(ckpt):
    """Which of our scripts wrote this torch.load()ed last.pt, from the keys only it writes; None: not one of ours."""
    if not (isinstance(ckpt, dict) and set(RUN_KEYS) <= ckpt.keys()):
        return None
    return 'train_imagenet.py' if 'steps_per_epoch' in ckpt else 'train_contrastive.py' if 'moco' in ckpt else \
        'train_cifar.py'


def stored_args(path, flag):  # the flags of the run that wrote `path` if it is one of our last.pt files, else None
    ckpt = None if str(path).endswith('.npz') else read_checkpoint(path, flag)
    return ckpt['args'] if isinstance(ckpt, dict) and set(RUN_KEYS) <= ckpt.keys() else None


NEW_DIRS, LOCKS = [], {}  # folders this process created (removed if a bad input leaves them empty); its locks


def prepare_out(args, lock=True):
    """A training script's --out: refuse to touch another run (unless --overwrite, or --resume of its last.pt), then
    lock_out. args: out, overwrite, resume."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f'--out {out} is a file, not a folder')
    held = [f for f in RUN_FILES if (out / f).exists()]
    if held and not args.overwrite and not (args.resume and Path(args.resume).resolve().parent == out.resolve()):
        raise UserError(f'--out {out} already holds a run ({", ".join(held)}); use --resume {out / "last.pt"}, '
                        'or pick another --out, or pass --overwrite')
    return lock_out(out, lock)  # (with --overwrite the old files stay whole until the new run's first save)


def lock_out(out, lock=True):
    """The --out folder of any script, taken before any work: refused if it is a file; made if absent (and removed
    again, with the parents made for it, by discard_new_dirs if the run ends at a bad input); checked writable now,
    not at the first save; and, lock (under torchrun: rank 0's), OUT/.lock held (flock: released when the process
    ends, however it ends), so that a second run into OUT is refused in one line while this one lives. The one lock
    of the repo: every script that writes into an --out folder calls this (the training scripts via prepare_out).
    -> Path(out)"""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f'--out {out} is a file, not a folder')
    try:
        NEW_DIRS.extend(reversed([d for d in (out, *out.parents) if not d.exists()]))  # (outermost first)
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
        if lock and out.resolve() not in LOCKS:  # (this process may run again into it: a resume, in-process)
            f = open(out / '.lock', 'a')
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                raise
            LOCKS[out.resolve()] = f  # held until this process ends
    except BlockingIOError:
        raise UserError(f'--out {out} is in use by another run now (it holds {out / ".lock"}); pick another --out')
    except OSError as e:
        raise UserError(f'--out {out} is not writable: {e.strerror or e}')
    return out


def discard_new_dirs():
    """After a bad input: remove the folders this process created (deepest first), if nothing but its lock is in
    them."""
    for d in reversed(NEW_DIRS):
        if d.is_dir() and {p.name for p in d.iterdir()} <= {'.lock'}:
            (d / '.lock').unlink(missing_ok=True)
            d.rmdir()


def save_atomic(path, obj):
    """obj into PATH.tmp, then os.replace: a reader sees the old file or the new one. obj: for .pt what torch.save
    takes; .jsonl a list of rows; .json a dict; else a function that writes into the open binary file (np.save,
    fig.savefig). A failed write (a full disk), or a value JSON cannot hold (NaN, inf), removes PATH.tmp, keeps the
    previous PATH, is a UserError; whatever else ends it (Ctrl-C, a writer's bug) removes PATH.tmp too."""
    path = Path(path)
    tmp = path.with_name(path.name + '.tmp')
    kept = f'the previous {path.name} is intact' if path.exists() else 'nothing was saved there'
    try:
        data = None if callable(obj) else encode(path, obj)
    except ValueError:  # json's allow_nan=False: a metric of NaN or inf (computed from nothing, or diverged)
        raise UserError(f'could not write {path}: it holds NaN or inf, which JSON has no number for; {kept}') from None
    try:
        with open(tmp, 'wb') as f:
            obj(f) if data is None else f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        raise UserError(f'could not write {path}: {getattr(e, "strerror", None) or one_line(e)}; {kept}') from None
    finally:
        tmp.unlink(missing_ok=True)


def encode(path, obj):
    """The bytes save_atomic writes for obj into path (.pt: torch.save; .jsonl: a row a line; else JSON)."""
    if path.suffix == '.pt':  # serialised in memory first: a full disk is then f.write's OSError (ENOSPC)
        buf = io.BytesIO()  # (torch.save into a file reports it as its zip writer's RuntimeError)
        torch.save(obj, buf)
        return buf.getbuffer()
    if path.suffix == '.jsonl':
        return ''.join(json.dumps(r, allow_nan=False) + '\n' for r in obj).encode()
    return (json.dumps(obj, indent=1, allow_nan=False) + '\n').encode()


# Flags that describe the machine, not the experiment: on --resume they come from this command line (given, or their
# default on this node: its cores, its GPU's memory, its device), never from the run, which may have run on another
# node (every script has those it defines). Any numerics they move are rounding: compile's and channels_last's fused
# or reordered sums, decode gpu's JPEG decoder; max_micro_batch's split of the global batch (BatchNorm: its batches).
# --log-every, --eval-every, --save-every, --amp shape the run's record, schedule and numerics: the run's, unless given.
MACHINE_FLAGS = ('workers', 'decode', 'compile', 'channels_last', 'max_micro_batch', 'eval_batch_size')


def machine_line(args, saved, log):
    """--resume: announce the MACHINE_FLAGS this process took (those args has), each with the run's where it differs."""
    took = [f'--{k.replace("_", "-")} {v}' + (f' (the run: {saved[k]})' if k in saved and saved[k] != v else '')
            for k, v in ((k, getattr(args, k)) for k in MACHINE_FLAGS if hasattr(args, k))]
    log(f'machine flags from this command line, not the run: {", ".join(took)}')


def restore(ckpt, opt, scaler, args, not_inherited, log):
    """--resume, epoch-based: the optimizer and GradScaler state; logs changed flags (not_inherited: flags never
    taken from the run, MACHINE_FLAGS among them; machine_line names those). -> (epoch, step, history)"""
    changed = [f'--{k.replace("_", "-")} {args.saved_args[k]} -> {v}' for k, v in vars(args).items()
               if k in args.saved_args and k not in not_inherited and args.saved_args[k] != v]
    try:
        load_optimizer_state(opt, ckpt['optimizer'])
    except (ValueError, KeyError, RuntimeError) as e:  # another set of trained parameters: name the flags that moved
        raise UserError(f'--resume {args.resume}: its optimizer state does not fit ({one_line(e)})' + (
            f'; changed since the run: {", ".join(changed)}: pass the run\'s values' if changed else '')) from None
    if ckpt['scaler'] and scaler.is_enabled():
        scaler.load_state_dict(ckpt['scaler'])
    if ckpt['epoch'] >= args.epochs:
        raise UserError(f"{args.resume} has trained all {ckpt['epoch']} epochs; pass --epochs N > {ckpt['epoch']}")
    log(f"resumed {args.resume} at epoch {ckpt['epoch']}, step {ckpt['step']}; "
        f"changed: {', '.join(changed) or 'nothing'}")
    machine_line(args, args.saved_args, log)
    return ckpt['epoch'], ckpt['step'], ckpt['history']


def read_json(path, advice):
    """A JSON file a script or run of ours wrote (args.json, results.json, a cache's meta.json), or one line naming it
    damaged (cut short, hand-edited, not text) and saying what to do."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f'{path} cannot be read ({one_line(e)}); {advice}')


def load_optimizer_state(opt, state):
    """--resume: the optimizer's state (moments, step counts) from the run, its settings from this command line.
    torch's load_state_dict restores every param-group value too (SAM's rho and adaptive, weight_decay, AdamW's
    eps, ...): a changed flag, announced in the `changed:` line and stored in the new last.pt's args, would be
    silently undone. The optimizer was built from this command line's flags: its group values are put back."""
    own = [{k: v for k, v in group.items() if k != 'params'} for group in opt.param_groups]
    opt.load_state_dict(state)
    for group, settings in zip(opt.param_groups, own):  # (load_state_dict checked that the groups correspond)
        group.update(settings)
