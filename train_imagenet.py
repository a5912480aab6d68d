"""ImageNet-1k training for ViT, MLP-Mixer, ConvMixer and the ResNet baselines, with DDP, AMP and SAM.

Two recipes, each a set of flag defaults (every flag can still be overridden):

  --recipe sam        Chen, Hsieh & Gong 2021, "When Vision Transformers Outperform ResNets without
                      Pretraining or Strong Data Augmentations" (ICLR 2022): Inception crop + flip only,
                      AdamW (0.9, 0.999), peak LR 3e-3 at batch 4096, weight decay 0.3, 10k warmup steps
                      then linear decay, 300 epochs, clipping at global norm 1.0. Add --sam for SAM.
                      Paper: ViT-B/16 74.6 -> 79.9 and Mixer-B/16 66.4 -> 77.4 top-1 with SAM.
  --recipe convmixer  Trockman & Kolter, "Patches Are All You Need?" (timm fork command in reference.md):
                      RandAugment m9 mstd0.5, mixup 0.5, cutmix 0.5, random erasing 0.25, label
                      smoothing 0.1, AdamW eps 1e-3, one-cycle LR 0.01 at batch 640, wd 2e-5, clipping
                      1.0, 150 epochs. Paper: ConvMixer-1536/20 81.37, ConvMixer-768/32 80.16 (300 ep).

    torchrun --nproc_per_node 8 train_imagenet.py --data /imagenet --model mixer_b16 --sam --rho 0.05
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \
        train_imagenet.py --data /imagenet --model vit_b16 --sam           # the same on two nodes
    python train_imagenet.py --synthetic --model vit_b16 --batch-size 256 --max-steps 100  # img/s, no data
    python train_imagenet.py --data /imagenet --model vit_b16 --eval-only --checkpoint ViT-B_16.npz

--batch-size is the GLOBAL batch of one optimizer step: it is split over the processes and then
into --accum-steps micro-batches, so a recipe means the same thing on 1 GPU or 64.
Resuming continues mid-epoch exactly (data order, augmentations and RNG); on another world size
the data order and augmentations still do, dropout/mixup draws do not.
"""
import argparse
import ast
import contextlib
import json
import os
import pickle
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets
from torchvision.transforms import v2

import convmixer
import mixer
import vit
from sam import SAM, first_pass, second_pass

