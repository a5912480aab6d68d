"""ConvMixer, from "Patches Are All You Need?" (Trockman & Kolter, TMLR 2023).

ConvMixer-h/d is a patch embedding followed by d identical blocks that keep the resolution
fixed (paper Fig. 2):

    z_0     = BN(act(Conv_{c->h, kernel p, stride p}(X)))          # patch embedding, eq. (1)
    z_l'    = BN(act(DepthwiseConv_k(z_{l-1}))) + z_{l-1}           # spatial mixing, eq. (2)
    z_l     = BN(act(PointwiseConv(z_l')))                          # channel mixing, eq. (3)
    logits  = Linear(GlobalAvgPool(z_d))

Order is conv -> activation -> BatchNorm everywhere, and only the depthwise conv has a residual.
Being fully convolutional, the model takes any input size (paper Sec. 2).

State-dict keys equal timm's `ConvMixer` (stem.{0,2}, blocks.i.0.fn.{0,2}, blocks.i.{1,3}, head),
so a timm state_dict (or our checkpoint's 'model') loads with plain `model.load_state_dict(sd)`;
`from_locuslab(sd)` converts locuslab's released files. `python convmixer.py` prints every
config's parameter count.
"""
import numbers

import torch
import torch.nn as nn

# -----------------------------------------------------------------------------
# Named configs. ImageNet ones are the paper's Table 1; CIFAR ones default to 10 classes.
configs = {
    # ImageNet-1k (paper Table 1 / locuslab/convmixer README): top-1 81.37, 80.16, 76.94
    'convmixer_1536_20': dict(dim=1536, depth=20, kernel_size=9, patch_size=7),
    'convmixer_768_32': dict(dim=768, depth=32, kernel_size=7, patch_size=7, activation='relu'),
    'convmixer_1024_20': dict(dim=1024, depth=20, kernel_size=9, patch_size=14),
    # CIFAR-10: the locuslab/convmixer-cifar10 script's default model (594,186 params) ...
    'convmixer_256_8': dict(dim=256, depth=8, kernel_size=5, patch_size=2, num_classes=10),
    # ... and the paper's ~0.7M-parameter CIFAR-10 model (Sec. 3, 706,570 params)
    'convmixer_256_8_k9_p1': dict(dim=256, depth=8, kernel_size=9, patch_size=1, num_classes=10),
}


