"""Train any model of this repo on CIFAR-10/100, with or without SAM, on one device or under torchrun.

    python train_cifar.py --out runs/convmixer       # ConvMixer-256/8 (k5, p2), CIFAR-10, 25 epochs
    torchrun --nproc_per_node 8 train_cifar.py --model vit_s4_cifar --aug basic --sam --out runs/vit
    python train_cifar.py --resume runs/vit/last.pt  # continue; unset flags default to the run's
    python train_cifar.py --recipe finetune --pretrained ViT-B_16.npz --model vit_b16 --img-size 224

Defaults: the README run of locuslab/convmixer-cifar10 (~92.5% in 25 epochs), but the last partial batch of an
epoch is dropped (on 5,000 images at batch 128, locuslab's extra 8-image step costs it ~1.8 points; README),
augmentation is torchvision's tensor ops batched on the device (augment.py), autocast is bf16 on a GPU that has it,
CIFAR-100 has its own mean/std. The data lives on the device as uint8. Each epoch's random draws are seeded
from (--seed, epoch, rank): --resume at an epoch boundary continues bit-identically.
"""
import argparse
from argparse import ArgumentDefaultsHelpFormatter, Namespace
import ast
import json
import math
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torchvision.models.resnet import BasicBlock

import convmixer
import mixer
import vit
from augment import make_augment, normalize
from pgd import pgd
from sam import SAM, first_pass, second_pass

NUM_CLASSES = {'cifar10': 10, 'cifar100': 100}
# Per-channel mean/std of the training images (CIFAR-10's are the locuslab script's).
MEAN = {'cifar10': (0.4914, 0.4822, 0.4465), 'cifar100': (0.5071, 0.4865, 0.4409)}
STD = {'cifar10': (0.2471, 0.2435, 0.2616), 'cifar100': (0.2673, 0.2564, 0.2762)}
MODEL_FILES = (convmixer, vit, mixer)
# Defaults of the flags left unset. finetune: the ViT paper's CIFAR fine-tuning (Dosovitskiy et al. 2021, App. B.1.1;
# vit_jax configs/common.py, train.py, input_pipeline.py): SGD momentum 0.9, batch 512, 10,000 steps (~100 epochs),
# warm-up then cosine, Inception crop (square here) + flip, inputs (x - 0.5) / 0.5 as the released weights expect.
RECIPES = {'locuslab': {}, 'finetune': dict(epochs=100, lr=0.03, wd=0.0, clip_grad=1.0, scale=0.05, randaug_n=0)}
WARMUP = 0.05  # finetune: the warm-up's share of all steps (500 of 10,000)
RUN_FILES = ('last.pt', 'metrics.jsonl', 'args.json')
RUN_KEYS = ('model', 'optimizer', 'scaler', 'epoch', 'step', 'history', 'args')  # what last.pt holds
NOT_INHERITED = ('resume', 'checkpoint', 'eval_only', 'out', 'overwrite', 'pretrained')
NO_STEP = 2 ** 62  # "no step yet" for the first non-finite loss


