"""Self-supervised contrastive pre-training of a ViT (MoCo v3) with or without SAM; k-NN and linear-probe
evaluation on frozen features; last.pt's 'model' fine-tunes with train_cifar.py --pretrained.

    python train_contrastive.py --data /tmp/cifar10 --model vit_s16 --epochs 300 --batch-size 512 [--sam]
    torchrun --nproc_per_node 8 train_contrastive.py --dataset imagenet --data /imagenet --model vit_s16 \\
        --model-kw heads=12 --batch-size 1024 --sam --rho 0.05

Claim (Chen, Hsieh & Gong 2021, "When Vision Transformers Outperform ResNets...", ICLR 2022): SAM helps
contrastive learning too; a review gives 350 pre-training epochs, then fine-tuning, ImageNet top-1
ViT-S/16 77.0 -> 78.1, ViT-B/16 77.4 -> 80.0 [unchecked: the framework, epochs and rho the paper used
could not be read here]. Followed: MoCo v3, the standard for ViTs (Chen, Xie & He 2021, "An Empirical
Study of Training Self-Supervised Vision Transformers"; facebookresearch/moco-v3 main_moco.py,
moco/builder.py, moco/loader.py, vits.py, CONFIG.md): two views with BYOL's asymmetric augmentations
(augment.moco_view); f_q = ViT + 3-layer projector + 2-layer predictor, f_k = EMA of f_q with momentum 0.99 -> 1 by a
half cosine, BN over the global batch; loss ctr(q1, k2) + ctr(q2, k1), ctr = 2 tau InfoNCE over all
ranks' keys, tau 0.2; AdamW lr 1.5e-4 * batch / 256, wd 0.1, 40 warm-up epochs, cosine, 300 epochs,
batch 4096; frozen random patch projection (Sec. 4.2) and fixed 2-D sin-cos position embedding.
SAM (--sam, sam.py) wraps AdamW as in train_cifar.py: both passes see the same views and keys; f_k is
updated once per step, after the SAM step, from the restored weights.
Deviations, all deliberate: views are made on the device, batched, from augment.py's exact uint8 ops
(hue, blur and the rectangular crop added here), the flip applied at the crop; the blur is torchvision's
Gaussian of side 2*round(size/20)+1 with sigma scaled by size/224 (next to none at 32 px), not PIL's;
ImageNet views come from the central round(size/0.875)-px square; a step's draws are made for the
global batch, so a run does not depend on the world size; the keys are computed once per step (MoCo v3
updates f_k at the next step's start: the same sequence); checkpoints at epoch ends only; our ViT-S has
6 heads (MoCo v3's 12: --model-kw heads=12) and vit.py's JAX initialisation.
Evaluation: the feature is the head's input (class token after the last LayerNorm) of unaugmented
images; knn: DINO's weighted k-NN (k 20, T 0.07); linear: a linear classifier on cached standardised
training features (main_lincls.py's objective and init, solved full-batch by L-BFGS, without its augmentation).
Both exact under DDP.
"""
import argparse
import contextlib
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torchvision.transforms import v2

import augment
import vit
from data import MEAN, NUM_CLASSES, STD, ImageFolder, load_cifar
from flags import check_lr_not_all_zero, check_ranges, given, refuse_loose
from images import decoded_images
from loader import node_workers
from models import build_model, load_weights, parse_model_kw
from probes import features, gather_rows, knn_scores, linear_probe
from runs import MACHINE_FLAGS, discard_new_dirs, prepare_out, read_checkpoint, restore, save_atomic, written_by
from sam import SAM, first_pass, second_pass
from utils import (NO_STEP, UserError, check_finite, epoch_seed, eta, fmt_time, init_group, leave, one_line,
                   rank_zero_first, setup, since_checkpoint, sync_buffers, wrap_ddp)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ARCH = ('dataset', 'model', 'model_kw', 'img_size', 'proj_hidden', 'proj_dim', 'pos_embed', 'freeze_patch_embed')
RUN_KEYS = {'model', 'moco', 'optimizer', 'scaler', 'epoch', 'step', 'history', 'args'}  # what last.pt holds
NOT_INHERITED = ('resume', 'checkpoint', 'eval_only', 'out', 'overwrite', 'stop_after_epoch', *MACHINE_FLAGS)  # runs


