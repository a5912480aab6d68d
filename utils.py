"""Run plumbing shared by every script: the one user-error mechanism, where this process runs (torchrun's
environment, device, mixed precision), divergence, exact evaluation, progress, teardown (the run folder: runs.py).
Nothing here is part of an algorithm: the scripts keep their training loops (and the SAM step) written out."""
import contextlib
import datetime
import inspect
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NO_STEP = 2 ** 62  # "no step yet" for the first non-finite loss
EXTRAS = 'pip install -r requirements-extras.txt'


class UserError(Exception):  # a mistake in the command line or the files it names: one line, exit 1
    """Each script catches it in __main__ and exits with `SCRIPT: error: MESSAGE`."""


def one_line(e):  # an exception's message on one line
    return ' '.join(str(e).split())


def fmt_time(s):
    s = int(round(s))
    return f'{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}' if s >= 3600 else f'{s // 60}:{s % 60:02d}'


def epoch_seed(*key):
    """A 32-bit seed that depends on every item of key, e.g. (seed, epoch, rank) or (seed, corruption, image)."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0])


# ----- Where this process runs: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; alone, it is rank 0 of 1.
@dataclass
class Process:
    rank: int
    local_rank: int
    world: int
    device: torch.device
    amp: str  # 'bf16', 'fp16' or 'off'
    amp_dtype: torch.dtype  # None for 'off'
    autocast: torch.autocast  # reusable: `with proc.autocast:`
    ddp: bool  # world > 1: torchrun started this process

    @property
    def master(self):  # the one process that prints and saves
        return self.rank == 0

    def log(self, *args, **kw):
        if self.master:
            print(*args, **kw, flush=True)


def setup(amp='auto'):
    """This process's rank, device (cuda:LOCAL_RANK when CUDA is there) and autocast. amp 'auto': bf16 on a GPU
    that has it, else off. TF32 and cudnn.benchmark on, as timm trains (exactness claims are tested on CPU)."""
    rank, local_rank, world = (int(os.environ.get(k, d)) for k, d in (('RANK', 0), ('LOCAL_RANK', 0),
                                                                       ('WORLD_SIZE', 1)))
    device = torch.device('cpu')
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(f'LOCAL_RANK {local_rank}, but this machine has {torch.cuda.device_count()} GPU(s): '
                            'pass --nproc_per_node <= the GPU count')
        device = torch.device('cuda', local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if amp == 'auto':
        amp = 'bf16' if device.type == 'cuda' and torch.cuda.is_bf16_supported() else 'off'
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'off': None}[amp]
    autocast = torch.autocast(device.type, dtype, enabled=dtype is not None)
    return Process(rank, local_rank, world, device, amp, dtype, autocast, world > 1)


def micro_batch_cap(make_model, img_size, half=True, device=None):
    """The default --max-micro-batch (train_imagenet.py): as many images as fit, by this model's activations at this
    image size, in 80% of the GPU's memory (the rest: the allocator's slack, cuDNN's workspace, temporaries) beside
    24 bytes a parameter (fp32 weights, gradients, AdamW's two moments, SAM's w or GSAM's g); 256 on the CPU.
    make_model() builds the model, here on the meta device; its activations: what autograd saves per image
    (saved_bytes; bf16 when half; the math attention keeps the (N, N) scores, which a GPU's fused kernels do not:
    the cap errs low). A fixed 256 per 40 GB ran ViT-L/16 and ViT-B/8 at 224 px and the 384 px fine-tune out of an
    80 GB card (~290, ~940, ~560 MiB an image; ViT-B/16 at 224 px ~110). None fits: one line (utils.fit)."""
    if not torch.cuda.is_available():
        return 256
    total = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).total_memory
    dtype = torch.bfloat16 if half else torch.float32
    with torch.device('meta'):
        model = make_model()
    per_image = saved_bytes(torch.empty(2, 3, img_size, img_size, device='meta', dtype=dtype), model.to(dtype))
    params = sum(p.numel() for p in model.parameters())
    return fit(per_image, 24 * params, total, 4096, f'--max-micro-batch: this model at {img_size} px',
               ' of this GPU\'s memory: a smaller model or --img-size')


def init_group(proc, timeout_min=60):
    """torchrun's process group: nccl on this process's GPU (not guessed from the global rank), gloo on CPUs; a
    timeout for ranks that wait while rank 0 saves or evaluates (NCCL's default: 10 minutes). No-op alone."""
    if proc.ddp:
        cuda = proc.device.type == 'cuda'
        dist.init_process_group('nccl' if cuda else 'gloo', device_id=proc.device if cuda else None,
                                timeout=datetime.timedelta(minutes=timeout_min))


@contextlib.contextmanager
def rank_zero_first(proc):
    """Rank 0 runs the block first (a download, a folder scan), the other ranks after it."""
    for first in (False, True):  # the others wait at the first barrier, rank 0 meets them at the second
        if proc.ddp and proc.master == first:
            dist.barrier()
        if not first:
            yield


def wrap_ddp(model, proc):
    """DistributedDataParallel under torchrun (its GPU, or the CPU), else the model; no broadcast of rank 0's buffers
    in every forward, twice a SAM step: no training forward reads a BatchNorm running statistic (sync_buffers)."""
    ddp = torch.nn.parallel.DistributedDataParallel  # broadcast_buffers: deprecated in torch 2.14, the only name before
    off = 'forward_sync_buffers' if 'forward_sync_buffers' in inspect.signature(ddp).parameters else 'broadcast_buffers'
    return ddp(model, [proc.device] if proc.device.type == 'cuda' else None, **{off: False}) if proc.ddp else model


def sync_buffers(model, distributed):  # rank 0's buffers on every rank (a collective) before they are read: each
    for b in model.buffers() if distributed else ():  # evaluation (sharded: exact only if every rank evaluates the
        dist.broadcast(b, 0)  # same model) and checkpoint (rank 0's is saved: a resume starts every rank from it)


def leave(distributed):
    if distributed:
        dist.barrier()  # rank 0 may still be writing: leave together (gloo aborts a one-sided teardown)
        dist.destroy_process_group()


def check_finite(first_bad, steps, saved, unit='epoch', distributed=False):
    """Stop on divergence. first_bad: the first step with a non-finite loss, or NO_STEP; reading it syncs;
    distributed (a collective, on every rank): the first of all ranks."""
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


@torch.no_grad()
def score(model, batches, autocast=None, distributed=False):
    """Mean loss and top-1/top-5 accuracy (%) of model (in eval mode) on (x, y) batches; distributed: over all
    ranks, each image counted once (the caller gives each rank its own images, no padding)."""
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


def progress_printer(prefix, every=10.0):
    """A progress callable printing at most one line per `every` seconds (none for short measurements)."""
    last = [time.time()]

    def log(msg):
        if time.time() - last[0] >= every:
            print(f'  {prefix} | {msg}', flush=True)
            last[0] = time.time()
    return log


def eta(t_loop, done, left):  # time left at the pace since t_loop: `done` steps took that long, `left` remain
    return fmt_time((time.time() - t_loop) / max(done, 1) * left)


def first_set(*values):  # the first value that is not None: a flag given as 0 is 0, not "unset" (0 == False)
    return next((v for v in values if v is not None), None)


# ----- Memory: defaults that fit the device (geometry.py hessian and ntk)
def free_memory(device):
    """Bytes this process may still allocate: CUDA's mem_get_info, else the RAM the kernel can give without swapping
    (/proc/meminfo's MemAvailable; elsewhere the free pages)."""
    if device.type == 'cuda':
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open('/proc/meminfo') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:'))
    except (OSError, StopIteration):
        return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def fit(per_item, fixed, free, most, what, hint=''):
    """How many items (images of an HVP batch, of an NTK chunk) of per_item bytes each fit beside `fixed` bytes in
    80% of `free` (the rest: allocator slack, temporaries), at most `most`; none: one line naming the need."""
    k = int((0.8 * free - fixed) // per_item)
    if k < 1:
        raise UserError(f'{what} needs {(fixed + per_item) / 0.8 / 2 ** 30:.1f} GiB at one image; '
                        f'{free / 2 ** 30:.1f} GiB free{hint}')
    return min(k, most)


def saved_bytes(x, fn):
    """Bytes autograd saves (the graph it keeps alive) per image of x while fn(x[:k]) runs: the difference between 2
    images and 1 (the weights, saved either way, cancel). geometry.py: an HVP's graphs, the NTK's forward."""
    def count(k):
        n = [0]

        def pack(t):
            n[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sdpa_kernel(SDPBackend.MATH):
            fn(x[:k])  # (the math attention: what the HVP and the NTK's vmap run)
        return n[0]
    return max(count(2) - count(1), 1)
