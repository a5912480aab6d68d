"""Every model of the repo by name, and every checkpoint format into it, for every script.

build_model: a config of vit.py, mixer.py or convmixer.py, the CIFAR ResNets (resnet18 with the CIFAR stem,
resnet20) or torchvision's ImageNet ResNets (resnet50/101/152, the SAM paper's baselines).
load_weights: our last.pt, timm / torchvision / locuslab state_dicts, the official JAX .npz of ViT and Mixer.
load_model: what a checkpoint holds, built from the flags our last.pt stored (or given), then loaded.
"""
import ast

import torch
import torch.nn as nn
import torchvision
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torchvision.models.resnet import BasicBlock

import convmixer
import mixer
import vit
from data import NUM_CLASSES
from runs import read_checkpoint, stored_args, written_by
from utils import UserError, first_set, one_line
MODEL_FILES = (convmixer, vit, mixer)
IMAGENET_RESNETS = ('resnet50', 'resnet101', 'resnet152')
CIFAR_RESNETS = ('resnet18', 'resnet20')
NAMES = [n for m in MODEL_FILES for n in m.configs] + list(CIFAR_RESNETS + IMAGENET_RESNETS)
CONVOLUTIONAL = (*convmixer.configs, *CIFAR_RESNETS, *IMAGENET_RESNETS)


def channels_last(flag, name, device):
    """--channels-last / --no-channels-last as given, else (None) on for the convolutional models on CUDA: in bf16
    NCHW PyTorch sends depthwise convolutions (ConvMixer's) to its slow native kernel, cuDNN's only in NHWC or fp16.
    ViT and Mixer keep NCHW (one patch convolution, then matmuls)."""
    return flag if flag is not None else name in CONVOLUTIONAL and torch.device(device).type == 'cuda'


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


def cifar_resnet(name, num_classes, stem_stride=1):
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


def build_model(name, num_classes, img_size, model_kw=None, *, cifar=False):
    """The model `name` for num_classes classes and img_size px; model_kw overrides the constructor last.
    cifar: train_cifar.py's adaptation of ImageNet configs at 32 px (ViT/Mixer patch p -> p/4, ConvMixer p -> p/7).
    A bad setting is a UserError naming it (the constructors raise TypeError/ValueError)."""
    model_kw = dict(model_kw or {})
    if given := [f'{k}={v}' for k, v in model_kw.items() if k in ('num_classes', 'img_size')]:
        raise UserError(f'--model-kw {" ".join(given)}: the class count comes from --data or --dataset, the size '
                        'from --img-size')
    if name not in NAMES:
        raise UserError(f'unknown model {name!r}; valid names: {", ".join(NAMES)}')
    if name in CIFAR_RESNETS:
        if model_kw and not (name == 'resnet20' and model_kw.keys() == {'stem_stride'}
                             and model_kw['stem_stride'] in (1, 2)):
            raise UserError(f'--model-kw {", ".join(model_kw)}: resnet18 takes none; resnet20 only stem_stride=1 or 2')
        return cifar_resnet(name, num_classes, **model_kw)
    over = {'num_classes': num_classes}
    module = next((m for m in MODEL_FILES if name in m.configs), None)
    if module is not None:
        cfg = module.configs[name]
        if module is not convmixer:  # (a ConvMixer takes any size)
            over['img_size'] = img_size
        if cifar and img_size == 32 and (cfg['patch_size'] >= 7 if module is convmixer else cfg.get('img_size') != 32):
            over['patch_size'] = cfg['patch_size'] // 7 if module is convmixer else max(1, cfg['patch_size'] // 4)
        patch = {**cfg, **over, **model_kw}['patch_size']
        if module is convmixer and isinstance(patch, int) and patch > 0 and img_size % patch:
            raise UserError(f'--model-kw patch_size={patch} does not divide {img_size} px: the border would be dropped')
    try:
        if module is None:  # torchvision's ImageNet ResNets
            return getattr(torchvision.models, name)(**over, **model_kw)
        return module.create(name, **{**over, **model_kw})
    except (TypeError, ValueError) as e:  # an unknown key (TypeError names it), or a shape the model refuses
        kw = ' '.join(f'{k}={v}' for k, v in model_kw.items())
        raise UserError(f'--model {name} --img-size {img_size} --model-kw {kw}: {e}') from None