# -----------------------------------------------------------------------------
def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group('data')
    g.add_argument('--data', default='./data', metavar='DIR', help="CIFAR: as train_cifar.py reads it; imagenet: "
                   'DIR/train/<class>/*, DIR/val/<class>/*')
    g.add_argument('--dataset', default='cifar10', choices=['cifar10', 'cifar100', 'imagenet'])
    g.add_argument('--train-subset', type=int, default=0, metavar='N', help='CIFAR: N class-balanced images; 0 = all')
    g.add_argument('--test-subset', type=int, default=0, metavar='N', help='CIFAR: N class-balanced images; 0 = all')
    g.add_argument('--img-size', type=int, metavar='PX', help='view size; default 32 (CIFAR), 224 (imagenet)')
    g.add_argument('--workers', type=int, help='imagenet: loader processes per rank; default: the CPU cores per '
                   'local process, minus one')
    g.add_argument('--crop-min', type=float, default=0.08, help='RandomResizedCrop minimum area fraction')
    g = p.add_argument_group('model (MoCo v3 Sec. 3, vits.py)')
    g.add_argument('--model', default='vit_s16', help=f'a ViT of vit.py ({", ".join(vit.configs)}); at 32 px patch p/4')
    g.add_argument('--model-kw', nargs='+', default=[], metavar='KEY=VALUE', help='ViT overrides, e.g. dim=192 depth=6')
    g.add_argument('--proj-hidden', type=int, default=4096, help='hidden width of the projector and predictor')
    g.add_argument('--proj-dim', type=int, default=256, help='output width of both MLPs: the contrastive space')
    g.add_argument('--pos-embed', default='sincos', choices=['sincos', 'learned'], help='sincos: fixed 2-D (MoCo v3)')
    g.add_argument('--freeze-patch-embed', default=True, action=argparse.BooleanOptionalAction,
                   help='keep the random patch projection frozen (MoCo v3 Sec. 4.2, its --stop-grad-conv1)')
    g.add_argument('--tau', type=float, default=0.2, help='InfoNCE temperature (ViT: 0.2)')
    g.add_argument('--moco-m', type=float, default=0.99, help='EMA momentum at step 0, raised to 1 by a half cosine')
    g = p.add_argument_group('optimisation')
    g.add_argument('--epochs', type=int, default=300)
    g.add_argument('--batch-size', type=int, default=4096, help='global batch: images per optimizer step')
    g.add_argument('--lr', type=float, help='peak AdamW LR; default 1.5e-4 * batch-size / 256 (MoCo v3)')
    g.add_argument('--wd', type=float, default=0.1, help='AdamW decoupled weight decay (all parameters, as MoCo v3)')
    g.add_argument('--warmup-epochs', type=float, default=40, help='linear warm-up, then half cosine to 0')
    g.add_argument('--clip-grad', type=float, default=0.0, help='global grad-norm clip (SAM: of g_SAM); 0 = off')
    g.add_argument('--sam', action='store_true', help='SAM (Foret et al. 2021) around AdamW, via sam.py')
    g.add_argument('--rho', type=float, default=0.05, help="SAM radius (SAM's default; the paper's is unchecked)")
    g.add_argument('--adaptive', action='store_true', help='ASAM (Kwon et al. 2021)')
    g = p.add_argument_group('evaluation (frozen features)')
    g.add_argument('--eval', nargs='+', choices=['knn', 'linear'], default=['knn', 'linear'])
    g.add_argument('--eval-every', type=int, default=10, help='epochs between evaluations; 0 = at the end only')
    g.add_argument('--knn-k', type=int, default=20, help='neighbours (DINO: 20)')
    g.add_argument('--knn-t', type=float, default=0.07, help='vote temperature: weight exp(cos / T)')
    g.add_argument('--linear-epochs', type=int, default=100, help='linear probe: full-batch L-BFGS iterations, '
                   'each ~1 pass over the cached features')
    g.add_argument('--linear-wd', type=float, default=0.0, help='linear probe: L2 penalty wd/2 |W|^2 (main_lincls: 0)')
    g.add_argument('--eval-batch-size', type=int, default=256, help='images per rank per feature batch')
    g = p.add_argument_group('system, run folder, checkpoints')
    g.add_argument('--amp', default='auto', choices=['auto', 'bf16', 'fp16', 'off'],
                   help='autocast: auto = bf16 on CUDA, off on CPU; fp16 adds a GradScaler')
    g.add_argument('--seed', type=int, default=0, help='seeds the init, the data order and the views')
    g.add_argument('--channels-last', action=argparse.BooleanOptionalAction, help='NHWC weights (unset: off, a ViT)')
    g.add_argument('--log-every', type=int, default=50, help='a progress line and train row every N steps; 0 = epochs')
    g.add_argument('--out', metavar='DIR', help="default runs/contrastive, or the --resume file's folder")
    g.add_argument('--overwrite', action='store_true', help='replace the run already in --out')
    g.add_argument('--resume', metavar='PATH', help='continue this last.pt; unset flags default to its run')
    g.add_argument('--eval-only', action='store_true', help='evaluate --checkpoint (without: the random init) and exit')
    g.add_argument('--checkpoint', metavar='PATH', help='for --eval-only: our last.pt (its architecture is the '
                   'default), a timm state_dict or an official .npz')
    g.add_argument('--stop-after-epoch', type=int, default=0, metavar='K', help='save epoch K and exit (preemption)')
    args = p.parse_args(argv)
    # One of our runs: what it stored is the default of every flag not given (argparse fills only unset ones).
    run = args.resume or (args.checkpoint if args.eval_only and not str(args.checkpoint).endswith('.npz') else None)
    ckpt = read_checkpoint(run, '--resume' if args.resume else '--checkpoint') if run else None
    if isinstance(ckpt, dict) and RUN_KEYS <= ckpt.keys():
        keep = [k for k in ckpt['args'] if k not in NOT_INHERITED] if args.resume else ARCH
        args = p.parse_args(argv, namespace=argparse.Namespace(**{k: ckpt['args'][k] for k in keep}))
        args.saved_args = ckpt['args']
    elif author := written_by(ckpt):  # another script's last.pt: its args are of another model, recipe and data
        raise UserError(f'{run} is a last.pt of {author}: {"continue" if args.resume else "evaluate"} it with '
                        f'{author} {"--resume" if args.resume else "--eval-only"}')
    elif args.resume:
        raise UserError(f'--resume {run} is not a train_contrastive.py checkpoint (no {sorted(RUN_KEYS)})')
    if args.checkpoint and not args.eval_only:
        raise UserError('--checkpoint is for --eval-only; to continue a run use --resume PATH')
    if args.eval_only and args.resume:
        raise UserError('--eval-only evaluates --checkpoint PATH, not --resume')
    args.out = args.out or (str(Path(args.resume).parent) if args.resume else 'runs/contrastive')
    args.img_size = (224 if args.dataset == 'imagenet' else 32) if args.img_size is None else args.img_size
    args.workers = node_workers() if args.workers is None else args.workers  # (loader.node_workers)
    args.lr = 1.5e-4 * args.batch_size / 256 if args.lr is None else args.lr  # MoCo v3; a given 0 stays 0
    check_ranges(args, ['epochs', 'batch_size', 'eval_batch_size', 'knn_k', 'linear_epochs', 'img_size', 'proj_hidden',
                        'proj_dim', 'crop_min', 'tau', 'knn_t'],
                 ['train_subset', 'test_subset', 'linear_wd', 'log_every', 'eval_every', 'stop_after_epoch', 'workers',
                  'warmup_epochs', 'wd', 'clip_grad', 'rho', 'lr', 'moco_m', 'seed'], {}, stored_in=run)
    for flag, k in (('--warmup-epochs', 'warmup_epochs'), ('--stop-after-epoch', 'stop_after_epoch')):
        if getattr(args, k) > args.epochs:  # (stopping after an epoch the run never reaches: a flag acting on nothing)
            raise UserError(f'{flag} {getattr(args, k)} exceeds --epochs {args.epochs}')
    tiny = torch.finfo(torch.float32).tiny  # 1 / T scales float32 cosines: below float32's smallest normal, inf
    if bad := [f'--{k.replace("_", "-")} {getattr(args, k):g}' for k in ('tau', 'knn_t') if getattr(args, k) < tiny]:
        raise UserError(f"{bad[0]} is below float32's smallest normal number ({tiny:.3g}): cos / T would overflow")
    args.eval = list(dict.fromkeys(args.eval))  # `--eval linear linear`: the probe once
    refuse_loose(p, argv, [(args.sam, '--sam', ('rho', 'adaptive')),
                           ('knn' in args.eval, '--eval knn', ('knn_k', 'knn_t')),
                           ('linear' in args.eval, '--eval linear', ('linear_epochs', 'linear_wd')),
                           (args.dataset != 'imagenet', '--dataset cifar10 or cifar100',
                            ('train_subset', 'test_subset'))])
    for k in ARCH[1:] if 'saved_args' in args else ():  # the weights are the run's: name the flag, not the tensors
        if k in args.saved_args and given(p, argv, k) and typed(k, args.saved_args[k]) != typed(k, getattr(args, k)):
            raise UserError(f'{run} is a run with {typed(k, args.saved_args[k])}: its weights are of that '
                            f'architecture; leave {typed(k, getattr(args, k)).split()[0]} out (or start a new run)')
    return args


