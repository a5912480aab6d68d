"""CIFAR augmentation on the training device, a whole batch at once, every random choice drawn per image.

    augment = make_augment(aug='strong', scale=0.75, randaug_n=1, randaug_m=8, jitter=0.1, reprob=0.25,
                           mean=(0.4914, 0.4822, 0.4465), std=(0.2471, 0.2435, 0.2616), device='cuda')
    x = augment(x_uint8)        # (B, 3, 32, 32) uint8 on the device -> normalised float32

strong (locuslab/convmixer-cifar10): RandomResizedCrop(32, scale=(scale, 1), ratio=(1, 1)) -> flip ->
    RandAugment(randaug_n, randaug_m) -> ColorJitter(jitter x 3) -> Normalize -> RandomErasing(reprob, value 0).
basic (the SAM paper's CIFAR setting, Foret et al. 2021): 4-px zero padding, random 32x32 crop, flip, Normalize.

Exactness: between ops an image is float32 holding integers 0..255, rounded or truncated where
torchvision's uint8 tensor ops do, so each op equals torchvision.transforms.v2's (tests/test_augment.py
checks it against torchvision's own RandAugment draws). locuslab runs the PIL ops, which round differently.

One code path for CPU and CUDA, without host syncs: every op takes per-image parameters, and an image
that did not draw an op gets its identity parameter (factor 1, 8 bits, threshold 256, the identity
matrix), which leaves it bit-exact; no op needs the list of images that drew it (boolean indexing
waits for the GPU; moco_view alone reads which images drew its costly ops, one host sync a view, to run them on
those only). The price: every stage runs on every image, arithmetic that a GPU hides behind the
model's forward pass; what it cannot hide is a kernel launch per op (microseconds each, for tensors of a
few MB). So ops of one form run as one: RandAugment's five geometric ops as one float64 grid and one
grid_sample; brightness, color, contrast and sharpness as one blend (ColorJitter's three too); scale 1
skips the crop (the identity). Launches per batch, any batch size: default recipe (strong, scale 1,
RandAugment(2, 12)) 360 before, 201 now; 'basic' 17; locuslab's (scale 0.75, RandAugment(1, 8), jitter
0.1, reprob 0.25) 375 before, 258 now. Counted on the CPU with torch.profiler (tests/test_augment.py count_launches):
    python -c "import torch; from tests.test_augment import count_launches, make; a = make()
    x = torch.zeros(64, 3, 32, 32, dtype=torch.uint8); print(count_launches(lambda: a(x)))"

TF32 (on in the training scripts) rounds float32 matmul and cuDNN conv inputs to 10 bits; no op here
depends on it: the affine grid is float64, sharpness's blur a box sum, gaussian_blur's conv runs with it off.
"""
import contextlib
import functools
import math
import numbers

import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF


# ----------------------------------------------------------------------------- Colour ops
# x: (B, 3, H, W) float32 integers; f: (B,) float64 (torchvision's factors are Python floats, 1 - f too).
def per_image(v):  # (B,) -> (B, 1, 1, 1) float32
    return v.float().view(-1, 1, 1, 1)


def grayscale(x):  # (B, 3, H, W) -> (B, 1, H, W): ITU-R 601-2 luma in torchvision's order, truncated
    r, g, b = x.unbind(1)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).floor_().unsqueeze(1)


def smooth(x):
    """PIL's SMOOTH filter as torchvision's adjust_sharpness has it (3x3: 1/13 around, 5/13 in the centre),
    rounded: (B, 3, H, W) integers -> (B, 3, H-2, W-2). A box sum, not torchvision's conv2d: the exact value is
    N/13 for an integer N, never within 1/26 of a half-integer, and both sums err by < 1e-2 (fp32 on values
    <= 255 * 13), so both round to the same integer; and a pooling runs no cuDNN/cuBLAS kernel, so TF32
    (torch.backends.cudnn.allow_tf32, on in the training scripts) cannot round the weights to 10 bits."""
    box = F.avg_pool2d(x, 3, stride=1)  # the 3x3 sum / 9
    return torch.add(box, x[:, :, 1:-1, 1:-1], alpha=4 / 9).mul_(9 / 13).round_()  # (sum + 4 * centre) / 13