def load_weights(model, path, finetune=False, new_head=False):
    """Load strictly our last.pt ('model'), a timm or locuslab file ('state_dict' or bare; 'module.', '_orig_mod.'
    stripped; locuslab keys converted) or an official JAX .npz (ViT, Mixer). finetune=True also takes weights
    trained on other classes (new_head, or another count) or at another resolution: the head is replaced, a
    ViT's pos_embed resampled."""
    run = None
    if str(path).endswith('.npz'):  # official JAX weights: a ViT or an MLP-Mixer
        try:
            sd = (vit if isinstance(model, vit.VisionTransformer) else mixer).load_npz(path)
        except Exception as e:  # a missing file, numpy's, zip's or the converter's errors: "unreadable"
            raise UserError(f'cannot read {path}: {type(e).__name__}: {one_line(e)}')
    else:
        ckpt = read_checkpoint(path, 'weights')
        run = ckpt['args'] if written_by(ckpt) else None  # one of our last.pt files: its flags name its model
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
    load_state(model, sd, f'{path} does not fit this --model / --model-kw / --dataset', run)


def load_state(model, sd, what, run=None, flags=('model', 'model_kw', 'dataset', 'classes', 'img_size')):
    """model.load_state_dict(sd), strictly; a state_dict that does not fit is one short line, `what` then what
    differs, the first tensor of each kind (torch's message lists every tensor: thousands of characters for a model
    of another depth), then, for one of our runs (run: the args its last.pt stored), its `flags` that build it."""
    own = model.state_dict()
    missing, extra = [k for k in own if k not in sd], [k for k in sd if k not in own]
    shape = [k for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or extra or shape:
        said = ([f'{len(missing)} tensor(s) missing ({missing[0]}, ...)'] if missing else []) + (
            [f'{len(extra)} this model lacks ({extra[0]}, ...)'] if extra else []) + (
            [f'{len(shape)} of another shape ({shape[0]} {list(sd[shape[0]].shape)}, here '
             f'{list(own[shape[0]].shape)})'] if shape else [])
        built = ' '.join(f'--{k.replace("_", "-")} {" ".join(map(str, v)) if isinstance(v, list) else v}'
                         for k, v in ((k, (run or {}).get(k)) for k in flags) if v not in (None, []))
        raise UserError(f'{what}: {"; ".join(said)}' + (f'; its run had {built}' if built else ''))
    model.load_state_dict(sd)


def zero_head(model):
    """True when the classifier (the last nn.Linear: head, fc) is all zeros, as in a train_contrastive.py backbone's
    last.pt or a fresh ViT / Mixer: every image gets the same logits, so an accuracy is one class's share."""
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1:]
    return bool(head) and not any(p.any() for p in head[0].parameters())  # (one host sync, once per model)


def load_model(checkpoint, name=None, model_kw=None, dataset=None, num_classes=None, img_size=None):
    """The model in `checkpoint` (None: the fresh init), for robustness.py and geometry.py. Our last.pt stores its
    model, --model-kw, --dataset, --img-size and --classes; the arguments given win, and other files need name.
    -> (model in eval mode on the CPU, info: name, model_kw (strings), dataset, img_size, num_classes, stored args)"""
    stored = (stored_args(checkpoint, '--checkpoint') if checkpoint else None) or {}
    name = name or stored.get('model')
    if not name:
        raise UserError(f'give --model: {checkpoint} does not say which model it holds' if checkpoint else
                        'give --model (or an --checkpoint of ours, which names its model)')
    kw = model_kw if model_kw is not None else stored.get('model_kw') or []
    dataset = run_dataset(stored, dataset)
    if dataset == 'imagenet':
        img_size, num_classes = first_set(img_size, stored.get('img_size'), 224), first_set(num_classes, 1000)
    else:  # a train_cifar run with --classes has that many outputs; --img-size upsampled its 32 px inputs
        img_size = first_set(img_size, stored.get('img_size'), 32)
        num_classes = first_set(num_classes, len(stored['classes']) if stored.get('classes') else NUM_CLASSES[dataset])
    model = build_model(name, num_classes, img_size, parse_model_kw(kw), cifar=dataset != 'imagenet')
    if checkpoint:
        load_weights(model, checkpoint)
    return model.eval(), dict(name=name, model_kw=list(kw), dataset=dataset, img_size=img_size,
                              num_classes=num_classes, stored=stored)