def typed(key, v):  # the flag that sets `key` to v as a command line types it (a list's words sorted: any order)
    return f'--{"no-" * (not v)}{key}'.replace('_', '-') if isinstance(v, bool) else \
        f'--{key.replace("_", "-")} {" ".join(sorted(map(str, v))) if isinstance(v, list) else v}'


# -----------------------------------------------------------------------------
# Model: MoCo v3 (Chen, Xie & He 2021, Sec. 3, Alg. 1) around vit.py's VisionTransformer (views: augment.py).
def build_backbone(args):
    """The ViT without a head (forward gives the head's input: the feature), built as train_cifar.py builds it
    (models.build_model), so that it has the geometry of the model it fine-tunes (patch p/4 at 32 px)."""
    if args.model not in vit.configs:
        raise UserError(f"unknown ViT config {args.model!r}; valid names: {', '.join(vit.configs)}")
    model = build_model(args.model, 0, args.img_size, parse_model_kw(args.model_kw), cifar=True)
    dim = model.pos_embed.shape[-1]
    if args.pos_embed == 'sincos':
        if dim % 4:
            raise UserError(f'--pos-embed sincos needs a width divisible by 4, got dim={dim}')
        model.pos_embed.data.copy_(vit.sincos_pos_embed(model.grid, dim, model.num_prefix_tokens))
        model.pos_embed.requires_grad_(False)
    if args.freeze_patch_embed:  # Sec. 4.2: a fixed random patch projection stabilises training
        model.patch_embed.requires_grad_(False)
    return model


class GlobalBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d over the GLOBAL batch, as MoCo v3's SyncBatchNorm (CUDA only): the batch is gathered with
    the autograd-aware all_gather (gloo too), normalised whole, this rank's rows kept."""

    def forward(self, x):  # (b, C) -> (b, C)
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        r = dist.get_rank()
        return super().forward(torch.cat(dist_nn.all_gather(x)))[r * len(x):(r + 1) * len(x)]


def mlp(num_layers, in_dim, hidden, out_dim):
    """builder.py _build_mlp: (Linear without bias -> BN -> ReLU) x (n-1), Linear -> BN without affine."""
    layers = []
    for i in range(num_layers):
        layers.append(nn.Linear(in_dim if i == 0 else hidden, out_dim if i == num_layers - 1 else hidden, bias=False))
        layers += [GlobalBatchNorm1d(hidden), nn.ReLU(inplace=True)] if i < num_layers - 1 else \
            [GlobalBatchNorm1d(out_dim, affine=False)]  # SimCLR's last BN, gamma removed
    return nn.Sequential(*layers)


def contrastive_loss(q, k, tau):
    """ctr(q, k) of MoCo v3 Alg. 1, InfoNCE (eq. 1): -log exp(q.k+/tau) / sum_k exp(q.k/tau) over the keys
    of the global batch (query i of rank r: positive key N*r + i), times 2*tau as builder.py does. The
    keys are targets: gathered without gradient (builder.py concat_all_gather)."""
    q, k = F.normalize(q.float(), dim=1), F.normalize(k.float(), dim=1)
    rank = 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        keys = [torch.empty_like(k) for _ in range(dist.get_world_size())]
        dist.all_gather(keys, k.contiguous())
        k, rank = torch.cat(keys), dist.get_rank()  # (W*N, C)
    with torch.autocast(q.device.type, enabled=False):  # fp32 logits: in bf16, q.k / 0.2 resolves to ~0.01
        logits = q @ k.T / tau  # (N, W*N)
    return F.cross_entropy(logits, torch.arange(len(q), device=q.device) + len(q) * rank) * (2 * tau)


class MoCo(nn.Module):
    """f_q = backbone + projector, a predictor on top; f_k = EMA of f_q (no predictor)."""

    def __init__(self, backbone, proj_dim, proj_hidden, tau):
        super().__init__()
        self.base_encoder = nn.Sequential(backbone, mlp(3, backbone.pos_embed.shape[-1], proj_hidden, proj_dim))
        self.predictor = mlp(2, proj_dim, proj_hidden, proj_dim)
        self.momentum_encoder = copy.deepcopy(self.base_encoder).requires_grad_(False)  # theta_k = theta_q at init
        self.tau = tau

    def forward(self, x1, x2, k1, k2):  # views (b, 3, S, S), their keys f_k(x) (b, proj_dim)
        q1, q2 = self.predictor(self.base_encoder(x1)), self.predictor(self.base_encoder(x2))
        return contrastive_loss(q1, k2, self.tau) + contrastive_loss(q2, k1, self.tau)  # symmetrised

    @torch.no_grad()
    def update_momentum_encoder(self, m):  # theta_k <- m theta_k + (1 - m) theta_q (MoCo eq. 2)
        # = theta_k + (1 - m) (theta_q - theta_k): torch.optim.swa_utils' EMA, one torch._foreach_lerp_ over all
        # parameters (was 3 kernels per parameter, ~650 launches a ViT-S step; tests/test_fast_input.py)
        get_ema_multi_avg_fn(m)(list(self.momentum_encoder.parameters()), list(self.base_encoder.parameters()), None)