def blend_ops(x, f, saturation, contrast, sharpness=None):
    """Brightness, saturation (RandAugment's Color), contrast and sharpness as one blend x * f + other * (1 - f),
    torchvision's formulas: image b blends with 0, its grey image, that image's mean or (inner pixels,
    x + (smooth - x) * (1 - f), torchvision's form; x * 1 is exact) its SMOOTH blur, by its factor f[b] ((B,)
    float64; 1 is the identity). saturation, contrast, sharpness: (B,) bool, the images taking that op (the
    others take brightness). One pass for the four ops: an image takes one of them, the rest are identities."""
    B = len(x)
    gray = grayscale(x)
    other = torch.where(saturation.view(B, 1, 1, 1), gray, torch.where(
        contrast.view(B, 1, 1, 1), gray.mean(dim=(1, 2, 3), keepdim=True), 0.0))
    a = f
    if sharpness is not None:
        other = torch.where(sharpness.view(B, 1, 1, 1), F.pad(smooth(x) - x[:, :, 1:-1, 1:-1], (1, 1, 1, 1)), other)
        a = torch.where(sharpness, 1.0, f)
    return torch.addcmul(x * per_image(a), other, per_image(1.0 - f)).clamp_(0, 255).floor_()  # floor: uint8 cast


def posterize(x, bits):  # keep the top `bits` bits (8 = identity)
    step = torch.exp2(8 - per_image(bits))
    return (x / step).floor_() * step


def solarize(x, threshold):  # invert pixels >= threshold (256 = identity)
    return torch.where(x >= per_image(threshold), 255 - x, x)


# ----------------------------------------------------------------------------- Geometry
@functools.lru_cache(maxsize=16)
def affine_basis(H, W, device):
    """(6, H*W*2) float64: grid = coef @ basis is torchvision's affine grid (_affine_grid: pixel centres,
    normalised for grid_sample with align_corners=False) of the per-image maps coef (B, 6) =
    (cos a, sin a, shear_x, shear_y, translate_x, translate_y), RandAugment's five geometric ops. Output pixel
    (x, y), centred on the image middle, reads input pixel (x', y') (torchvision's inverse map):
        x' = cos * x - sin * y + shear_x * (y + H/2) - translate_x   (ShearX about the top-left pixel:
        y' = sin * x + cos * y + shear_y * (x + W/2) - translate_y    torchvision's center=[0, 0])
    All-zero shears and translations with a = 0 give the identity. float64: one matmul of the batch, exact
    where torchvision's float32 bmm is (tests/test_augment.py), and out of TF32's reach (TF32 rounds float32
    matmul inputs to 10 bits under torch.backends.cuda.matmul.allow_tf32, which train_cifar.py switches on:
    0.8-1.5% of the pixels of each sheared or rotated image moved). Cached: no launches after the first call."""
    x = torch.linspace((1 - W) / 2, (W - 1) / 2, W, dtype=torch.float64, device=device).expand(H, W)
    y = torch.linspace((1 - H) / 2, (H - 1) / 2, H, dtype=torch.float64, device=device)[:, None].expand(H, W)
    zero, one = torch.zeros_like(x), torch.ones_like(x)
    gx = torch.stack([x, -y, y + H / 2, zero, -one, zero]) / (W / 2)  # x' / (W/2), per coef
    gy = torch.stack([y, x, zero, x + W / 2, zero, -one]) / (H / 2)
    return torch.stack([gx, gy], -1).view(6, H * W * 2)