def run_dataset(stored, dataset=None):
    """The data set of a model: `dataset` given, else what our last.pt stored (train_imagenet's runs store a recipe
    and no dataset; train_cifar's and train_contrastive's their dataset), else cifar10."""
    return dataset or stored.get('dataset') or ('imagenet' if 'recipe' in stored else 'cifar10')


def imagenet_only(dataset, what, stored, **flags):
    """Refuse an ImageNet model's preprocessing flags (those given, not None) for a CIFAR model `what`: it sees its data
    set's images at its run's size (train_cifar.py --img-size, stored) with their mean/std. One rule, two scripts."""
    if dataset != 'imagenet' and (given := [k for k, v in flags.items() if v is not None]):
        raise UserError(f'--{given[0].replace("_", "-")} only applies to ImageNet models; {what} is a {dataset} model, '
                        f"which sees its run's {stored.get('img_size') or 32} px with its data set's mean/std")


def one_value_batchnorm(model, shape):
    """(name, input shape) of the first BatchNorm layer that a training forward pass of a batch of `shape` would give
    one value per channel (torch refuses to train BatchNorm on one: its variance is undefined), else None. Run on a
    model built on the meta device: shapes only, no memory, no arithmetic."""
    found = []

    class Found(Exception):
        pass

    def check(name):
        def pre_hook(module, inputs):
            x = inputs[0]
            if x.numel() // x.shape[1] <= 1:  # batch x spatial positions: the values per channel
                found.append((name, tuple(x.shape)))
                raise Found
        return pre_hook

    bns = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    hooks = [m.register_forward_pre_hook(check(n)) for n, m in model.named_modules() if isinstance(m, bns)]
    was = model.training
    try:
        with torch.no_grad():
            model.train()(torch.empty(shape, device='meta'))
    except Found:
        pass
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return found[0] if found else None


def build_on_meta(args, cifar=False, group=0, world=1):
    """args.model built on the meta device (no memory, no arithmetic): an impossible shape is a UserError now, before
    anything slow. group: also refuse now, not with torch's ValueError in the first step, a batch split whose training
    forward passes of `group` images (a micro-batch, an m-sharpness group) give a BatchNorm layer one value per
    channel. The flags named are the scripts' shared ones (--batch-size, --sam-m; --max-micro-batch where it exists)."""
    with torch.device('meta'):
        model = build_model(args.model, 10, args.img_size, parse_model_kw(args.model_kw), cifar=cifar)
    if group and (bad := one_value_batchnorm(model, (group, 3, args.img_size, args.img_size))):
        flags = [f'--batch-size {args.batch_size} on {world} process(es)'] + [
            f'--{k.replace("_", "-")} {getattr(args, k)}' for k in ('max_micro_batch', 'sam_m')
            if getattr(args, k, None) and (k != 'sam_m' or args.sam)]
        raise UserError(f'{", ".join(flags)}: forward passes of {group} image(s) give BatchNorm layer {bad[0]} of '
                        f'{args.model} at {args.img_size} px an input of {bad[1]}, one value per channel, which it '
                        'cannot train on; use 2 or more images per pass, or a smaller patch_size or larger --img-size')