def lr_at(t, args):  # main_moco.py adjust_learning_rate at t epochs (fractional)
    if t < args.warmup_epochs:
        return args.lr * t / args.warmup_epochs
    return args.lr * 0.5 * (1 + math.cos(math.pi * (t - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))


def momentum_at(t, args):  # main_moco.py adjust_moco_momentum: moco_m at t = 0, 1 at the end
    return 1 - 0.5 * (1 + math.cos(math.pi * t / args.epochs)) * (1 - args.moco_m)


# -----------------------------------------------------------------------------
# Data. CIFAR: data.load_cifar, decoded once onto the device as uint8. imagenet: torchvision's
# ImageFolder + DataLoader, decoded to uint8 squares (train_imagenet.py's resize and crop).
def load_data(args, device, rank=0, world=1):
    if args.dataset != 'imagenet':
        # (the probes classify: every class needs an image in both subsets)
        train_x, train_y = load_cifar(args.data, args.dataset, True, args.train_subset, subset_flag='--train-subset')
        test_x, test_y = load_cifar(args.data, args.dataset, False, args.test_subset, subset_flag='--test-subset')
        return dict(train=train_x.to(device), train_eval=train_x.to(device), train_y=train_y.to(device),
                    test=test_x.to(device), test_y=test_y.to(device), classes=NUM_CLASSES[args.dataset],
                    norm=(MEAN[args.dataset], STD[args.dataset]))
    side, sets = round(args.img_size / 0.875), {}  # 256 for 224
    for split in ('train', 'val'):  # data.ImageFolder: an unreadable image comes back with a label < 0 (check_decoded)
        sets[split] = ImageFolder(args.data, split, None, side if split == 'train' else args.img_size)
    if sets['train'].classes != sets['val'].classes:
        raise UserError(f'--data {args.data}: train and val have different class folders')
    train_eval, test = copy.copy(sets['train']), sets['val']
    train_eval.img_size = args.img_size  # (the side of its blank stand-in for an unreadable image)
    sets['train'].transform = v2.Compose([v2.Resize(side), v2.CenterCrop(side), v2.PILToTensor()])
    train_eval.transform = test.transform = v2.Compose([v2.Resize(side), v2.CenterCrop(args.img_size),
                                                        v2.PILToTensor()])
    # Loaders built once, workers persistent: the train loader's batch_sampler is a list epoch_order refills each
    # epoch; the (pinned) feature loaders read this rank's rows of train and val, as features() slices a tensor.
    kw = dict(num_workers=args.workers, pin_memory=device.type == 'cuda', persistent_workers=args.workers > 0)
    rows = lambda n: range(n * rank // world, n * (rank + 1) // world)
    return dict(train=torch.utils.data.DataLoader(sets['train'], batch_sampler=[], **kw),
                train_eval=torch.utils.data.DataLoader(train_eval, args.eval_batch_size, sampler=rows(len(train_eval)),
                                                       **kw),
                train_y=torch.tensor(sets['train'].targets, device=device),
                test=torch.utils.data.DataLoader(test, args.eval_batch_size, sampler=rows(len(test)), **kw),
                test_y=torch.tensor(test.targets, device=device), classes=len(test.classes),
                norm=(IMAGENET_MEAN, IMAGENET_STD))


# -----------------------------------------------------------------------------
# Evaluation on frozen features (probes.py: the features, k-NN, the linear probe), exact under DDP.
def evaluate(backbone, data, args, autocast, rank, world, epoch, step, t_start):
    """One eval row per protocol: loss (cross-entropy; k-NN: -log of the true class's vote share, floored
    at 1e-6), top-1/5 (%), correct and n counted over the whole test set, each image once."""
    mean, std = (torch.tensor(v, device=data['test_y'].device).view(1, 3, 1, 1) for v in data['norm'])
    n_tr, n_te = len(data['train_y']), len(data['test_y'])
    train_f = gather_rows(features(backbone, data['train_eval'], n_tr * rank // world, n_tr * (rank + 1) // world,
                                   args, autocast, mean, std), n_tr, world)
    lo, hi = n_te * rank // world, n_te * (rank + 1) // world
    test_f, test_y = features(backbone, data['test'], lo, hi, args, autocast, mean, std), data['test_y'][lo:hi]
    if not train_f.isfinite().all():  # (one sync; train_f is every rank's) no nan accuracy, no unwritable metrics
        raise UserError(f"the backbone's features are not finite (inf/nan) at epoch {epoch}: nothing to probe")
    rows = []
    for protocol in args.eval:
        if protocol == 'knn':
            scores = knn_scores(train_f, data['train_y'], test_f, data['classes'], args.knn_k, args.knn_t)
            loss = -scores.gather(1, test_y[:, None]).clamp_min(1e-6).log()
        else:
            clf, mu, sd = linear_probe(train_f, data['train_y'], data['classes'], args) if rank == 0 else \
                (nn.Linear(train_f.shape[1], data['classes']).to(mean.device), train_f.mean(0), train_f.std(0) + 1e-6)
            for t in clf.parameters() if world > 1 else ():  # rank 0 trained the probe: the others receive it
                dist.broadcast(t.data, 0)
            scores = clf((test_f - mu) / sd)  # logits
            loss = F.cross_entropy(scores, test_y, reduction='none')
        hits = scores.topk(min(5, data['classes']), dim=1).indices == test_y[:, None]
        sums = torch.stack([loss.sum().double(), hits[:, 0].sum().double(), hits.any(1).sum().double(),
                            torch.tensor(float(len(test_y)), dtype=torch.float64, device=loss.device)])
        if world > 1:
            dist.all_reduce(sums)
        loss_sum, c1, c5, n = sums.tolist()
        rows.append(dict(kind='eval', protocol=protocol, epoch=epoch, step=step, loss=loss_sum / n, top1=100 * c1 / n,
                         top5=100 * c5 / n, correct=int(c1), n=int(n), elapsed_s=time.time() - t_start))
    return rows


# -----------------------------------------------------------------------------
def make_moco(args):
    """MoCo around a fresh ViT (the same initial weights on every rank), then --resume's MoCo state, or
    --checkpoint's weights (any format models.load_weights reads, any head) in the backbone. -> (moco, ckpt)"""
    torch.manual_seed(args.seed)
    moco = MoCo(build_backbone(args), args.proj_dim, args.proj_hidden, args.tau)
    ckpt = read_checkpoint(args.resume, '--resume') if args.resume else None
    if ckpt:
        try:
            moco.load_state_dict(ckpt['moco'])
        except RuntimeError as e:
            raise UserError(f'--resume {args.resume} does not fit: {one_line(e)}')
    if args.checkpoint:
        full = build_model(args.model, 10, args.img_size, parse_model_kw(args.model_kw), cifar=True)
        load_weights(full, args.checkpoint, finetune=True)
        moco.base_encoder[0].load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith('head.')})
    moco.to(memory_format=torch.channels_last if args.channels_last else torch.preserve_format)  # a ViT: as asked
    return moco, ckpt