# -----------------------------------------------------------------------------
# Arguments. Defaults are the SAM paper's recipe; --recipe convmixer swaps in the ConvMixer one.
RECIPES = {
    # Chen, Hsieh & Gong 2021, Sec. 3 and appendix (settings as reused in the GSAM paper).
    'sam': dict(epochs=300, batch_size=4096, lr=3e-3, lr_batch=4096, opt_eps=1e-8, wd=0.3,
                sched='linear', warmup_steps=10_000, clip_grad=1.0, smoothing=0.0, randaug_n=0,
                mixup=0.0, cutmix=0.0, reprob=0.0, norm='jax', crop_pct=0.875, eval_interp='bilinear'),
    # locuslab/convmixer README (timm fork): --opt adamw --sched onecycle --lr 0.01 --opt-eps 1e-3
    # --aa rand-m9-mstd0.5-inc1 --mixup 0.5 --cutmix 0.5 --reprob 0.25 --clip-grad 1.0, batch 64 x 10
    # GPUs; timm's implicit wd 2e-5 and smoothing 0.1; timm's ConvMixer eval cfg: crop_pct 0.96, bicubic.
    'convmixer': dict(epochs=150, batch_size=640, lr=0.01, lr_batch=640, opt_eps=1e-3, wd=2e-5,
                      sched='onecycle', warmup_steps=0, clip_grad=1.0, smoothing=0.1, randaug_n=2,
                      mixup=0.5, cutmix=0.5, reprob=0.25, norm='imagenet', crop_pct=0.96,
                      eval_interp='bicubic'),
}


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--recipe', choices=list(RECIPES), default='sam',
                   help='set of defaults: sam = Chen et al. 2021, convmixer = Trockman & Kolter')
    # data
    p.add_argument('--data', metavar='DIR',
                   help='ImageNet root holding train/<wnid>/*.JPEG and val/<wnid>/*.JPEG')
    p.add_argument('--synthetic', action='store_true',
                   help='random tensors of the right shape instead of --data (1000 classes, 1,281,167 '
                        'train / 50,000 val), to measure throughput without a data pipeline')
    p.add_argument('--img-size', type=int, default=224, help='training and evaluation resolution (px)')
    p.add_argument('--workers', type=int, default=8, help='data-loader worker processes per GPU')
    p.add_argument('--prefetch', type=int, default=4, help='batches each worker loads ahead')
    p.add_argument('--norm', choices=['imagenet', 'jax'],
                   help='input normalisation: imagenet = ImageNet mean/std (torchvision ResNets, timm '
                        'ConvMixer, locuslab .pth.tar); jax = (x - 0.5) / 0.5, as the official JAX ViT/Mixer '
                        'code and its .npz files expect, and timm weights ported from them (those whose '
                        'pretrained_cfg has mean = std = 0.5, e.g. vit_base_patch16_224.sam_in1k)')
    p.add_argument('--crop-pct', type=float,
                   help='evaluation: resize the shorter side to img_size / crop_pct, centre-crop img_size')
    p.add_argument('--eval-interp', choices=['bilinear', 'bicubic'],
                   help='evaluation resize filter (tf.image.resize default; timm ConvMixer cfg)')
    p.add_argument('--crop-min', type=float, default=0.08,
                   help='RandomResizedCrop minimum area fraction (Inception, Szegedy et al. 2015: 8%%-100%%)')
    p.add_argument('--randaug-n', type=int, help='RandAugment ops per image (0 = off)')
    p.add_argument('--randaug-m', type=float, default=9, help="RandAugment magnitude on timm's 0-10 scale")
    p.add_argument('--randaug-mstd', type=float, default=0.5, help='std of the per-image magnitude draw')
    p.add_argument('--mixup', type=float, help='mixup Beta(alpha, alpha); 0 = off')
    p.add_argument('--cutmix', type=float, help='cutmix Beta(alpha, alpha); 0 = off. With both on, '
                                                'each batch uses one of the two, with p 0.5 each (as timm)')
    p.add_argument('--reprob', type=float, help="random-erasing probability per image (timm 'pixel' mode)")
    p.add_argument('--smoothing', type=float, help='label smoothing')
    # model
    p.add_argument('--model', default='vit_b16', help='a config of vit.py, mixer.py, convmixer.py, or '
                                                      'resnet50/101/152 (torchvision)')
    p.add_argument('--model-kw', nargs='*', default=[], metavar='K=V',
                   help='constructor overrides, e.g. --model-kw depth=2 dim=64 heads=2 drop_path=0.1 '
                        '(values parsed as Python literals, else strings); for tests and ablations')
    p.add_argument('--channels-last', action='store_true', help='NHWC memory format (faster convs on GPUs)')
    p.add_argument('--compile', action='store_true', help='torch.compile the model')
    # optimisation
    p.add_argument('--epochs', type=int, help='training epochs')
    p.add_argument('--batch-size', type=int, help='GLOBAL batch per optimizer step (all GPUs x accum steps)')
    p.add_argument('--accum-steps', type=int, default=1, help='gradient-accumulation micro-batches per step')
    p.add_argument('--lr', type=float, help='peak learning rate at a global batch of --lr-batch')
    p.add_argument('--lr-batch', type=int, help='batch at which --lr holds; LR scales linearly with '
                                                '--batch-size (Goyal et al. 2017)')
    p.add_argument('--betas', type=float, nargs=2, default=(0.9, 0.999), help='AdamW betas')
    p.add_argument('--opt-eps', type=float, help='AdamW epsilon')
    p.add_argument('--wd', type=float, help='AdamW decoupled weight decay (on weight matrices and '
                                            'kernels; not on biases, norms, pos_embed, cls_token)')
    p.add_argument('--sched', choices=['linear', 'onecycle'],
                   help='linear = warmup then linear decay to 0; onecycle = piecewise linear '
                        '0 -> lr at 40%% -> lr/20 at 80%% -> 0 at the end (locuslab np.interp)')
    p.add_argument('--warmup-steps', type=int, help='linear warmup length in optimizer steps (sched linear)')
    p.add_argument('--clip-grad', type=float, help='clip the global gradient norm (0 = off)')
    p.add_argument('--sam', action='store_true', help='Sharpness-Aware Minimization (Foret et al. 2020)')
    p.add_argument('--rho', type=float, default=0.05,
                   help="SAM neighbourhood radius. 0.05 is SAM's own default (Foret et al.); Chen et al. "
                        "2021 tune rho per model and list the values in their appendix hyperparameter "
                        "table, which is NOT verified in this repo: look the value up there and pass it")
    p.add_argument('--amp', choices=['bf16', 'fp16', 'off'],
                   help='autocast precision; default bf16 on GPUs that support it, else off. fp16 uses '
                        'a GradScaler')
    p.add_argument('--seed', type=int, default=0, help='seed for init, data order and augmentation')
    # checkpoints, evaluation, logging
    p.add_argument('--out', metavar='DIR', help='checkpoint.pt, metrics.jsonl and args.json go here '
                   '(default: the --resume file\'s folder, else runs/imagenet/<model>[_sam])')
    p.add_argument('--save-every', type=int, default=0,
                   help='also checkpoint every N optimizer steps (0 = only at the end of each epoch)')
    p.add_argument('--resume', metavar='PATH', help='continue from a checkpoint of this script, mid-epoch if '
                                                    'that is where it was written')
    p.add_argument('--eval-only', action='store_true', help='evaluate --checkpoint and exit')
    p.add_argument('--checkpoint', metavar='PATH',
                   help='for --eval-only: our checkpoint.pt, a timm state_dict, an official JAX .npz '
                        '(ViT/Mixer, use --norm jax), a locuslab ConvMixer .pth.tar, or a torchvision '
                        'ResNet state_dict (use --norm imagenet)')
    p.add_argument('--eval-batch-size', type=int, default=256, help='evaluation batch per process')
    p.add_argument('--max-steps', type=int, default=0,
                   help='stop after this many optimizer steps in all, without a final checkpoint '
                        '(throughput runs; the LR schedule still spans --epochs); 0 = off')
    p.add_argument('--log-every', type=int, default=50, help='print progress every N optimizer steps')

    # The chosen recipe sets the defaults, then the command line overrides them one by one.
    for action in p._actions:
        if action.dest in RECIPES['sam']:
            action.help += ' [' + ', '.join(f'{r}: {RECIPES[r][action.dest]}' for r in RECIPES) + ']'
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument('--recipe', choices=list(RECIPES), default='sam')
    p.set_defaults(**RECIPES[first.parse_known_args(argv)[0].recipe])
    return p.parse_args(argv)