def resized_crop_flip(x, top, left, side, flip):
    """Square crops (top, left, side: (B,) float64 pixel counts) resized bilinearly back to H x W as
    torchvision's resized_crop does (interpolate, align_corners=False, coordinates clamped to the
    crop), then mirrored where flip (B,) is True. One grid_sample for the batch."""
    B, _, H, W = x.shape
    u = torch.arange(W, dtype=torch.float64, device=x.device)
    # output pixel u reads the crop at (u + 0.5) * side / W - 0.5, clamped to [0, side - 1]
    offset = ((u + 0.5) * side[:, None] / W - 0.5).clamp(min=0).minimum(side[:, None] - 1)  # (B, W)
    gx, gy = left[:, None] + offset, top[:, None] + offset
    gx = torch.where(flip[:, None], gx.flip(1), gx)
    grid = torch.stack([(2 * gx[:, None, :].expand(B, H, W) + 1) / W - 1,  # normalised, align_corners=False
                        (2 * gy[:, :, None].expand(B, H, W) + 1) / H - 1], -1)
    return F.grid_sample(x, grid.to(x.dtype), mode='bilinear', padding_mode='border',
                         align_corners=False).round_()


def pad_crop_flip(x_u8, dy, dx, flip, pad=4):
    """Zero-pad by `pad` px, take the 32x32 window at (dy, dx) ((B,) ints in 0..2*pad), mirror where
    flip: exact integer shifts on uint8, by one gather."""
    B, _, H, W = x_u8.shape
    padded = F.pad(x_u8, (pad, pad, pad, pad))
    rows = dy[:, None] + torch.arange(H, device=x_u8.device)  # (B, H)
    cols = dx[:, None] + torch.arange(W, device=x_u8.device)  # (B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    b = torch.arange(B, device=x_u8.device)[:, None, None]
    return padded[b, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)  # (B, H, W, 3) -> (B, 3, H, W)


# -----------------------------------------------------------------------------
# RandAugment (Cubuk et al. 2020) as torchvision has it: 14 ops in torchvision's order, each drawn
# uniformly, at one magnitude bin m of 31; the signed ops take the negative magnitude with p = 1/2.
RA_OPS = ('Identity', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate', 'Brightness', 'Color',
          'Contrast', 'Sharpness', 'Posterize', 'Solarize', 'AutoContrast', 'Equalize')
RA_SIGNED = ('ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate', 'Brightness', 'Color', 'Contrast',
             'Sharpness')


def ra_magnitudes(m, size=32, num_bins=31):
    """Each op's unsigned magnitude at bin m, in RA_OPS order, computed as torchvision's table (float32)."""
    lin = lambda hi: torch.linspace(0.0, hi, num_bins)[m].item()
    translate = float(int(lin(150.0 / 331.0 * size)))  # torchvision: translate=[int(magnitude), 0]
    table = {'ShearX': lin(0.3), 'ShearY': lin(0.3), 'TranslateX': translate, 'TranslateY': translate,
             'Rotate': lin(30.0), 'Brightness': lin(0.9), 'Color': lin(0.9), 'Contrast': lin(0.9),
             'Sharpness': lin(0.9),
             'Posterize': float((8 - (torch.arange(num_bins) / ((num_bins - 1) / 4))).round().int()[m]),
             'Solarize': 255.0 * torch.linspace(1.0, 0.0, num_bins)[m].item()}
    return [table.get(name, 0.0) for name in RA_OPS]