def save_run(out_dir, moco, backbone, opt, scaler, epoch, step, history, run_args, classes):
    """last.pt: 'model' is the backbone under vit.py's (timm's) keys with vit.py's own zero head (for
    train_cifar.py --pretrained); 'moco' the whole of MoCo, to resume. Then metrics.jsonl and args.json."""
    head = {'head.weight': torch.zeros(classes, backbone.pos_embed.shape[-1]), 'head.bias': torch.zeros(classes)}
    save_atomic(out_dir / 'last.pt', {
        'model': {**backbone.state_dict(), **head}, 'moco': moco.state_dict(), 'history': history,
        'optimizer': opt.state_dict(), 'scaler': scaler.state_dict(), 'epoch': epoch + 1, 'step': step,
        'args': run_args})
    save_atomic(out_dir / 'metrics.jsonl', history)
    save_atomic(out_dir / 'args.json', run_args)


def epoch_order(args, data, gen, steps, B, b, rank):
    """This epoch's order of the training images, one permutation for every rank (rank r takes its slice of each
    global batch of B), on the device; ImageNet: also the loader that reads this rank's images in that order."""
    perm = torch.randperm(len(data['train_y']), generator=torch.Generator().manual_seed(gen.initial_seed()))
    if args.dataset != 'imagenet':
        return perm.to(gen.device), None
    data['train'].batch_sampler[:] = [perm[i * B + rank * b:i * B + (rank + 1) * b].tolist() for i in range(steps)]
    return perm.to(gen.device), iter(data['train'])  # (the persistent workers take this epoch's batches)


def eval_line(args, rows, world):
    return (f'eval | {args.checkpoint or f"random init, seed {args.seed}"} | {args.model} on {args.dataset} | '
            + ' | '.join(f'{r["protocol"]} acc {r["top1"]:.2f}% ({r["correct"]}/{r["n"]}) loss {r["loss"]:.4f}'
                         for r in rows) + f' | world {world}')


def done_line(args, history, t_start, last):
    accs = {p: [r['top1'] for r in history if r['kind'] == 'eval' and r['protocol'] == p] for p in args.eval}
    return (f'done | {args.model} on {args.dataset} | epoch {args.epochs}/{args.epochs} | '
            + ' | '.join(f'{p} acc {a[-1]:.2f}% (best {max(a):.2f}%)' for p, a in accs.items() if a)
            + f' | {fmt_time(time.time() - t_start)} wall | {last}')