def fail(msg):
    """A user error: one clear line on stderr, exit status 1, no traceback."""
    print(f'train_imagenet.py: error: {msg}', file=sys.stderr)
    sys.exit(1)


# -----------------------------------------------------------------------------
# Data. Decoding, crop, flip and RandAugment run per image in the loader workers; mixup/cutmix run
# on the collated batch on the GPU.
MEANS = {'imagenet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
         'jax': ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}  # official JAX input pipeline: x / 127.5 - 1
LAYOUT = ('expected ImageNet-1k in ImageFolder layout: DIR/train/<wnid>/*.JPEG and DIR/val/<wnid>/*.JPEG '
          '(the validation images sorted into the same class folders, e.g. by the valprep.sh of the '
          'PyTorch ImageNet example; ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar come from '
          'image-net.org). Use --synthetic to run without data')


class RandAugmentMstd(v2.RandAugment):
    """timm's `rand-m{M}-mstd{S}`: RandAugment whose magnitude is redrawn from N(M, S), clipped to [0, 10].

    Magnitudes are on timm's 0-10 scale (m9 = 90% of each op's maximum), obtained from torchvision's
    bins with 101 of them: bin 10*m. Deviations from timm, stated here: one magnitude draw per image
    (timm draws per op), and torchvision's op set (it has Identity; timm has Invert and SolarizeAdd,
    and applies each chosen op with probability 0.5).
    """

    def __init__(self, num_ops, magnitude, magnitude_std, fill):
        super().__init__(num_ops=num_ops, magnitude=round(10 * magnitude), num_magnitude_bins=101,
                         interpolation=v2.InterpolationMode.BILINEAR, fill=fill)
        self.m, self.mstd = magnitude, magnitude_std

    def forward(self, *inputs):
        m = self.m + self.mstd * torch.randn(()).item() if self.mstd > 0 else self.m
        self.magnitude = round(10 * min(max(m, 0.0), 10.0))
        return super().forward(*inputs)