def apply_ra_ops(x, op, magnitude):
    """Image b gets the RandAugment op RA_OPS[op[b]] at the signed magnitude[b] ((B,) float64: the
    factor - 1, the shear, pixels, degrees, bits or threshold). Every image goes through every stage; the
    images that did not draw its op get its identity parameter, so the result is exact (module docstring).
    Ops that share a form run as one: the five geometric ones as one grid_sample, the four blends as one."""
    B, _, H, W = x.shape
    drew = op[:, None] == torch.arange(len(RA_OPS), device=op.device)  # (B, 14): image b drew op k
    p = drew * magnitude[:, None]  # (B, 14) float64: the drawn op's magnitude, 0 elsewhere
    # ShearX, ShearY, TranslateX, TranslateY, Rotate: one nearest-neighbour grid_sample, zero fill
    a = torch.deg2rad(p[:, 5])
    grid = torch.cat([torch.stack([a.cos(), a.sin()], 1), p[:, 1:5]], 1) @ affine_basis(H, W, x.device)
    x = F.grid_sample(x, grid.view(B, H, W, 2).float(), mode='nearest', padding_mode='zeros', align_corners=False)
    # Brightness, Color, Contrast, Sharpness: one blend; f = 1 (the others' zeros add nothing): the identity
    x = blend_ops(x, 1.0 + p[:, 6:10].sum(1), drew[:, 7], drew[:, 8], drew[:, 9])
    x = posterize(x, torch.where(drew[:, 10], magnitude, 8.0))
    x = solarize(x, torch.where(drew[:, 11], magnitude, 256.0))
    # AutoContrast, Equalize: torchvision's own (batched there), picked per image on uint8
    x_u8 = x.to(torch.uint8)
    return torch.where(drew[:, 12].view(B, 1, 1, 1), TF.autocontrast(x_u8),
                       torch.where(drew[:, 13].view(B, 1, 1, 1), TF.equalize(x_u8), x_u8)).float()


# ----------------------------------------------------------------------------- MoCo v3 views (train_contrastive.py)
# BYOL's ColorJitter with hue, GaussianBlur and a RandomResizedCrop of any aspect ratio, equal to torchvision's.
def adjust_hue(x, f):
    """torchvision's adjust_hue per image (f: (B, 1, 1) in [-0.5, 0.5]): RGB -> HSV (PIL's formulas),
    h <- (h + f) mod 1, HSV -> RGB, back to integers as to_dtype(uint8) does."""
    x = x * (1.0 / 255)
    r, g, _ = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    eqc, ones = maxc == minc, torch.ones_like(maxc)  # grey pixels: h = s = 0 (divisors replaced by 1)
    s = (maxc - minc) / torch.where(eqc, ones, maxc)
    rc, gc, bc = ((maxc.unsqueeze(1) - x) / torch.where(eqc, ones, maxc - minc).unsqueeze(1)).unbind(1)
    hr = (bc - gc) * (maxc == r)
    hg = (rc + 2.0 - bc) * ((maxc == g) & (maxc != r))
    hb = (gc + 4.0 - rc) * ((maxc != g) & (maxc != r))
    h = (((hr + hg + hb) * (1.0 / 6.0) + 1.0).fmod(1.0) + f).remainder(1.0)
    h6 = h * 6  # sector i = floor(6h) picks each channel from (v, p, q, t)
    i = h6.floor()
    frac, i = h6 - i, i.int().remainder(6)
    v, p, q, t = maxc, (1.0 - s) * maxc, (1.0 - s * frac) * maxc, (s * frac + (1.0 - s)) * maxc
    p, q, t = p.clamp(0, 1), q.clamp(0, 1), t.clamp(0, 1)
    red = torch.where(i == 0, v, torch.where(i == 1, q, torch.where(i <= 3, p, torch.where(i == 4, t, v))))
    green = torch.where(i == 0, t, torch.where(i <= 2, v, torch.where(i == 3, q, p)))
    blue = torch.where(i <= 1, p, torch.where(i == 2, t, torch.where(i <= 4, v, q)))
    return torch.stack([red, green, blue], 1).mul_(255 + 1.0 - 1e-3).floor_()


def color_jitter(x, factors, order, hue_rows=None):
    """ColorJitter: brightness, contrast, saturation factors and a hue offset (factors (B, 4) float64), in
    a per-image order (B, 4) (a permutation of 0..3 per row): slot s of image b runs op order[b, s].
    hue_rows: per slot, the indices (int64, on x's device) of the images that run hue there, for hue on those
    only (the caller read order on the host); None: hue on all, kept where drawn (no host sync)."""
    B = len(x)
    for slot in range(4):
        k = order[:, slot]  # 0 brightness, 1 contrast, 2 saturation (one blend, factor 1 for hue: the identity)
        x = blend_ops(x, torch.where(k == 3, 1.0, factors.gather(1, k[:, None])[:, 0]), k == 2, k == 1)
        if hue_rows is None:
            x = torch.where((k == 3).view(B, 1, 1, 1), adjust_hue(x, factors[:, 3].float().view(B, 1, 1)), x)
        elif len(rows := hue_rows[slot]):  # (per image: the other rows' pixels do not enter)
            x = x.index_copy(0, rows, adjust_hue(x[rows], factors[rows, 3].float().view(-1, 1, 1)))
    return x