def main(argv=None):
    args, t_start = get_args(argv), time.time()
    proc = setup(args.amp)  # rank, device (cuda:LOCAL_RANK when there is a GPU), autocast
    rank, world, device, autocast, log, ddp = proc.rank, proc.world, proc.device, proc.autocast, proc.log, proc.ddp
    if not args.eval_only and (args.batch_size % world or args.batch_size < 2 * world):  # BatchNorm: 2 images
        raise UserError(f'--batch-size {args.batch_size} (global) ' + (f'does not divide by the world size {world}' if
                        args.batch_size % world else 'needs 2 or more images a process: the projector normalises'))
    B, b = args.batch_size, args.batch_size // world  # global, per rank
    moco, ckpt = make_moco(args)
    backbone = moco.to(device).base_encoder[0]  # the query encoder's ViT: what is evaluated and exported
    out_dir = prepare_out(args) if proc.master and not args.eval_only else Path(args.out)
    init_group(proc)
    with rank_zero_first(proc) if args.dataset != 'imagenet' else contextlib.nullcontext():  # a CIFAR download
        data = load_data(args, device, rank, world)  # (ImageNet: each rank scans the folders itself, no barrier)
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in data['norm'])
    if (have := len(data['train_y'].unique())) < 2:  # a probe of one class would score 100% of nothing
        raise UserError(f'the training set holds images of {have} class: the k-NN and linear probes need 2 or more')
    if args.eval_only:
        log(eval_line(args, evaluate(backbone, data, args, autocast, rank, world, 0, 0, t_start), world))
        return leave(ddp)
    if (steps := (n_train := len(data['train_y'])) // B) == 0:  # the last partial batch is dropped
        raise UserError(f'the training set has {n_train} images, fewer than --batch-size {B}')
    # --- optimizer, loss scaling, DDP, resume ---------------------------------------------------------------
    params = [p for p in moco.parameters() if p.requires_grad]  # f_q and the predictor; not f_k, not frozen ones
    opt = SAM(params, torch.optim.AdamW, rho=args.rho, adaptive=args.adaptive, lr=args.lr, weight_decay=args.wd) \
        if args.sam else torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd)
    scaler, model = torch.amp.GradScaler(device.type, enabled=proc.amp == 'fp16'), wrap_ddp(moco, proc)  # (bf16: off)
    start_epoch, step, history = restore(ckpt, opt, scaler, args, NOT_INHERITED, log) if ckpt else (0, 0, [])
    check_lr_not_all_zero((lr_at(e + i / steps, args) for e in range(start_epoch, args.epochs) for i in range(steps)),
                          args, steps, start_epoch, "MoCo v3's warm-up", 'raise --epochs or pass --warmup-epochs 0')
    run_args = {k: v for k, v in vars(args).items() if k != 'saved_args'}
    log(f'{args.model} {" ".join(args.model_kw)} ({sum(p.numel() for p in backbone.parameters()):,} backbone params, '
        f'{sum(p.numel() for p in params):,} trained) MoCo v3 on {args.dataset}: {n_train:,} train / '
        f'{len(data["test_y"]):,} test | {args.epochs} epochs x {steps} steps of {B} ({world} x {b}) | AdamW lr '
        f'{args.lr:.3g} wd {args.wd} | tau {args.tau} m {args.moco_m} -> 1{f" | SAM rho {args.rho}" * args.sam} | '
        f'amp {proc.amp} | {device}')
    # --- training loop --------------------------------------------------------------------------------------
    last, epoch, saved = out_dir / 'last.pt', start_epoch, (args.resume, start_epoch)  # saved: the last good one
    first_bad = torch.full((), NO_STEP, device=device)  # first non-finite loss, on the device: no sync
    gen, t_loop, step0 = torch.Generator(device), time.time(), step  # (a resume may change the steps per epoch)
    try:
        for epoch in range(start_epoch, args.epochs):
            # Every draw of this epoch comes from (seed, epoch): an exact resume at an epoch boundary. Data
            # order and views are the same on every rank (rank r takes its slice); dropout differs per rank.
            torch.manual_seed(epoch_seed(args.seed, epoch, rank))
            gen.manual_seed(epoch_seed(args.seed, epoch))
            perm, loader = epoch_order(args, data, gen, steps, B, b, rank)
            t_epoch, t_row, row_start = time.time(), time.time(), 0
            sums = torch.zeros(2, 2, dtype=torch.float64, device=device)  # (since the last row, epoch) x (loss, gap)
            moco.train()
            for i in range(steps):
                lr = lr_at(epoch + i / steps, args)
                for group in opt.param_groups:
                    group['lr'] = lr
                x = decoded_images(next(loader), data['train'].dataset).to(device, non_blocking=True) if loader else \
                    data['train'][perm[i * B + rank * b:i * B + (rank + 1) * b]]  # rank r's slice of global batch i
                x1, x2 = (augment.moco_view(x, gen, B, rank * b, (rank + 1) * b, v, args.img_size, args.crop_min, mean,
                                            std) for v in (0, 1))
                with torch.no_grad(), autocast:  # the keys: targets from f_k, once per step (both SAM passes)
                    k1, k2 = moco.momentum_encoder(x1), moco.momentum_encoder(x2)
                # SAM (Foret et al. Alg. 1, sam.py), as train_cifar.py: eps-hat from this rank's batch (m-sharpness)
                with first_pass(model) if args.sam else contextlib.nullcontext():
                    with autocast:
                        loss = model(x1, x2, k1, k2)
                    scaler.scale(loss).backward()
                if args.sam:
                    opt.first_step(zero_grad=True)  # w <- w + eps-hat
                    with second_pass(model):  # the same views and keys at w + eps-hat
                        with autocast:
                            loss_sam = model(x1, x2, k1, k2)
                        scaler.scale(loss_sam).backward()
                    sums[:, 1] += (loss_sam.detach() - loss.detach()).double()  # GSAM's surrogate gap h = f_p - f
                if args.clip_grad > 0:
                    scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(params, args.clip_grad)
                scaler.step(opt)  # SAM: w restored from its copy, then the AdamW step with g_SAM
                scaler.update()
                opt.zero_grad(set_to_none=True)
                # f_k follows the updated (restored, then stepped) f_q, once per step, with m at the step's end
                moco.update_momentum_encoder(momentum_at(epoch + (i + 1) / steps, args))
                step += 1
                loss = loss.detach().double()
                first_bad = torch.where(loss.isfinite(), first_bad, first_bad.clamp(max=step))
                sums[:, 0] += loss
                if i + 1 == steps or (args.log_every and (i + 1) % args.log_every == 0):  # a train row
                    if ddp:
                        dist.all_reduce(sums)
                        sums /= world
                    check_finite(first_bad, steps, saved, distributed=ddp)  # the host sync, every row
                    now, avg = time.time(), (sums[0] / (i + 1 - row_start)).tolist()  # (not mean: the pixels')
                    history.append(dict(kind='train', epoch=epoch + 1, step=step, lr=lr, loss=avg[0],
                                        **({'surrogate_gap': avg[1]} if args.sam else {}),
                                        img_per_s=(i + 1 - row_start) * B / (now - t_row), elapsed_s=now - t_start))
                    if proc.master and i + 1 < steps:
                        log(f'ep {epoch + 1}/{args.epochs} step {i + 1}/{steps} | loss {history[-1]["loss"]:.4f} | '
                            f'lr {lr:.2e} | {history[-1]["img_per_s"]:,.0f} img/s | '
                            f'eta {eta(t_loop, step - step0, (args.epochs - epoch) * steps - i - 1)}')
                        if saved[0] or not args.overwrite:  # --overwrite: the old run stays whole until epoch 1 ends
                            save_atomic(out_dir / 'metrics.jsonl', history)
                    sums[0], t_row, row_start = 0, now, i + 1
            sync_buffers(moco, ddp)  # --- end of epoch: rank 0's BatchNorm statistics, exact evaluation, checkpoint
            due = epoch + 1 == args.epochs or (args.eval_every and (epoch + 1) % args.eval_every == 0)
            evals = evaluate(backbone, data, args, autocast, rank, world, epoch + 1, step, t_start) if due else []
            history += evals
            log(f'ep {epoch + 1}/{args.epochs} | train loss {sums[1, 0].item() / steps:.4f} | '
                + ''.join(f'{r["protocol"]} acc {r["top1"]:.2f}% | ' for r in evals) + f'{time.time() - t_epoch:.1f} s'
                f' | eta {eta(t_loop, step - step0, (args.epochs - epoch - 1) * steps)}')
            if proc.master:
                save_run(out_dir, moco, backbone, opt, scaler, epoch, step, history, run_args, data['classes'])
            saved = (last, epoch + 1)
            if epoch + 1 == args.stop_after_epoch < args.epochs:
                log(f'stopped after epoch {epoch + 1} (--stop-after-epoch); continue with --resume {last}')
                break
    except KeyboardInterrupt:
        log(f'train_contrastive.py: interrupted in epoch {epoch + 1}; {since_checkpoint(saved)}', file=sys.stderr)
        sys.exit(130)
    if saved[1] == args.epochs:
        log(done_line(args, history, t_start, last))
    leave(ddp)  # (a barrier first: rank 0 may still be saving)


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(discard_new_dirs() or f'train_contrastive.py: error: {e}')  # (and no empty --out left behind)
    except KeyboardInterrupt:
        print(discard_new_dirs() or 'train_contrastive.py: interrupted before training started; nothing was saved',
              file=sys.stderr)
        sys.exit(130)