class Residual(nn.Module):
    """fn(x) + x. Its own module so that state-dict keys read blocks.i.0.fn.* as in timm."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


class ConvMixer(nn.Module):
    def __init__(self, *, dim, depth, kernel_size=9, patch_size=7, in_chans=3, num_classes=1000,
                 activation='gelu', dropout=0.0):
        """dim = h (channels), depth = d (blocks), kernel_size = k (depthwise), patch_size = p.

        activation: 'gelu' (paper default) or 'relu' (ConvMixer-768/32). dropout is applied to
        the pooled features before the head (timm's head_drop); the paper uses none.
        Impossible shapes raise ValueError. Being fully convolutional, the model takes any input of
        at least one patch; whether p divides the image size is the training script's check.
        """
        super().__init__()
        for name, value in dict(dim=dim, depth=depth, kernel_size=kernel_size, patch_size=patch_size,
                                in_chans=in_chans).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f'{name} must be a positive integer, got {value!r}')
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            # 0 is the documented headless model; a negative count used to build one silently
            raise ValueError(f'num_classes must be an integer >= 0 (0: no head), got {num_classes!r}')
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
            raise ValueError(f'dropout must be a number (a probability in [0, 1)), got {type(dropout).__name__} '
                             f'{dropout!r}')
        if not 0 <= dropout < 1:  # p = 1 drops every pooled feature: the head sees zeros (as vit.py, mixer.py)
            raise ValueError(f'dropout must be a probability in [0, 1), got {dropout!r}')
        if activation not in ('gelu', 'relu'):
            raise ValueError(f"activation must be one of ('gelu', 'relu'), got {activation!r}")
        act = {'gelu': nn.GELU, 'relu': nn.ReLU}[activation]
        self.num_classes, self.patch_size = num_classes, patch_size
        # patch embedding, eq. (1): a p x p conv with stride p is a per-patch linear map
        self.stem = nn.Sequential(
            nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size),
            act(),
            nn.BatchNorm2d(dim),
        )
        self.blocks = nn.Sequential(*[
            nn.Sequential(
                # spatial (token) mixing, eq. (2): depthwise conv, residual around it only
                Residual(nn.Sequential(
                    nn.Conv2d(dim, dim, kernel_size, groups=dim, padding='same'),
                    act(),
                    nn.BatchNorm2d(dim),
                )),
                # channel mixing, eq. (3): pointwise conv, no residual
                nn.Conv2d(dim, dim, kernel_size=1),
                act(),
                nn.BatchNorm2d(dim),
            ) for _ in range(depth)
        ])
        self.head_drop = nn.Dropout(float(dropout))
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        # Initialisation: PyTorch defaults, as in the official code (locuslab/convmixer), which
        # sets no init of its own.

    def forward_features(self, x):  # (B, 3, H, W) -> (B, h, H/p, W/p)
        if x.ndim != 4 or x.shape[1] != self.stem[0].in_channels:  # (a shape: no host sync) Conv2d would take
            # an unbatched (3, H, W) image as a batch of 3
            raise ValueError(f'expected a batch of images (B, {self.stem[0].in_channels}, H, W), got shape '
                             f'{tuple(x.shape)}')
        if min(x.shape[-2:]) < self.patch_size:  # (a shape: no host sync) the stem conv would fail cryptically
            raise ValueError(f'input of {x.shape[-2]}x{x.shape[-1]} px is smaller than one {self.patch_size} px '
                             'patch: a ConvMixer needs at least one whole patch')
        return self.blocks(self.stem(x))

    def forward(self, x):
        x = self.forward_features(x)
        x = x.mean(dim=(2, 3))  # global average pool: (B, h, H/p, W/p) -> (B, h)
        return self.head(self.head_drop(x))


# -----------------------------------------------------------------------------
def from_locuslab(state_dict):
    """locuslab's released .pth.tar (github.com/tmp-iclr/convmixer v1.0, linked from the
    locuslab/convmixer README; after torch.load and taking 'state_dict', without 'module.') ->
    our (timm's) keys. Their model is one flat nn.Sequential: 0 = stem conv, 2 = stem BN,
    3+i = block i (same inner names as ours), depth+5 = head; 1, depth+3, depth+4 (activation,
    pool, flatten) hold no parameters. A state_dict already in our keys comes back unchanged.

    Preprocessing for the released models: ImageNet mean/std on RGB in [0, 1]; timm evaluates them
    at 224 px after a bicubic resize to 224 / 0.96 = 233 px (crop_pct 0.96).
    """
    if not state_dict or not all(k.split('.')[0].isdigit() for k in state_dict):
        return state_dict  # not locuslab's layout: ours/timm's, or something load_state_dict will name
    last = max(int(k.split('.')[0]) for k in state_dict)  # the head
    depth = last - 5
    out = {}
    for k, v in state_dict.items():
        i, rest = k.split('.', 1)
        i = int(i)
        if i in (0, 2):
            name = f'stem.{i}.{rest}'
        elif 3 <= i < 3 + depth:
            name = f'blocks.{i - 3}.{rest}'
        else:  # the head, or an index with no parameters in locuslab's model (left for strict loading to name)
            name = f'head.{rest}' if i == last else k
        out[name] = v
    # Files from before PyTorch 0.4.1 lack BN's num_batches_tracked: BatchNorm's own
    # _load_from_state_dict fills it (for a dict without version metadata, such as this one).
    return out


def create(name, **overrides):
    """Build a named config, e.g. create('convmixer_256_8', num_classes=100)."""
    if name not in configs:
        raise ValueError(f"unknown ConvMixer config {name!r}; valid names: {', '.join(configs)}")
    return ConvMixer(**{**configs[name], **overrides})


if __name__ == '__main__':
    for name in configs:
        with torch.device('meta'):  # counts without allocating or initialising
            model = create(name)
        print(f"{name:24s} {sum(p.numel() for p in model.parameters()):>13,d} params"
              f"  ({model.num_classes} classes)")