class UserError(Exception):
    """A mistake in the command line or in the files it names: one line on stderr, exit 1."""


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.partition('\n')[0], formatter_class=ArgumentDefaultsHelpFormatter)
    p.add_argument('--recipe', default='locuslab', choices=sorted(RECIPES), help='locuslab (AdamW, one cycle: '
                   f'as shown) or finetune (ViT paper App. B.1.1: SGD, warm-up + cosine, {RECIPES["finetune"]})')
    g = p.add_argument_group('data')
    g.add_argument('--data', default='./data', metavar='DIR', help="torchvision's CIFAR or DIR/{train,test}/<class>/*")
    g.add_argument('--dataset', default='cifar10', choices=sorted(NUM_CLASSES), help='CIFAR-100: fine labels')
    g.add_argument('--train-subset', type=int, default=0, metavar='N', help='N class-balanced images; 0 = all')
    g.add_argument('--test-subset', type=int, default=0, metavar='N', help='N class-balanced images; 0 = all')
    g.add_argument('--img-size', type=int, default=32, metavar='PX', help='bilinear upsampling after augmentation')
    g.add_argument('--classes', type=int, nargs='+', metavar='C', help='only these classes (train and test), '
                   'relabelled 0..k-1 in this order: transfer splits; with --pretrained the head is new')
    g = p.add_argument_group('model')
    g.add_argument('--model', default='convmixer_256_8', help='a config of convmixer.py, vit.py, mixer.py; resnet18/20')
    g.add_argument('--model-kw', nargs='+', action='extend', default=[], metavar='KEY=VALUE',
                   help='constructor overrides (Python literals), e.g. dim=128 depth=4; classes come from --dataset')
    g.add_argument('--pretrained', metavar='PATH', help='fine-tune from weights (as --checkpoint): a head of other '
                   'classes is replaced by zeros, a ViT pos_embed resampled (ViT paper Sec. 3.2)')
    g = p.add_argument_group('optimisation ("locuslab": that script\'s own argparse default)')
    g.add_argument('--epochs', type=int, default=25)
    g.add_argument('--batch-size', type=int, default=512, help='global batch: images per optimizer step')
    g.add_argument('--lr', type=float, default=0.05, help="peak LR; locuslab's one cycle: 0 -> lr at epoch E*2//5 "
                   '-> lr/20 at E*4//5 -> 0 at E, set every step (its --lr-max; locuslab 0.01)')
    g.add_argument('--wd', type=float, default=0.005, help='decoupled weight decay (locuslab 0.01)')
    g.add_argument('--label-smoothing', type=float, default=0.0)
    g.add_argument('--clip-grad', type=float, default=0.0, help='global grad-norm clip (SAM: of g_SAM); 0 = off')
    g.add_argument('--sam', action='store_true', help='Sharpness-Aware Minimization (Foret et al. 2021)')
    g.add_argument('--rho', type=float, default=0.05, help='SAM neighbourhood radius')
    g.add_argument('--adaptive', action='store_true', help='ASAM (Kwon et al. 2021): eps-hat scaled by |w|')
    g.add_argument('--adv', choices=['pgd'], help='train on PGD examples (Madry et al. 2018, pgd.py)')
    g.add_argument('--adv-eps', type=float, default=8.0, help='L-inf radius, in pixel levels /255')
    g.add_argument('--adv-alpha', type=float, default=2.0, help='PGD step size, in pixel levels /255')
    g.add_argument('--adv-steps', type=int, default=7, help='PGD steps (Madry et al.: 7 on CIFAR)')
    g = p.add_argument_group('augmentation (augment.py: on the device, drawn per image)')
    g.add_argument('--aug', default='strong', choices=['strong', 'basic'], help="strong: locuslab's crop, flip, "
                   "RandAugment, jitter, erasing; basic: the SAM paper's 4-px pad-and-crop + flip")
    g.add_argument('--scale', type=float, default=1.0, help='RandomResizedCrop min area (locuslab 0.75)')
    g.add_argument('--randaug-n', type=int, default=2, help='RandAugment ops per image (locuslab 1)')
    g.add_argument('--randaug-m', type=int, default=12, help='RandAugment magnitude 0..30 (locuslab 8)')
    g.add_argument('--jitter', type=float, default=0.0, help='ColorJitter strength (locuslab 0.1)')
    g.add_argument('--reprob', type=float, default=0.0, help='RandomErasing probability (locuslab 0.25)')
    g = p.add_argument_group('system')
    g.add_argument('--amp', default='auto', choices=['auto', 'bf16', 'fp16', 'off'],
                   help='auto: bf16 where the GPU has it, else off')
    g.add_argument('--channels-last', action='store_true', help='NHWC memory format (faster convs on GPU)')
    g.add_argument('--compile', action='store_true', help='torch.compile the model')
    g.add_argument('--seed', type=int, default=0, help='seeds the init, the data order and the augmentation')
    g.add_argument('--eval-batch-size', type=int, default=1024, help='images per rank per eval step')
    g.add_argument('--log-every', type=int, default=50, help='a progress line every N steps; 0 = per epoch')
    g = p.add_argument_group('run folder and checkpoints')
    g.add_argument('--out', metavar='DIR', help="default runs/cifar, or the --resume file's folder")
    g.add_argument('--overwrite', action='store_true', help='replace the run already in --out')
    g.add_argument('--resume', metavar='PATH', help='continue this last.pt; unset flags default to its run')
    g.add_argument('--eval-only', action='store_true', help='evaluate --checkpoint on the test set and exit')
    g.add_argument('--checkpoint', metavar='PATH', help='for --eval-only: our last.pt (its model, model-kw, dataset, '
                   'img-size, recipe are the defaults), a timm or locuslab file, or an official .npz')
    p.set_defaults(**RECIPES[p.parse_known_args(argv)[0].recipe])  # (a resumed run's own values win below)
    args = p.parse_args(argv)
    # One of our runs: what it stored is the default of every flag not given (argparse fills only unset ones).
    run = args.resume or (args.checkpoint if args.eval_only and not str(args.checkpoint).endswith('.npz') else None)
    ckpt = read_checkpoint(run, '--resume' if args.resume else '--checkpoint') if run else None
    if isinstance(ckpt, dict) and all(k in ckpt for k in RUN_KEYS):
        keep = [k for k in vars(args) if k not in NOT_INHERITED] if args.resume else \
            ['model', 'model_kw', 'dataset', 'img_size', 'recipe', 'classes']
        args = p.parse_args(argv, namespace=Namespace(**{k: ckpt['args'][k] for k in keep if k in ckpt['args']}))
        args.saved_args = ckpt['args']
    elif args.resume:
        raise UserError(f'--resume {run} is not a train_cifar.py checkpoint (it lacks some of {RUN_KEYS})')
    args.out = args.out or (str(Path(args.resume).parent) if args.resume else 'runs/cifar')
    check_ranges(args, ['epochs', 'batch_size', 'eval_batch_size', 'img_size', 'adv_steps', 'scale'],
                 ['train_subset', 'test_subset', 'log_every', 'randaug_n', 'randaug_m', 'seed', 'lr', 'wd', 'rho',
                  'clip_grad', 'jitter', 'label_smoothing', 'reprob', 'adv_eps', 'adv_alpha'],
                 dict(randaug_m=30, scale=1, reprob=1, label_smoothing=1))
    if args.eval_only != bool(args.checkpoint) or (args.eval_only and args.resume):
        raise UserError('--eval-only evaluates --checkpoint PATH (not --resume); --checkpoint is for --eval-only')
    if args.pretrained and (args.resume or args.eval_only):
        raise UserError('--pretrained starts a new run from weights; --resume and --eval-only load their own')
    if args.resume and args.overwrite:
        raise UserError('--resume continues a run; --overwrite would start a new one in its folder')
    if args.classes and not (len(set(args.classes)) == len(args.classes) >= 2 and
                             all(0 <= c < NUM_CLASSES[args.dataset] for c in args.classes)):
        raise UserError(f'--classes needs 2 or more distinct labels of {args.dataset} (0..'
                        f'{NUM_CLASSES[args.dataset] - 1}), got {args.classes}')
    return args