@contextlib.contextmanager
def no_tf32():
    """cuDNN convolutions in full float32 inside, the caller's setting restored after. The training scripts
    switch TF32 on (torch.backends.cudnn.allow_tf32 = True, utils.setup); TF32 rounds a float32 conv's inputs
    to 10 mantissa bits, and an image's blur then rounds differently from torchvision's. The legacy flag, as
    utils.py sets it (torch 2.14 reads it whichever API set it, unless cudnn.conv and cudnn.rnn were given
    different fp32_precision values). A Python global: no device work, no sync."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def gaussian_blur(x, sigma, kernel_size):
    """torchvision's gaussian_blur per image (sigma (B,)): reflect padding, one grouped conv, rounded."""
    B, C, H, W = x.shape
    lim = (kernel_size - 1) / (2 * math.sqrt(2))
    k1 = torch.softmax(-(torch.linspace(-lim, lim, kernel_size, device=x.device) / sigma[:, None]).pow(2), 1)
    k2 = (k1[:, :, None] * k1[:, None, :]).repeat_interleave(C, 0)[:, None]  # (B*C, 1, k, k)
    with no_tf32():  # float32 as torchvision computes it (float64 would round a few pixels differently)
        out = F.conv2d(F.pad(x.reshape(1, B * C, H, W), [kernel_size // 2] * 4, mode='reflect'), k2, groups=B * C)
    return out.view(B, C, H, W).round_()



def resized_crop_rect_flip(x, top, left, height, width, size, flip):
    """Per-image boxes ((B,) float64 pixel counts) resized bilinearly to size x size as torchvision's
    resized_crop (align_corners=False, edges clamped to the box; antialias is a no-op when enlarging),
    mirrored where flip (B,). resized_crop_flip above is for squares; this one for any aspect ratio."""
    B, _, H, W = x.shape
    u = torch.arange(size, dtype=torch.float64, device=x.device)
    # output pixel u reads the box at (u + 0.5) * side / size - 0.5, clamped to [0, side - 1]
    ox = ((u + 0.5) * width[:, None] / size - 0.5).clamp(min=0).minimum(width[:, None] - 1)  # (B, size)
    oy = ((u + 0.5) * height[:, None] / size - 0.5).clamp(min=0).minimum(height[:, None] - 1)
    gx, gy = left[:, None] + ox, top[:, None] + oy
    gx = torch.where(flip[:, None], gx.flip(1), gx)
    grid = torch.stack([((2 * gx + 1) / W - 1)[:, None, :].expand(B, size, size),
                        ((2 * gy + 1) / H - 1)[:, :, None].expand(B, size, size)], -1)
    return F.grid_sample(x, grid.to(x.dtype), mode='bilinear', padding_mode='border', align_corners=False).round_()


def random_erasing(x, p, rand=None, noise=False):
    """RandomErasing(p, scale=(0.02, 0.33), ratio=(0.3, 3.3)) per image of a normalised batch (B, 3, H, W):
    torchvision's 10 tries at once (the first box that fits), at a uniform position, filled with 0 (locuslab's
    value=0) or with N(0, 1) noise (timm's 'pixel' mode: noise=True, from torch's RNG). rand(*shape, dtype): the
    uniform draws (default torch.rand on x's device). No host sync."""
    rand = rand or (lambda *shape, dtype=torch.float32: torch.rand(*shape, dtype=dtype, device=x.device))
    B, _, H, W = x.shape
    area = (0.02 + 0.31 * rand(B, 10, dtype=torch.float64)) * H * W
    log_ratio = math.log(0.3) + (math.log(3.3) - math.log(0.3)) * rand(B, 10, dtype=torch.float64)
    h, w = torch.sqrt(area * log_ratio.exp()).round(), torch.sqrt(area / log_ratio.exp()).round()
    fits = (h < H) & (w < W)
    first = fits.int().argmax(1, keepdim=True)
    h, w = h.gather(1, first)[:, :, None], w.gather(1, first)[:, :, None]  # (B, 1, 1)
    top = (rand(B, 1, 1, dtype=torch.float64) * (H - h + 1)).floor()
    left = (rand(B, 1, 1, dtype=torch.float64) * (W - w + 1)).floor()
    on = ((rand(B, 1) < p) & fits.any(1, keepdim=True))[:, :, None]
    rows = torch.arange(H, dtype=torch.float64, device=x.device)[None, :, None]
    cols = torch.arange(W, dtype=torch.float64, device=x.device)[None, None, :]
    box = ((rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w) & on)[:, None]  # (B, 1, H, W)
    return torch.where(box, torch.randn_like(x), x) if noise else x.masked_fill(box, 0.0)


def normalize(x, mean, std):
    """ToTensor + Normalize: (B, 3, H, W) values 0..255 -> float32, contiguous NCHW whatever x's strides
    (pad_crop_flip's gather gives NHWC strides): the memory format is the caller's choice (train_cifar.py
    --channels-last converts), one layout for every recipe. mean, std: (1, 3, 1, 1) tensors."""
    return x.to(torch.float32, memory_format=torch.contiguous_format).div(255).sub_(mean).div_(std)


# -----------------------------------------------------------------------------
class Augment:
    """make_augment's pipeline; its constants are put on the device once (a per-step copy would block)."""

    def __init__(self, *, aug, scale, randaug_n, randaug_m, jitter, reprob, mean, std, device, seed):
        device = torch.device(device)
        self.aug, self.scale, self.randaug_n, self.jitter, self.reprob = aug, scale, randaug_n, jitter, reprob
        self.generator = torch.Generator(device).manual_seed(seed)
        self.mean = torch.as_tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.ra_magnitude = torch.tensor(ra_magnitudes(randaug_m), dtype=torch.float64, device=device)
        self.ra_signed = torch.tensor([name in RA_SIGNED for name in RA_OPS], device=device)

    def rand(self, *shape, dtype=torch.float32):
        return torch.rand(*shape, generator=self.generator, device=self.mean.device, dtype=dtype)

    def __call__(self, x_u8):
        if not (isinstance(x_u8, torch.Tensor) and x_u8.dtype == torch.uint8 and x_u8.ndim == 4 and x_u8.shape[1] == 3):
            # float images in [0, 1] would be read as levels 0..1 of 255; an HWC or 1-channel batch fails deep inside
            got = f'{x_u8.dtype} {tuple(x_u8.shape)}' if isinstance(x_u8, torch.Tensor) else type(x_u8).__name__
            raise ValueError(f'augment expects a uint8 batch (B, 3, H, W) of levels 0..255, got {got}')
        B, _, H, W = x_u8.shape
        if self.aug == 'strong' and H != W:  # (the square crop of RandomResizedCrop(ratio=(1, 1)) and its resize)
            raise ValueError(f"aug='strong' takes square images only, got {H}x{W} px")
        if self.aug == 'basic':
            dy, dx = torch.randint(0, 9, (2, B), generator=self.generator, device=x_u8.device)
            return normalize(pad_crop_flip(x_u8, dy, dx, self.rand(B) < 0.5), self.mean, self.std)
        # RandomResizedCrop with ratio (1, 1): torchvision's first attempt always fits
        area = (self.scale + (1 - self.scale) * self.rand(B, dtype=torch.float64)) * H * W
        top, left, flip = self.rand(B, dtype=torch.float64), self.rand(B, dtype=torch.float64), self.rand(B) < 0.5
        if self.scale == 1 and H == W:  # the whole image, resized to itself: the identity (the draws above are
            # made all the same, so that a seed gives the same flips and RandAugment draws at every scale)
            x = torch.where(flip.view(B, 1, 1, 1), x_u8.flip(3), x_u8).float()
        else:
            side = torch.sqrt(area).round().clamp_(1, min(H, W))
            top, left = (top * (H - side + 1)).floor(), (left * (W - side + 1)).floor()
            x = resized_crop_flip(x_u8.float(), top, left, side, flip)
        for _ in range(self.randaug_n):
            op = torch.randint(0, len(RA_OPS), (B,), generator=self.generator, device=x.device)
            magnitude = self.ra_magnitude[op]
            negative = self.ra_signed[op] & (self.rand(B) < 0.5)
            x = apply_ra_ops(x, op, torch.where(negative, -magnitude, magnitude))
        if self.jitter > 0:
            x = self.color_jitter(x)
        x = normalize(x, self.mean, self.std)
        return self.random_erasing(x) if self.reprob > 0 else x

    def color_jitter(self, x):
        """ColorJitter(j, j, j): factors U(max(0, 1-j), 1+j), applied in a random order per image."""
        B = x.shape[0]
        v = ((2 * self.rand(B, 3, dtype=torch.float64) - 1) * self.jitter).clamp(min=-1.0)
        order = self.rand(B, 3).argsort(1)  # image b's slot s runs op order[b, s]
        for slot in range(3):
            k = order[:, slot]  # 0 brightness, 1 contrast, 2 saturation: one blend
            x = blend_ops(x, 1.0 + v.gather(1, k[:, None])[:, 0], saturation=k == 2, contrast=k == 1)
        return x

    def random_erasing(self, x):  # value 0, as locuslab; the draws from this pipeline's generator
        return random_erasing(x, self.reprob, self.rand)


def make_augment(*, aug='strong', scale=1.0, randaug_n=2, randaug_m=12, jitter=0.0, reprob=0.0,
                 mean, std, device, seed=0):
    """augment(x_uint8 (B, 3, H, W) on device) -> normalised float32 (B, 3, H, W); its random draws
    come from augment.generator (a torch.Generator on device, seeded with seed). Defaults: the
    locuslab/convmixer-cifar10 README run; aug='basic' ignores the other settings."""
    if aug not in ('strong', 'basic'):
        raise ValueError(f"aug must be 'strong' or 'basic', got {aug!r}")
    check_settings(scale=scale, randaug_n=randaug_n, randaug_m=randaug_m, jitter=jitter, reprob=reprob, seed=seed)
    return Augment(aug=aug, scale=scale, randaug_n=randaug_n, randaug_m=randaug_m, jitter=jitter,
                   reprob=reprob, mean=mean, std=std, device=device, seed=seed)


def check_settings(*, scale, randaug_n, randaug_m, jitter, reprob, seed):
    """make_augment's settings, each of its type and range (as torchvision's transforms refuse them): a negative or
    NaN value would run silently, randaug_m 31 fail only at the first call."""
    integer = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)
    real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
    for name, value, ok, rule in (
            ('scale', scale, real(scale) and 0 < scale <= 1, 'a number in (0, 1]: the smallest crop area'),
            ('randaug_n', randaug_n, integer(randaug_n) and randaug_n >= 0, 'an integer >= 0'),
            ('randaug_m', randaug_m, integer(randaug_m) and 0 <= randaug_m <= 30, 'an integer 0..30'),
            ('jitter', jitter, real(jitter) and jitter >= 0, 'a finite number >= 0'),
            ('reprob', reprob, real(reprob) and 0 <= reprob <= 1, 'a probability in [0, 1]'),
            ('seed', seed, integer(seed), 'an integer')):
        if not ok:
            raise ValueError(f'{name} must be {rule}, got {value!r}')


# -----------------------------------------------------------------------------
# MoCo v3's two views (Chen, Xie & He 2021, Appendix A / moco-v3 main_moco.py): BYOL's asymmetric augmentation,
# batched on the device with each image's draws made for the global batch (train_contrastive.py).
MOCO_AUG = dict(ratio=(3 / 4, 4 / 3), jitter=(0.4, 0.4, 0.2, 0.1), p_jitter=0.8, p_gray=0.2,
                blur_sigma=(0.1, 2.0), p_blur=(1.0, 0.1), p_solarize=(0.0, 0.2), p_flip=0.5)


def moco_view(x_u8, gen, B, lo, hi, view, size, crop_min, mean, std):
    """View `view` (0 or 1: its blur and solarize probabilities) of the images x_u8 (b, 3, H, W) uint8 ->
    (b, 3, size, size) normalised. Every draw is made for the global batch of B; this rank keeps rows
    lo..hi-1, so the views of an image do not depend on the world size."""
    def rand(*shape, dtype=torch.float32):
        return torch.rand(B, *shape, generator=gen, device=gen.device, dtype=dtype)[lo:hi]

    b, _, H, W = x_u8.shape
    # RandomResizedCrop(size, (crop_min, 1), (3/4, 4/3)): the first of torchvision's 10 tries that fits, else whole
    area = H * W * (crop_min + (1 - crop_min) * rand(10, dtype=torch.float64))
    lo_r, hi_r = (math.log(r) for r in MOCO_AUG['ratio'])
    ratio = torch.exp(lo_r + (hi_r - lo_r) * rand(10, dtype=torch.float64))
    w, h = torch.sqrt(area * ratio).round(), torch.sqrt(area / ratio).round()
    fits = (w >= 1) & (w <= W) & (h >= 1) & (h <= H)
    first, any_fit = fits.int().argmax(1, keepdim=True), fits.any(1)
    w = torch.where(any_fit, w.gather(1, first)[:, 0], float(W))
    h = torch.where(any_fit, h.gather(1, first)[:, 0], float(H))
    top = (rand(dtype=torch.float64) * (H - h + 1)).floor()
    left = (rand(dtype=torch.float64) * (W - w + 1)).floor()
    flip = rand() < MOCO_AUG['p_flip']
    # RandomApply(ColorJitter(0.4, 0.4, 0.2, 0.1), p=0.8): factors U(1-j, 1+j), hue offset U(-j, j)
    u = 2 * rand(4, dtype=torch.float64) - 1
    factors = torch.stack([(1.0 if i < 3 else 0.0) + j * u[:, i] for i, j in enumerate(MOCO_AUG['jitter'])], 1)
    order = rand(4).argsort(1)
    jitter, gray = rand() < MOCO_AUG['p_jitter'], rand() < MOCO_AUG['p_gray']
    # GaussianBlur, p 1.0 / 0.1, sigma U(0.1, 2.0) px at 224 px, scaled with the view (docstring)
    s0, s1 = (s * size / 224 for s in MOCO_AUG['blur_sigma'])
    sigma = s0 + (s1 - s0) * rand()
    blur = rand() < MOCO_AUG['p_blur'][view]
    # Solarize at PIL's threshold 128, p 0 / 0.2; threshold 256: the identity
    threshold = torch.where(rand() < MOCO_AUG['p_solarize'][view], 128.0, 256.0)
    # the one host sync: which images take which op (9 x b booleans)
    drawn = torch.cat([torch.stack([jitter, gray, blur]), (order == 3).T & jitter]).cpu()
    rows = [m.nonzero()[:, 0].to(x_u8.device, non_blocking=True) for m in drawn]  # (a few hundred bytes to the device)
    x = resized_crop_rect_flip(x_u8.float(), top, left, h, w, size, flip)
    if len(j := rows[0]):
        x = x.index_copy(0, j, color_jitter(x[j], factors[j], order[j],
                                                    [torch.searchsorted(j, r) for r in rows[3:]]))
    if len(g := rows[1]):
        x = x.index_copy(0, g, grayscale(x[g]).expand(-1, 3, -1, -1))
    if len(k := rows[2]):
        x = x.index_copy(0, k, gaussian_blur(x[k], sigma[k], 2 * round(size / 20) + 1))
    return normalize(solarize(x, threshold), mean, std)