def train_transform(args, mean, std):
    t = [v2.RandomResizedCrop(args.img_size, scale=(args.crop_min, 1.0), antialias=True),  # Inception crop
         v2.RandomHorizontalFlip()]
    if args.randaug_n > 0:
        fill = [round(255 * m) for m in mean]  # timm fills with the mean pixel
        t.append(RandAugmentMstd(args.randaug_n, args.randaug_m, args.randaug_mstd, fill))
    t += [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    if args.reprob > 0:  # on the normalised image, with N(0, 1) noise: timm's 'pixel' mode
        t.append(v2.RandomErasing(p=args.reprob, value='random'))
    return v2.Compose(t)


def eval_transform(args, mean, std):
    interp = {'bilinear': v2.InterpolationMode.BILINEAR, 'bicubic': v2.InterpolationMode.BICUBIC}
    return v2.Compose([v2.Resize(int(args.img_size / args.crop_pct), interp[args.eval_interp],
                                 antialias=True),  # the shorter side
                       v2.CenterCrop(args.img_size),
                       v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


class SeededTransform(torch.utils.data.Dataset):
    """base[index] passed through `transform` under a seed that the sampler hands over with the index.

    Every image's augmentation is then a function of (seed, epoch, position in the epoch's order) only,
    so it does not depend on the number of workers or processes, and a resumed run draws exactly what
    the uninterrupted run would have drawn. Only the CPU generator of this process is reseeded, and
    restored afterwards.
    """

    def __init__(self, base, transform):
        self.base, self.transform = base, transform

    def __len__(self):
        return len(self.base)

    def __getitem__(self, item):
        index, seed = item
        img, label = self.base[index]
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return self.transform(img), label


class SyntheticImages(torch.utils.data.Dataset):
    """Fixed random N(0, 1) images (3, S, S), label index % classes: a stand-in for --synthetic."""

    def __init__(self, n, img_size, num_classes, offset):
        self.n, self.img_size, self.num_classes, self.offset = n, img_size, num_classes, offset

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.offset + index)
        return torch.randn(3, self.img_size, self.img_size, generator=g), index % self.num_classes


class ResumableSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler that yields whole optimizer steps only, can start at `start_step` of an epoch,
    and pairs each index with its augmentation seed.

    Each epoch is one global permutation (seed + epoch) that rank r reads at positions r, r + W, ...
    The first s steps of any world size W consume the same first s * batch positions, so skipping
    them is a slice of the index list: nothing is loaded and thrown away.
    """

    def __init__(self, dataset, num_replicas, rank, seed, per_step):
        # drop_last: no padding with repeated images, so steps = N // global batch on any world size
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                         drop_last=True)
        self.per_step = per_step  # samples this process consumes per optimizer step
        self.steps = self.num_samples // per_step  # optimizer steps per epoch; the tail is dropped
        self.start_step = 0

    def __iter__(self):
        order = list(super().__iter__())
        base = (self.seed * 1000 + self.epoch) << 24  # per-epoch seed space, 2^24 positions per epoch
        return iter([(order[j], base + self.rank + self.num_replicas * j)
                     for j in range(self.start_step * self.per_step, self.steps * self.per_step)])

    def __len__(self):
        return (self.steps - self.start_step) * self.per_step


def image_folder(root, split, transform=None):
    path = os.path.join(root, split)
    if not os.path.isdir(path):
        fail(f'--data {root}: no folder {path}; {LAYOUT}')
    try:
        return datasets.ImageFolder(path, transform=transform)
    except (FileNotFoundError, RuntimeError) as e:
        fail(f'--data {root}: {e} ; {LAYOUT}')


# -----------------------------------------------------------------------------
# Models: every named config of the three model files, plus torchvision's ResNets (the SAM paper's
# baselines).
FAMILIES = {'vit': vit, 'mixer': mixer, 'convmixer': convmixer}
RESNETS = {'resnet50': torchvision.models.resnet50, 'resnet101': torchvision.models.resnet101,
           'resnet152': torchvision.models.resnet152}


def model_names():
    return [n for m in FAMILIES.values() for n in m.configs] + list(RESNETS)


def parse_model_kw(items):
    kw = {}
    for item in items:
        key, sep, value = item.partition('=')
        if not sep:
            fail(f'--model-kw expects KEY=VALUE, got {item!r}')
        try:
            kw[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kw[key] = value  # a bare word such as gelu=tanh
    return kw


def build_model(name, num_classes, img_size, overrides):
    """vit/mixer get img_size (their position embedding / token MLP depend on it); ConvMixer and
    ResNet are fully convolutional and take any size."""
    if name in RESNETS:
        return RESNETS[name](num_classes=num_classes, **overrides)
    for family, module in FAMILIES.items():
        if name in module.configs:
            size = {} if family == 'convmixer' else dict(img_size=img_size)
            return module.create(name, num_classes=num_classes, **{**size, **overrides})
    raise ValueError(f'unknown model {name!r}; valid names: {", ".join(model_names())}')


def load_state_dict_checked(model, state_dict):
    """Strict load that names the first mismatched key and both shapes (torch lists every key)."""
    sd = {k.removeprefix('module.').removeprefix('_orig_mod.'): v for k, v in state_dict.items()}
    own = model.state_dict()
    for key, value in own.items():
        if key not in sd:
            raise ValueError(f'checkpoint has no {key!r} (the model\'s is {tuple(value.shape)}): '
                             'a checkpoint of another architecture?')
        if tuple(sd[key].shape) != tuple(value.shape):
            raise ValueError(f'shape mismatch at {key!r}: checkpoint {tuple(sd[key].shape)}, '
                             f'model {tuple(value.shape)}')
    for key in sd:
        if key not in own:
            raise ValueError(f'checkpoint key {key!r} {tuple(sd[key].shape)} is not in the model')
    model.load_state_dict(sd)


def load_weights(model, name, path):
    """--eval-only --checkpoint: the model files' own loaders know our checkpoints, timm state_dicts,
    the official JAX .npz files and locuslab's .pth.tar; ResNets take a torchvision state_dict."""
    if name in RESNETS:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
        for key in ('model', 'state_dict'):  # ours, or a common wrapper
            if isinstance(ckpt, dict) and isinstance(ckpt.get(key), dict):
                ckpt = ckpt[key]
        load_state_dict_checked(model, ckpt)
    else:
        family = next(m for m in FAMILIES.values() if name in m.configs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            family.load_checkpoint(model, path)
        for w in caught:
            # The loaders keep the model's own head when the file has another number of classes
            # (right for fine-tuning); for evaluation that head is random, so refuse.
            if 'head' in str(w.message):
                raise ValueError(f'{w.message}; evaluating with an untrained head means nothing: '
                                 'the validation folders must match the checkpoint\'s classes')
            print(f'warning: {w.message}', file=sys.stderr)


# -----------------------------------------------------------------------------
# One optimizer step, with gradient accumulation and optionally SAM.
def train_step(model, optimizer, scaler, micro, loss_fn, autocast, *, sam, clip_grad):
    """One optimizer step on a batch split into k = len(micro) micro-batches [(x, y), ...].

    Each micro-batch loss is divided by k, so the summed gradient is the gradient of the mean loss
    over the whole batch (exactly so for models without BatchNorm). Under DDP only the last backward
    of the pass that feeds the optimizer all-reduces; the others run in no_sync().
    SAM (Foret et al. Alg. 1) with accumulation: the first pass accumulates the clean gradient g over
    all k micro-batches without any all-reduce (first_pass: m-sharpness, each replica its own
    eps-hat), then perturbs ONCE, w <- w + rho g/||g||; the second pass accumulates g_SAM at that one
    point and all-reduces on its last micro-batch; the base step then starts from the restored w.
    Returns the mean loss of the (first) pass and the pre-clipping gradient norm (0 when clipping
    is off), as tensors.
    """
    k = len(micro)
    no_sync = getattr(model, 'no_sync', None)  # DDP (also through torch.compile's wrapper)

    def accumulate(sync_last):
        total = 0.0
        for j, (x, y) in enumerate(micro):
            sync = sync_last and j == k - 1
            with no_sync() if no_sync is not None and not sync else contextlib.nullcontext():
                with autocast():
                    loss = loss_fn(model(x), y) / k
                scaler.scale(loss).backward()
            total += loss.detach()
        return total

    if sam:
        with first_pass(model):                 # no all-reduce anywhere in the first pass
            loss = accumulate(sync_last=False)
        optimizer.first_step(zero_grad=True)    # climb to w + eps_hat
        with second_pass(model):                # BatchNorm running stats come from the first pass
            accumulate(sync_last=True)          # g_SAM, averaged over replicas
    else:
        loss = accumulate(sync_last=True)
    grad_norm = torch.zeros(())
    if clip_grad > 0:                           # clip the gradient the base optimizer uses (g_SAM)
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    scaler.step(optimizer)                      # SAM: back to w, then the AdamW step with g_SAM
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


# -----------------------------------------------------------------------------
# Evaluation: every validation image exactly once, whatever the world size.
@torch.no_grad()
def evaluate(model, loader, device, autocast, channels_last, distributed):
    """Rank r evaluates images r, r + W, ... (no padding, no duplicates); the counts are summed."""
    was_training = model.training
    model.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1, top-5, images
    for x, y in loader:
        x = x.to(device, non_blocking=True,
                 memory_format=torch.channels_last if channels_last else torch.preserve_format)
        y = y.to(device, non_blocking=True)
        with autocast():
            logits = model(x)
        logits = logits.float()
        hit = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]  # (B, 5)
        stats[:3] += torch.stack([F.cross_entropy(logits, y, reduction='sum').double(),
                                  hit[:, 0].sum().double(), hit.any(1).sum().double()])
        stats[3] += len(y)  # a Python number: no host-to-device copy (which would sync)
    if distributed:
        dist.all_reduce(stats)
    model.train(was_training)
    loss, top1, top5, n = stats.tolist()
    n = int(n)
    return dict(loss=loss / max(n, 1), top1=100 * top1 / max(n, 1), top5=100 * top5 / max(n, 1),
                correct1=int(top1), correct5=int(top5), n=n)


# -----------------------------------------------------------------------------
# Checkpoints: written by rank 0, atomically (temp file + os.replace), with everything to resume.
def save_checkpoint(path, master, distributed, model, optimizer, scheduler, scaler, epoch, step, args,
                    steps_per_epoch):
    """All ranks call this: each one's RNG state is gathered, so a resumed run draws the same numbers."""
    rng = {'torch': torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng['cuda'] = torch.cuda.get_rng_state()
    rngs = [None] * (dist.get_world_size() if distributed else 1)
    if distributed:
        dist.all_gather_object(rngs, rng)
    else:
        rngs[0] = rng
    if not master:
        return
    ckpt = dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), rng=rngs,
                epoch=epoch, step=step, steps_per_epoch=steps_per_epoch, args=vars(args))
    torch.save(ckpt, path + '.tmp')
    os.replace(path + '.tmp', path)


# -----------------------------------------------------------------------------
def main(argv=None):
    args = get_args(argv)

    # --- check the user's input before anything slow or collective --------------------------------
    if args.model not in model_names():
        fail(f'unknown model {args.model!r}; valid names: {", ".join(model_names())}')
    overrides = parse_model_kw(args.model_kw)
    if args.eval_only and not args.checkpoint:
        fail('--eval-only needs --checkpoint PATH')
    if args.checkpoint and not args.eval_only:
        fail('--checkpoint is read by --eval-only; to continue a training run use --resume PATH')
    for flag, path in (('--checkpoint', args.checkpoint), ('--resume', args.resume)):
        if path and not os.path.isfile(path):
            fail(f'{flag}: no such file: {path}')
    if not args.synthetic and not args.data:
        fail(f'give --data DIR ({LAYOUT})')

    # --- distributed setup, torchrun style ------------------------------------------------------------
    world = int(os.environ.get('WORLD_SIZE', 1))
    rank, local_rank = int(os.environ.get('RANK', 0)), int(os.environ.get('LOCAL_RANK', 0))
    distributed = world > 1
    device = torch.device('cuda', local_rank) if torch.cuda.is_available() else torch.device('cpu')
    if device.type == 'cuda':
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    master = rank == 0
    log = print if master else (lambda *a, **k: None)

    if args.amp is None:
        args.amp = 'bf16' if device.type == 'cuda' and torch.cuda.is_bf16_supported() else 'off'
    amp_dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'off': None}[args.amp]

    def autocast():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    per_step = args.batch_size // world  # samples per process per optimizer step
    micro_bs = per_step // args.accum_steps
    if not args.eval_only and micro_bs * args.accum_steps * world != args.batch_size:
        fail(f'--batch-size {args.batch_size} must be divisible by processes ({world}) x --accum-steps '
             f'({args.accum_steps})')
    mean, std = MEANS[args.norm]
    if args.out is None:
        args.out = (os.path.dirname(os.path.abspath(args.resume)) if args.resume else
                    os.path.join('runs', 'imagenet', args.model + ('_sam' if args.sam else '')))

    # --- data --------------------------------------------------------------------------------------
    if args.synthetic:
        num_classes = 1000
        train_base = SyntheticImages(1_281_167, args.img_size, num_classes, offset=0)
        train_tf = torch.nn.Identity()
        val_set = SyntheticImages(50_000, args.img_size, num_classes, offset=1 << 40)
    else:
        val_set = image_folder(args.data, 'val', eval_transform(args, mean, std))
        num_classes = len(val_set.classes)
        if not args.eval_only:
            train_base = image_folder(args.data, 'train')
            if train_base.classes != val_set.classes:
                fail(f'--data {args.data}: train has {len(train_base.classes)} class folders and val '
                     f'{len(val_set.classes)}, or their names differ; {LAYOUT}')
            train_tf = train_transform(args, mean, std)
    workers = dict(num_workers=args.workers, pin_memory=device.type == 'cuda',
                   persistent_workers=args.workers > 0,
                   prefetch_factor=args.prefetch if args.workers else None,
                   generator=torch.Generator())  # own generator: iter(loader) leaves the global RNG alone
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.eval_batch_size,
                                             sampler=range(rank, len(val_set), world), **workers)
    if not args.eval_only:
        train_set = SeededTransform(train_base, train_tf)
        sampler = ResumableSampler(train_set, world, rank, args.seed, per_step)
        steps_per_epoch = sampler.steps
        if steps_per_epoch == 0:
            fail(f'--batch-size {args.batch_size} is larger than the training set ({len(train_set)} images)')
        train_loader = torch.utils.data.DataLoader(train_set, batch_size=micro_bs, sampler=sampler,
                                                   **workers)
        mix = [v2.MixUp(alpha=args.mixup, num_classes=num_classes)] if args.mixup > 0 else []
        mix += [v2.CutMix(alpha=args.cutmix, num_classes=num_classes)] if args.cutmix > 0 else []
        mix = v2.RandomChoice(mix) if mix else None  # on the collated batch: one of them, p 0.5 each

    # --- model ------------------------------------------------------------------------------------
    torch.manual_seed(args.seed)  # the same initial weights on every rank and world size
    try:
        raw_model = build_model(args.model, num_classes, args.img_size, overrides)
    except (TypeError, ValueError) as e:
        fail(f'--model {args.model} --model-kw {" ".join(args.model_kw)}: {e}')
    if args.eval_only:
        try:
            load_weights(raw_model, args.model, args.checkpoint)
        except (ValueError, RuntimeError, KeyError, OSError, pickle.UnpicklingError) as e:
            fail(f'--checkpoint {args.checkpoint} does not fit --model {args.model}: {e}')
    raw_model.to(device)
    if args.channels_last:
        raw_model.to(memory_format=torch.channels_last)
    torch.manual_seed(args.seed + rank)  # dropout / drop-path / mixup draws differ between ranks
    if distributed:
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    # Train through DDP; evaluate the bare (compiled) model: its forward has no collectives, so ranks
    # may run different numbers of evaluation batches.
    eval_model = torch.compile(raw_model) if args.compile else raw_model
    log(f'{args.model}: {sum(p.numel() for p in raw_model.parameters()):,} parameters, {num_classes} '
        f'classes, {args.img_size} px, norm {args.norm}, {world} process(es) on {device.type}, amp {args.amp}')

    if args.eval_only:
        res = evaluate(eval_model, val_loader, device, autocast, args.channels_last, distributed)
        log(f'eval {args.checkpoint}: top-1 {res["top1"]:.3f}% ({res["correct1"]}/{res["n"]}), '
            f'top-5 {res["top5"]:.3f}%, loss {res["loss"]:.4f}')
        log(json.dumps(res))
        if distributed:
            dist.barrier()  # leave together: gloo may abort a rank whose peer is still running
            dist.destroy_process_group()
        return res

    model = raw_model
    if distributed:
        model = DDP(raw_model, device_ids=[local_rank] if device.type == 'cuda' else None)
    if args.compile:
        model = torch.compile(model)  # compiling the DDP module lets it overlap buckets with backward

    # --- optimizer: AdamW, wrapped by SAM with --sam ---------------------------------------------
    # Decay only weight matrices and conv kernels, as timm does (biases, norms, pos_embed, cls_token
    # are not decayed).
    decay, no_decay = [], []
    for name, p_ in raw_model.named_parameters():
        (decay if p_.ndim >= 2 and name not in ('pos_embed', 'cls_token') else no_decay).append(p_)
    groups = [dict(params=decay, weight_decay=args.wd), dict(params=no_decay, weight_decay=0.0)]
    lr = args.lr * args.batch_size / args.lr_batch  # linear scaling rule
    adamw = dict(lr=lr, betas=tuple(args.betas), eps=args.opt_eps)
    optimizer = SAM(groups, torch.optim.AdamW, rho=args.rho, **adamw) if args.sam else \
        torch.optim.AdamW(groups, **adamw)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == 'fp16')

    # --- schedule, per optimizer step ----------------------------------------------------------------
    total_steps = args.epochs * steps_per_epoch

    def lr_factor(s):  # s = optimizer steps already taken
        if args.sched == 'linear':  # SAM paper: linear warmup, then linear decay to 0
            if s < args.warmup_steps:
                return (s + 1) / args.warmup_steps
            return max(0.0, (total_steps - s) / max(1, total_steps - args.warmup_steps))
        # one-cycle of locuslab/convmixer: np.interp(t, [0, 2E/5, 4E/5, E], [0, lr, lr/20, 0]),
        # t = epoch + (i + 1) / steps_per_epoch
        E = args.epochs
        return float(np.interp((s + 1) / steps_per_epoch, [0, 0.4 * E, 0.8 * E, E], [0, 1, 1 / 20, 0]))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    def loss_fn(logits, y):  # y: class indices, or mixup/cutmix soft targets (B, classes)
        return F.cross_entropy(logits.float(), y, label_smoothing=args.smoothing)

    # --- resume -------------------------------------------------------------------------------------
    epoch, step = 0, 0
    if args.resume:
        try:
            ckpt = torch.load(args.resume, map_location='cpu', weights_only=True)
        except Exception as e:  # torch.load on a foreign file fails in many ways; all mean the same here
            fail(f'--resume {args.resume}: not a file torch.load reads ({type(e).__name__}: {e})')
        needed = ('model', 'optimizer', 'scheduler', 'scaler', 'rng', 'epoch', 'step', 'steps_per_epoch',
                  'args')
        if not isinstance(ckpt, dict) or not all(k in ckpt for k in needed):
            fail(f'--resume {args.resume} is not a training checkpoint of this script (those hold '
                 f'{", ".join(needed)}); to evaluate weights use --eval-only --checkpoint')
        old = ckpt['args']
        if old['model'] != args.model or old['batch_size'] != args.batch_size or \
                ckpt['steps_per_epoch'] != steps_per_epoch:
            fail(f'--resume {args.resume} was written for --model {old["model"]} --batch-size '
                 f'{old["batch_size"]} ({ckpt["steps_per_epoch"]} steps per epoch); this run has --model '
                 f'{args.model} --batch-size {args.batch_size} ({steps_per_epoch} steps per epoch)')
        try:
            load_state_dict_checked(raw_model, ckpt['model'])
        except ValueError as e:
            fail(f'--resume {args.resume}: {e}')
        optimizer.load_state_dict(ckpt['optimizer'])
        scheduler.load_state_dict(ckpt['scheduler'])
        scaler.load_state_dict(ckpt['scaler'])
        epoch, step = ckpt['epoch'], ckpt['step']
        if len(ckpt['rng']) == world:
            torch.set_rng_state(ckpt['rng'][rank]['torch'])
            if 'cuda' in ckpt['rng'][rank] and device.type == 'cuda':
                torch.cuda.set_rng_state(ckpt['rng'][rank]['cuda'])
        else:
            log(f'note: the checkpoint was written by {len(ckpt["rng"])} processes, this run has {world}: '
                'data order and augmentations continue exactly, dropout/mixup draws do not')
        log(f'resumed {args.resume} at epoch {epoch}, step {step} ({step - epoch * steps_per_epoch} of '
            f'{steps_per_epoch} in this epoch)')
        del ckpt

    ckpt_path = os.path.join(args.out, 'checkpoint.pt')
    if master:
        os.makedirs(args.out, exist_ok=True)
        resolved = dict(vars(args), world_size=world, micro_batch=micro_bs, peak_lr=lr,
                        steps_per_epoch=steps_per_epoch, total_steps=total_steps)
        with open(os.path.join(args.out, 'args.json'), 'w') as f:
            json.dump(resolved, f, indent=1)
        metrics = open(os.path.join(args.out, 'metrics.jsonl'), 'a')

    def record(**row):
        if master:
            metrics.write(json.dumps(row) + '\n')
            metrics.flush()

    def checkpoint(ep, st):
        save_checkpoint(ckpt_path, master, distributed, raw_model, optimizer, scheduler, scaler, ep, st,
                        args, steps_per_epoch)

    log(f'global batch {args.batch_size} = {world} x {args.accum_steps} x {micro_bs}, peak lr {lr:.3g}, '
        f'{steps_per_epoch} steps/epoch, {total_steps} steps, SAM {"rho=%g" % args.rho if args.sam else "off"}')

    # --- training loop -----------------------------------------------------------------------------
    model.train()
    loss_sum = torch.zeros((), device=device)  # summed on the device: no host sync between log lines
    norm_sum, data_time, t_log, steps_logged = 0.0, 0.0, time.time(), 0
    stop = False
    while epoch < args.epochs and not stop:
        sampler.set_epoch(epoch)
        sampler.start_step = step - epoch * steps_per_epoch  # > 0 only in a resumed epoch
        batches = iter(train_loader)
        for _ in range(sampler.start_step, steps_per_epoch):
            t0 = time.time()
            micro = []
            for _ in range(args.accum_steps):
                x, y = next(batches)
                x = x.to(device, non_blocking=True,
                         memory_format=torch.channels_last if args.channels_last else torch.preserve_format)
                y = y.to(device, non_blocking=True)
                if mix is not None:
                    x, y = mix(x, y)  # y becomes (B, classes) soft targets
                micro.append((x, y))
            data_time += time.time() - t0
            step_lr = optimizer.param_groups[0]['lr']
            loss, grad_norm = train_step(model, optimizer, scaler, micro, loss_fn, autocast,
                                         sam=args.sam, clip_grad=args.clip_grad)
            scheduler.step()
            step += 1
            loss_sum += loss
            norm_sum += grad_norm
            steps_logged += 1

            if step % args.log_every == 0 or step == total_steps:
                if distributed:
                    dist.all_reduce(loss_sum)
                elapsed = time.time() - t_log
                row = dict(kind='train', epoch=epoch, step=step, lr=step_lr,
                           loss=loss_sum.item() / world / steps_logged,
                           grad_norm=float(norm_sum) / steps_logged,
                           img_per_s=args.batch_size * steps_logged / elapsed,
                           step_time=elapsed / steps_logged, data_time=data_time / steps_logged)
                eta = (total_steps - step) * row['step_time']
                log(f'epoch {epoch + 1}/{args.epochs} step {step - epoch * steps_per_epoch}/{steps_per_epoch} '
                    f'({step}/{total_steps}) | loss {row["loss"]:.4f} | lr {row["lr"]:.3g} | '
                    f'grad-norm {row["grad_norm"]:.3f} | {row["img_per_s"]:.0f} img/s | data '
                    f'{row["data_time"]:.3f} of {row["step_time"]:.3f} s/step | ETA '
                    f'{int(eta // 3600)}h{int(eta % 3600 // 60):02d}m')
                record(**row)
                loss_sum.zero_()
                norm_sum, data_time, t_log, steps_logged = 0.0, 0.0, time.time(), 0

            if args.max_steps and step >= args.max_steps:
                log(f'stopping after --max-steps {args.max_steps} (no checkpoint written for this step)')
                stop = True
                break
            if args.save_every and step % args.save_every == 0 and step % steps_per_epoch != 0:
                t_pause = time.time()
                checkpoint(epoch, step)  # mid-epoch: --resume continues from this step
                t_log += time.time() - t_pause  # keep img/s and ETA about training only
        else:  # the epoch ran to its end
            t_pause = time.time()
            epoch += 1
            checkpoint(epoch, step)
            if distributed:  # BatchNorm statistics: evaluate rank 0's, the ones the checkpoint holds
                for b in raw_model.buffers():
                    dist.broadcast(b, 0)
            res = evaluate(eval_model, val_loader, device, autocast, args.channels_last, distributed)
            log(f'epoch {epoch}/{args.epochs} eval: top-1 {res["top1"]:.3f}% ({res["correct1"]}/{res["n"]}), '
                f'top-5 {res["top5"]:.3f}%, loss {res["loss"]:.4f}')
            record(kind='eval', epoch=epoch, step=step, **res)
            t_log += time.time() - t_pause

    if master:
        metrics.close()
    if distributed:
        dist.barrier()  # rank 0 may still be writing: leave together (gloo aborts a one-sided teardown)
        dist.destroy_process_group()


if __name__ == '__main__':
    main()