def check_ranges(args, positive, non_negative, at_most):
    """Every flag named is a finite number, > 0 (positive) or >= 0, and at most at_most[flag] where given."""
    for key in positive + non_negative:
        v, most = getattr(args, key), at_most.get(key, math.inf)
        if not (math.isfinite(v) and (v > 0 if key in positive else v >= 0) and v <= most):
            raise UserError(f'--{key.replace("_", "-")} must be a finite number {"> 0" if key in positive else ">= 0"}'
                            + (f' and <= {most}' if key in at_most else '') + f', got {v}')


def parse_model_kw(items):
    """['dim=128', 'activation=relu'] -> {'dim': 128, 'activation': 'relu'} (Python literals, else strings)."""
    out = {}
    for key, sep, value in (item.partition('=') for item in items):
        if not sep or not key.isidentifier():
            raise UserError(f'--model-kw expects KEY=VALUE, got {key + sep + value!r}')
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def load_cifar(root, dataset, train, subset=0, classes=None):
    """uint8 images (N, 3, 32, 32), int64 labels (N,): from an image folder root/{train,test}/<class>/*, else
    from torchvision's CIFAR folder in root (downloaded when absent). subset: the first subset/C per class.
    classes: only these, relabelled 0..k-1 in this order."""
    root, num_classes, split = Path(root), NUM_CLASSES[dataset], 'train' if train else 'test'
    if not ((root / 'train').is_dir() and (root / 'test').is_dir()):
        cls = {'cifar10': torchvision.datasets.CIFAR10, 'cifar100': torchvision.datasets.CIFAR100}[dataset]
        try:
            ds = cls(root, train=train, download=True)  # a no-op when the files are there and pass their md5
        except (OSError, RuntimeError) as e:  # offline (URLError is an OSError), or a download failing its md5
            found = 'files that fail their md5 check' if (root / cls.base_folder).exists() else f'no {dataset}'
            raise UserError(f'{root} holds {found}, and torchvision could not download it ({one_line(e)}). Fetch '
                            f'{cls.url} into {root}, or pass --data DIR with DIR/train/<class>/*, DIR/test/<class>/*')
        labels = torch.tensor(ds.targets)
        keep = balanced_subset(labels, subset, classes or num_classes)
        return torch.from_numpy(ds.data[keep.numpy()]).permute(0, 3, 1, 2).contiguous(), relabel(labels[keep], classes)
    try:  # torchvision's ImageFolder: the sorted class folders, their index is the label
        ds = torchvision.datasets.ImageFolder(root / split)
    except FileNotFoundError as e:  # an empty class folder, or none at all
        raise UserError(f'{root / split}: {e}')
    train_classes = torchvision.datasets.folder.find_classes(root / 'train')[0]
    if ds.classes != train_classes or len(ds.classes) != num_classes:
        raise UserError(f'{root / split} must hold the {num_classes} class folders of {root / "train"}; only in '
                        f'{split}: {sorted(set(ds.classes) - set(train_classes))}, only in train: '
                        f'{sorted(set(train_classes) - set(ds.classes))}')
    labels = torch.tensor(ds.targets)
    keep = balanced_subset(labels, subset, classes or num_classes)
    x = []
    for path, _ in (ds.samples[i] for i in keep):  # ~30 us per 32x32 image
        try:
            x.append(np.asarray(ds.loader(path)))  # PIL, as RGB
        except (OSError, SyntaxError, ValueError) as e:  # unreadable, truncated, a broken PNG
            raise UserError(f'cannot decode {path}: {e}')
        if x[-1].shape != (32, 32, 3):
            raise UserError(f'{path} is {x[-1].shape[1]}x{x[-1].shape[0]} px; CIFAR images are 32x32')
    return torch.from_numpy(np.stack(x)).permute(0, 3, 1, 2).contiguous(), relabel(labels[keep], classes)


def balanced_subset(labels, n, classes):
    """Sorted indices of the first n // k (+1 for the first n % k) images of each of k classes (a list, or
    range(classes)); n = 0: all of their images."""
    classes = range(classes) if isinstance(classes, int) else classes
    quota = [n // len(classes) + (j < n % len(classes)) if n else len(labels) for j in range(len(classes))]
    picked = [(labels == c).nonzero()[:q, 0] for c, q in zip(classes, quota)]
    if n and any(len(idx) < q for idx, q in zip(picked, quota)):
        raise UserError(f'a class-balanced subset of {n} images needs {max(quota)} of every class; some have fewer')
    return torch.cat(picked).sort().values


def relabel(y, classes):  # --classes 5 6 7: labels 5, 6, 7 -> 0, 1, 2
    return torch.tensor([classes.index(c) for c in y.tolist()], dtype=torch.int64) if classes else y


def resnet(name, num_classes, stem_stride=1):
    """resnet20: He et al. 2016 Sec. 4.2, 3x3 conv to 16, 3 stages of 3 BasicBlocks (16/32/64 channels at
    32/16/8 px), pool, linear: 0.27M params; stem_stride=2 (a deviation, for geometry.py table1's CPU budget)
    halves every map: 4x fewer FLOPs. resnet18: torchvision's with the CIFAR stem (3x3, stride 1, no pool)."""
    if name == 'resnet18':
        model = torchvision.models.resnet18(num_classes=num_classes)
        model.conv1, model.maxpool = nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.Identity()
    else:
        layers = [nn.Conv2d(3, 16, 3, stem_stride, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
        for c_in, c in ((16, 16), (16, 32), (32, 64)):
            # option (A) where the width doubles: subsample by 2, zero-pad the new channels (dims 1-3 of the batch)
            down = nn.Sequential(nn.MaxPool2d(1, 2), nn.ConstantPad3d((0, 0, 0, 0, 0, c - c_in), 0.0))
            layers += [BasicBlock(c_in, c, c // c_in, down if c > c_in else None), BasicBlock(c, c), BasicBlock(c, c)]
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))
    for m in model.modules():  # He init, as torchvision's ResNet
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
    return model


def build_model(name, num_classes, model_kw=None, img_size=32):
    """ImageNet configs at 32 px take ViT/Mixer patch p/4, ConvMixer p/7; model_kw overrides last. A bad setting is
    a UserError naming it (the constructors raise TypeError/ValueError; a ConvMixer's patch is checked here)."""
    model_kw = dict(model_kw or {})
    if 'num_classes' in model_kw:
        raise UserError('--model-kw num_classes: the class count comes from --dataset')
    if name in ('resnet18', 'resnet20'):
        if model_kw and not (name == 'resnet20' and model_kw.keys() == {'stem_stride'}
                             and model_kw['stem_stride'] in (1, 2)):
            raise UserError(f'--model-kw {", ".join(model_kw)}: resnet18 takes none; resnet20 only stem_stride=1 or 2')
        return resnet(name, num_classes, **model_kw)
    module = next((m for m in MODEL_FILES if name in m.configs), None)
    if module is None:
        names = [n for m in MODEL_FILES for n in m.configs] + ['resnet18', 'resnet20']
        raise UserError(f"unknown model {name!r}; valid names: {', '.join(names)}")
    cfg, over = module.configs[name], {'num_classes': num_classes}
    if module is not convmixer:  # (a ConvMixer takes any size)
        over['img_size'] = img_size
    if img_size == 32 and (cfg['patch_size'] >= 7 if module is convmixer else cfg.get('img_size') != 32):
        over['patch_size'] = cfg['patch_size'] // 7 if module is convmixer else max(1, cfg['patch_size'] // 4)
    patch = {**cfg, **over, **model_kw}['patch_size']
    if module is convmixer and isinstance(patch, int) and patch > 0 and img_size % patch:
        raise UserError(f'--model-kw patch_size={patch} does not divide {img_size} px: the border would be dropped')
    try:
        return module.create(name, **{**over, **model_kw})
    except (TypeError, ValueError) as e:  # an unknown key (TypeError names it), an impossible shape
        raise UserError(f'--model-kw does not fit {name}: {e}')


def load_weights(model, path, finetune=False, new_head=False):
    """Load strictly our last.pt ('model'), a timm or locuslab file ('state_dict' or bare; 'module.', '_orig_mod.'
    stripped; locuslab keys converted) or an official JAX .npz (ViT, Mixer). finetune=True also takes weights
    trained on other classes (new_head, or another count) or at another resolution: the head is replaced, a
    ViT's pos_embed resampled."""
    if str(path).endswith('.npz'):  # official JAX weights: a ViT or an MLP-Mixer
        try:
            sd = (vit if isinstance(model, vit.VisionTransformer) else mixer).load_npz(path)
        except Exception as e:  # a missing file, numpy's, zip's or the converter's errors: "unreadable"
            raise UserError(f'cannot read {path}: {type(e).__name__}: {one_line(e)}')
    else:
        ckpt = read_checkpoint(path, 'weights')
        sd = ckpt.get('model', ckpt.get('state_dict', ckpt)) if isinstance(ckpt, dict) else None
        if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
            raise UserError(f'{path} holds no state_dict (under "model", "state_dict" or bare)')
        for prefix in ('module.', '_orig_mod.'):
            consume_prefix_in_state_dict_if_present(sd, prefix)
        sd = convmixer.from_locuslab(sd) if isinstance(model, convmixer.ConvMixer) else sd
    own = model.state_dict()
    if finetune:  # the classifier (the last Linear: head, fc) starts at zero (ViT paper Sec. 3.2) for new classes
        head = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
        if new_head or any(k not in sd or sd[k].shape != own[k].shape for k in (f'{head}.weight', f'{head}.bias')):
            sd.update({k: torch.zeros_like(own[k]) for k in (f'{head}.weight', f'{head}.bias')})  # (or headless)
        if isinstance(model, vit.VisionTransformer) and 'pos_embed' in sd:  # Sec. 3.2: 2-D interpolation
            try:
                sd['pos_embed'] = vit.resample_pos_embed(sd['pos_embed'], model.grid, model.num_prefix_tokens)
            except ValueError as e:  # e.g. a class token in one and not in the other
                raise UserError(f'{path}: {e}')
        k = 'blocks.0.mlp_tokens.fc1.weight'  # (D_S, S): the token-mixing MLP is tied to the token count S
        if isinstance(model, mixer.MlpMixer) and k in sd and sd[k].shape[1] != own[k].shape[1]:
            raise UserError(f'{path} is a Mixer of {sd[k].shape[1]} tokens, this one has {own[k].shape[1]}: its '
                            'token-mixing MLP is tied to the token count; pick --img-size / patch_size to match')
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:  # torch names the missing and unexpected keys and both shapes
        raise UserError(f'{path} does not fit this --model / --model-kw / --dataset: {one_line(e)}')


def read_checkpoint(path, flag):
    if not os.path.isfile(path):
        raise UserError(f'{flag} {path}: no such file')
    try:
        with torch.serialization.safe_globals([Namespace]):  # timm's checkpoints hold their args
            return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # zip, pickle, OS or Runtime errors: all mean "unreadable"
        raise UserError(f'{flag} {path} is not a readable checkpoint ({type(e).__name__}: {one_line(e)})')


def lr_at(t, epochs, lr, recipe='locuslab'):
    """The LR at t epochs: locuslab's one cycle (integer breakpoints); finetune: vit_jax's warm-up x cosine."""
    if recipe == 'finetune':
        warm = WARMUP * epochs
        return lr * min(1.0, t / warm) * 0.5 * (1 + math.cos(math.pi * min(max((t - warm) / (epochs - warm), 0), 1)))
    return float(np.interp(t, [0, epochs * 2 // 5, epochs * 4 // 5, epochs], [0, lr, lr / 20, 0]))


def epoch_seed(*key):  # a 32-bit seed that depends on every item of key (seed, epoch, rank)
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0])


def prepare_out(args):
    """Refuse to touch another run, and fail now, not at the first save, if --out cannot be written."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f'--out {out} is a file, not a folder')
    held = [f for f in RUN_FILES if (out / f).exists()]
    if held and not args.overwrite and not (args.resume and Path(args.resume).resolve().parent == out.resolve()):
        raise UserError(f'--out {out} already holds a run ({", ".join(held)}); use --resume {out / "last.pt"}, '
                        'or pick another --out, or pass --overwrite')
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise UserError(f'--out {out} is not writable: {e.strerror or e}')
    return out  # (with --overwrite the old files stay whole until the new run's first epoch replaces them)


def save_atomic(path, obj):
    """obj into PATH.tmp (.pt: torch.save; .jsonl: a list of rows; .json: a dict), then os.replace. A
    failed write (a full disk) removes PATH.tmp, keeps the previous PATH and ends the run with one line."""
    tmp = path.with_name(path.name + '.tmp')
    try:
        with open(tmp, 'wb') as f:
            if path.suffix == '.pt':
                torch.save(obj, f)  # into a file object: a full disk comes back as OSError with its errno
            else:
                rows = obj if path.suffix == '.jsonl' else [obj]
                f.write(''.join(json.dumps(r, allow_nan=False) + '\n' for r in rows).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        kept = f'the previous {path.name} is intact' if path.exists() else 'nothing was saved there'
        raise UserError(f'could not write {path}: {getattr(e, "strerror", None) or one_line(e)}; {kept}')
    finally:
        tmp.unlink(missing_ok=True)


def one_line(e):
    return ' '.join(str(e).split())


def fmt_time(s):
    s = int(round(s))
    return f'{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}' if s >= 3600 else f'{s // 60}:{s % 60:02d}'


def resize(x, img_size):  # (B, 3, 32, 32) -> (B, 3, img_size, img_size), bilinear, on the device
    return x if x.shape[-1] == img_size else F.interpolate(x, size=img_size, mode='bilinear', antialias=False)


def evaluate(model, x_u8, y, mean, std, batch_size=1024, rank=0, world=1, autocast=None, channels_last=False,
             img_size=32):
    """score() on uint8 images, exact under DDP: rank r takes the images [r*N/W, (r+1)*N/W)."""
    lo, hi = len(y) * rank // world, len(y) * (rank + 1) // world
    fmt = torch.channels_last if channels_last else torch.preserve_format
    batches = ((resize(normalize(xb, mean, std), img_size).to(memory_format=fmt), yb)
               for xb, yb in zip(x_u8[lo:hi].split(batch_size), y[lo:hi].split(batch_size)))
    return score(model, batches, autocast, world > 1)


@torch.no_grad()
def score(model, batches, autocast=None, distributed=False):
    """Mean loss and top-1/top-5 accuracy (%) of model (in eval mode) on (x, y) batches; distributed: over all ranks."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=next(model.parameters()).device)  # loss, top-1, top-5, images
    for x, y in batches:
        with autocast or nullcontext():
            out = model(x).float()
        hits = out.topk(min(5, out.shape[1]), dim=1).indices == y[:, None]
        sums[:3] += torch.stack([F.cross_entropy(out, y, reduction='sum').double(), hits[:, 0].sum(),
                                 hits.any(1).sum()])
        sums[3] += len(y)  # a Python number: no host-to-device copy (which would sync)
    if distributed:
        dist.all_reduce(sums)
    loss, top1, top5, n = sums.tolist()
    return {'loss': loss / n, 'top1': 100 * top1 / n, 'top5': 100 * top5 / n, 'correct': int(top1), 'n': int(n)}


def check_finite(first_bad, steps, saved, unit='epoch', distributed=False):
    """Stop on divergence. first_bad: the first step with a non-finite loss, or NO_STEP; reading it syncs, and
    distributed (a collective, on every rank) takes the first of all ranks."""
    if distributed:
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
    if (bad := int(first_bad)) != NO_STEP:
        raise UserError(f'training diverged: the loss is not finite from epoch {(bad - 1) // steps + 1}, step '
                        f'{(bad - 1) % steps + 1}/{steps} on; nothing was saved after it; '
                        f'{since_checkpoint(saved, unit)}. Lower --lr or clip with --clip-grad')


def since_checkpoint(saved, unit='epoch'):
    """Where a stopped run goes on from. saved: (path, epoch or step) of its last checkpoint; path None: none."""
    path, at = saved
    return f'the last checkpoint is {path} ({unit} {at}); continue with --resume {path}' if path else \
        'no checkpoint was saved'


def leave(distributed):
    if distributed:
        dist.barrier()  # rank 0 may still be writing: leave together (gloo aborts a one-sided teardown)
        dist.destroy_process_group()


def train_row(epoch, step, lr, sums, images, t_row, t_start):
    """A metrics.jsonl row of the steps since the last one: sums = (loss sum, correct, images) on the device."""
    loss_sum, correct, count = sums.tolist()
    return {'kind': 'train', 'epoch': epoch + 1, 'step': step, 'lr': lr, 'loss': loss_sum / count, 'acc': 100 * correct
            / count, 'img_per_s': images / (time.time() - t_row), 'elapsed_s': time.time() - t_start}


def restore(ckpt, opt, scaler, args, not_inherited, log):
    """--resume: last.pt's optimizer and GradScaler state; prints the flags that differ. -> (epoch, step, history)"""
    try:
        opt.load_state_dict(ckpt['optimizer'])
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(f'--resume {args.resume}: its optimizer state does not fit ({one_line(e)})')
    if ckpt['scaler'] and scaler.is_enabled():
        scaler.load_state_dict(ckpt['scaler'])
    if ckpt['epoch'] >= args.epochs:
        raise UserError(f"{args.resume} has trained all {ckpt['epoch']} epochs; pass --epochs N > {ckpt['epoch']}")
    changed = [f'--{k.replace("_", "-")} {args.saved_args[k]} -> {v}' for k, v in vars(args).items()
               if k in args.saved_args and k not in not_inherited and args.saved_args[k] != v]
    log(f"resumed {args.resume} at epoch {ckpt['epoch']}, step {ckpt['step']}; "
        f"changed: {', '.join(changed) or 'nothing'}")
    return ckpt['epoch'], ckpt['step'], ckpt['history']


def main(argv=None):
    args, t_start = get_args(argv), time.time()
    rank, local_rank = (int(os.environ.get(k, 0)) for k in ('RANK', 'LOCAL_RANK'))  # torchrun's environment
    world = int(os.environ.get('WORLD_SIZE', 1))
    master, ddp, use_cuda = rank == 0, world > 1, torch.cuda.is_available()
    device = torch.device('cuda', local_rank) if use_cuda else torch.device('cpu')
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if not args.eval_only and args.batch_size % world:
        raise UserError(f'--batch-size {args.batch_size} (global) does not divide by the world size {world}')
    bf16 = use_cuda and torch.cuda.is_bf16_supported()
    batch, amp = args.batch_size // world, args.amp if args.amp != 'auto' else ('bf16' if bf16 else 'off')
    autocast = torch.autocast(device.type, {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp), amp != 'off')
    log = print if master else (lambda *a, **k: None)
    torch.manual_seed(args.seed)  # the same initial weights on every rank; the model first: a bad name fails at once
    num_classes = len(args.classes) if args.classes else NUM_CLASSES[args.dataset]
    raw = build_model(args.model, num_classes, parse_model_kw(args.model_kw), args.img_size)
    if weights := args.checkpoint or args.resume or args.pretrained:  # (--checkpoint: --eval-only)
        load_weights(raw, weights, finetune=bool(args.pretrained), new_head=bool(args.classes))
    ckpt = read_checkpoint(args.resume, '--resume') if args.resume else None  # optimizer, scaler, history
    out_dir = prepare_out(args) if master and not args.eval_only else Path(args.out)
    raw.to(device, memory_format=torch.channels_last if args.channels_last else torch.preserve_format)
    if ddp:
        dist.init_process_group('nccl' if use_cuda else 'gloo')
    if ddp and not master:
        dist.barrier()  # rank 0 downloads (if needed) before the others look
    test_x, test_y = (t.to(device) for t in load_cifar(args.data, args.dataset, False, args.test_subset, args.classes))
    if not args.eval_only:
        train_x, train_y = (t.to(device) for t in load_cifar(args.data, args.dataset, True, args.train_subset,
                                                             args.classes))
    if ddp and master:
        dist.barrier()
    norm = ((0.5,) * 3,) * 2 if args.recipe == 'finetune' else (MEAN[args.dataset], STD[args.dataset])
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in norm)
    eval_model = torch.compile(raw) if args.compile else raw  # not DDP: the ranks see different counts
    if args.eval_only:
        r = evaluate(eval_model, test_x, test_y, mean, std, args.eval_batch_size, rank, world, autocast,
                     args.channels_last, args.img_size)
        log(f'eval | {args.checkpoint} | {args.model} on {args.dataset} | test loss {r["loss"]:.4f} acc '
            f'{r["top1"]:.2f}% ({r["correct"]}/{r["n"]}) top-5 {r["top5"]:.2f}% | world {world}', flush=True)
        leave(ddp)
        return
    if len(train_y) < args.batch_size:
        raise UserError(f'the training set has {len(train_y)} images, fewer than --batch-size {args.batch_size}')
    steps = len(train_y) // args.batch_size  # the last partial batch is dropped (module docstring)
    aug_kw = {k: getattr(args, k) for k in ('aug', 'scale', 'randaug_n', 'randaug_m', 'jitter', 'reprob', 'seed')}
    augment = make_augment(**aug_kw, mean=norm[0], std=norm[1], device=device)
    base, kw = (torch.optim.SGD, dict(momentum=0.9)) if args.recipe == 'finetune' else (torch.optim.AdamW, {})
    kw.update(lr=args.lr, weight_decay=args.wd)
    opt = SAM(raw.parameters(), base, rho=args.rho, adaptive=args.adaptive, **kw) if args.sam else \
        base(raw.parameters(), **kw)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == 'fp16')  # bf16 and fp32 need no scaling
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    model = nn.parallel.DistributedDataParallel(raw, device_ids=[local_rank] if use_cuda else None) if ddp else raw
    fwd = torch.compile(model) if args.compile else model
    start_epoch, step, history = 0, 0, []
    if ckpt:
        start_epoch, step, history = restore(ckpt, opt, scaler, args, NOT_INHERITED, log)
    run_args = {k: v for k, v in vars(args).items() if k != 'saved_args'}
    log(f'{args.model} {" ".join(args.model_kw)} ({sum(p.numel() for p in raw.parameters()):,} params) on '
        f'{args.dataset}: {len(train_y):,} train / {len(test_y):,} test at {args.img_size} px | {args.epochs} epochs '
        f'x {steps} steps of {args.batch_size} ({world} x {batch}) | {base.__name__} lr {args.lr} wd {args.wd}'
        f'{f" | SAM rho {args.rho}" * args.sam}{f" | PGD-{args.adv_steps} eps {args.adv_eps:g}/255" * bool(args.adv)}'
        f' | aug {args.aug} | amp {amp} | {device}')
    last, epoch, saved = out_dir / 'last.pt', start_epoch, (args.resume, start_epoch)  # saved: the last good one
    first_bad = torch.full((), NO_STEP, device=device)  # first non-finite loss: kept on the device, no sync
    t_loop = time.time()
    try:
        for epoch in range(start_epoch, args.epochs):
            # (seed, epoch, rank): each rank its own augmentation and dropout; one data order, rank r takes its slice
            torch.manual_seed(epoch_seed(args.seed, epoch, rank))
            augment.generator.manual_seed(epoch_seed(args.seed, epoch, rank))
            perm = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(epoch_seed(args.seed, epoch)))
            perm, t_epoch, t_row, row_start = perm.to(device), time.time(), time.time(), 0
            sums = torch.zeros(2, 3, dtype=torch.float64, device=device)  # (since the last row, epoch) x
            model.train()                                                  # (loss sum, correct, images)
            for i in range(steps):
                lr = lr_at(epoch + (i + 1) / steps, args.epochs, args.lr, args.recipe)
                for group in opt.param_groups:
                    group['lr'] = lr
                idx = perm[i * args.batch_size + rank * batch:i * args.batch_size + (rank + 1) * batch]
                x, y = resize(augment(train_x[idx]), args.img_size), train_y[idx]
                if args.adv:  # PGD on [0, 1] pixels (normalised inside), made at w in eval mode: no BatchNorm update
                    with autocast:
                        x = (pgd(eval_model, x * std + mean, y, args.adv_eps / 255, args.adv_alpha / 255,
                                 args.adv_steps, normalize=lambda v: (v - mean) / std) - mean) / std
                x = x.contiguous(memory_format=torch.channels_last) if args.channels_last else x
                # SAM (Alg. 1, sam.py): eps-hat and BatchNorm statistics from this rank's first pass alone (m-sharpness)
                with first_pass(model) if args.sam else nullcontext():
                    with autocast:
                        out = fwd(x)
                        loss = criterion(out, y)
                    scaler.scale(loss).backward()
                if args.sam:
                    opt.first_step(zero_grad=True)  # w <- w + eps-hat
                    with second_pass(model):
                        with autocast:
                            loss_sam = criterion(fwd(x), y)
                        scaler.scale(loss_sam).backward()  # g_SAM, all-reduced under DDP
                if args.clip_grad > 0:
                    scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(raw.parameters(), args.clip_grad)
                scaler.step(opt)  # SAM: w restored from its copy, then the base step with g_SAM
                scaler.update()
                opt.zero_grad(set_to_none=True)
                step += 1
                loss = loss.detach().double()  # (fp16 overflow is in the gradients, and GradScaler skips it)
                first_bad = torch.where(loss.isfinite(), first_bad, first_bad.clamp(max=step))
                sums[:, :2] += torch.stack([loss * len(y), (out.detach().argmax(1) == y).sum()])
                sums[:, 2] += len(y)
                if args.log_every and (i + 1) % args.log_every == 0 and i + 1 < steps:
                    if master:  # (rank 0's images: no collective mid-epoch; reading first_bad is the host sync)
                        check_finite(first_bad, steps, saved)
                        history.append(train_row(epoch, step, lr, sums[0], (i + 1 - row_start) * args.batch_size,
                                                 t_row, t_start))
                        save_atomic(out_dir / 'metrics.jsonl', history)
                        eta = (time.time() - t_loop) / (step - start_epoch * steps) * (args.epochs * steps - step)
                        print(f'ep {epoch + 1}/{args.epochs} step {i + 1}/{steps} | loss {history[-1]["loss"]:.4f} | '
                              f'lr {lr:.2e} | {history[-1]["img_per_s"]:,.0f} img/s | eta {fmt_time(eta)}', flush=True)
                    sums[0], t_row, row_start = 0, time.time(), i + 1  # on every rank: the next row's window
            if ddp:
                dist.all_reduce(sums)
            check_finite(first_bad, steps, saved, distributed=ddp)
            history.append(train_row(epoch, step, lr, sums[0], (steps - row_start) * args.batch_size, t_row, t_start))
            if ddp:  # evaluate (and save) exactly rank 0's BatchNorm statistics on every rank
                for buf in raw.buffers():
                    dist.broadcast(buf, 0)
            r = evaluate(eval_model, test_x, test_y, mean, std, args.eval_batch_size, rank, world, autocast,
                         args.channels_last, args.img_size)
            history.append({'kind': 'eval', 'epoch': epoch + 1, 'step': step, **r, 'elapsed_s': time.time() - t_start})
            loss_sum, correct, count = sums[1].tolist()
            eta = (time.time() - t_loop) / (step - start_epoch * steps) * (args.epochs * steps - step)
            log(f'ep {epoch + 1}/{args.epochs} | train loss {loss_sum / count:.4f} acc {100 * correct / count:.2f}% | '
                f'test loss {r["loss"]:.4f} acc {r["top1"]:.2f}% | {time.time() - t_epoch:.1f} s | eta {fmt_time(eta)}',
                flush=True)
            if master:  # last.pt first: it holds the history the other two are rebuilt from
                save_atomic(last, {'model': raw.state_dict(), 'optimizer': opt.state_dict(), 'history': history,
                                   'scaler': scaler.state_dict(), 'epoch': epoch + 1, 'step': step, 'args': run_args})
            saved = (last, epoch + 1)  # now, not after the other two: a Ctrl-C while they are written names it
            if master:
                save_atomic(out_dir / 'metrics.jsonl', history)
                save_atomic(out_dir / 'args.json', run_args)
    except KeyboardInterrupt:
        log(f'train_cifar.py: interrupted in epoch {epoch + 1}; {since_checkpoint(saved)}', file=sys.stderr)
        sys.exit(130)
    best = max(r['top1'] for r in history if r['kind'] == 'eval')
    log(f'done | {args.model} on {args.dataset} | epoch {args.epochs}/{args.epochs} | test acc {r["top1"]:.2f}% '
        f'(best {best:.2f}%) | {fmt_time(time.time() - t_start)} wall | {last}', flush=True)
    leave(ddp)


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(f'train_cifar.py: error: {e}')
    except KeyboardInterrupt:
        print('train_cifar.py: interrupted before training started; nothing was saved', file=sys.stderr)
        sys.exit(130)
