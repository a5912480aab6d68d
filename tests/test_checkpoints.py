"""The checkpoint converters vit.load_npz, mixer.load_npz and convmixer.from_locuslab, against
independent oracles.

Nothing can be downloaded here, so the tests write files in the released layouts at test time:
- ViT .npz: written from a random timm model by an inverse mapping kept here; timm's own .npz loader
  (VisionTransformer.load_pretrained) must read the same file and give the same logits as ours.
- Mixer .npz (timm has no loader for it): random arrays under the Flax names and shapes of
  vit_jax/models_mixer.py; oracles are timm's MlpMixer given the same arrays by a conversion kept
  here, and a numpy forward pass that follows the Flax code line by line.
- Both .npz kinds: with gelu='tanh' our logits equal that numpy (JAX-semantics, float64) forward.
- ConvMixer: a locuslab-style flat nn.Sequential built here; our logits must equal its logits and timm's.
Reading files, prefixes ('module.') and strict-load messages are the training scripts' load_weights
and are tested there.
"""
import io
import math
import zipfile

import numpy as np
import pytest
import torch
from timm.layers import resample_abs_pos_embed
from timm.models.convmixer import ConvMixer as TimmConvMixer
from timm.models.mlp_mixer import MlpMixer as TimmMixer
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import convmixer
import mixer
import vit
from test_models import randomise as perturb

# Tiny models: 32 px, 8 px patches (16 tokens), width 64, depth 2.
IMG, PATCH, DIM, DEPTH, HEADS, CLASSES = 32, 8, 64, 2, 4, 10


def randomise(model, seed=0):
    """Perturb every float tensor (test_models' helper), in eval mode."""
    return perturb(model, seed, scale=0.1).eval()


def logits(model, x):
    with torch.no_grad():
        return model.eval()(x)


def close(a, b, atol=1e-5):
    assert b.abs().max() > 0.1  # never a comparison of two near-zero tensors
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.fixture
def x():
    return torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(1))


def our_vit(**kw):
    return vit.VisionTransformer(img_size=IMG, patch_size=PATCH, dim=DIM, depth=DEPTH, heads=HEADS,
                                 num_classes=CLASSES, **kw)


def timm_vit(**kw):
    return TimmViT(img_size=IMG, patch_size=PATCH, embed_dim=DIM, depth=DEPTH, num_heads=HEADS,
                   num_classes=CLASSES, **kw)


def our_mixer(**kw):
    return mixer.MlpMixer(img_size=IMG, patch_size=PATCH, dim=DIM, depth=DEPTH, num_classes=CLASSES, **kw)


def loaded(model, sd):
    model.load_state_dict(sd)  # strict: every key converted, none left over, every shape right
    return model


# -----------------------------------------------------------------------------
# Writers for the official JAX layouts (the inverse of what the loaders do, written independently).

def vit_npz_arrays(sd, prefix=''):
    """A timm ViT state_dict -> {name: array} as google-research/vision_transformer saves it:
    encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3}."""
    f = lambda t: t.detach().numpy().astype(np.float32)
    dim = sd['cls_token'].shape[-1]
    heads, dh = HEADS, dim // HEADS
    w = {'embedding/kernel': f(sd['patch_embed.proj.weight'].permute(2, 3, 1, 0)),  # OIHW -> HWIO
         'embedding/bias': f(sd['patch_embed.proj.bias']), 'cls': f(sd['cls_token']),
         'Transformer/posembed_input/pos_embedding': f(sd['pos_embed']),
         'Transformer/encoder_norm/scale': f(sd['norm.weight']),
         'Transformer/encoder_norm/bias': f(sd['norm.bias']),
         'head/kernel': f(sd['head.weight'].T), 'head/bias': f(sd['head.bias'])}
    for i in range(DEPTH):
        t, b = f'blocks.{i}.', f'Transformer/encoderblock_{i}/'
        att = b + 'MultiHeadDotProductAttention_1/'
        blk = {b + 'LayerNorm_0/scale': sd[t + 'norm1.weight'], b + 'LayerNorm_0/bias': sd[t + 'norm1.bias'],
               b + 'LayerNorm_2/scale': sd[t + 'norm2.weight'], b + 'LayerNorm_2/bias': sd[t + 'norm2.bias'],
               att + 'out/kernel': sd[t + 'attn.proj.weight'].T.reshape(heads, dh, dim),
               att + 'out/bias': sd[t + 'attn.proj.bias']}
        for name, wq, bq in zip(('query', 'key', 'value'), sd[t + 'attn.qkv.weight'].chunk(3),
                                sd[t + 'attn.qkv.bias'].chunk(3)):
            blk[att + f'{name}/kernel'] = wq.T.reshape(dim, heads, dh)  # (D, H, D_h)
            blk[att + f'{name}/bias'] = bq.reshape(heads, dh)
        for j in (0, 1):
            blk[b + f'MlpBlock_3/Dense_{j}/kernel'] = sd[t + f'mlp.fc{j + 1}.weight'].T
            blk[b + f'MlpBlock_3/Dense_{j}/bias'] = sd[t + f'mlp.fc{j + 1}.bias']
        w.update({k: f(v) for k, v in blk.items()})
    return {prefix + k: v for k, v in w.items()}


def mixer_npz_arrays(seed=0, prefix=''):
    """Random arrays under the names and shapes of vit_jax/models_mixer.py: nn.Conv 'stem' (HWIO
    kernel), MixerBlock_{i} with auto-named LayerNorm_0 / LayerNorm_1 (params 'scale', 'bias') and
    MlpBlock 'token_mixing' / 'channel_mixing' (Dense_0, Dense_1: kernels (in, out)), then
    'pre_head_layer_norm' and the Dense 'head'."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.normal(0, 0.2, shape).astype(np.float32)
    tokens, d_s, d_c = (IMG // PATCH) ** 2, DIM // 2, 4 * DIM
    w = {'stem/kernel': r(PATCH, PATCH, 3, DIM), 'stem/bias': r(DIM),
         'pre_head_layer_norm/scale': 1 + r(DIM), 'pre_head_layer_norm/bias': r(DIM),
         'head/kernel': r(DIM, CLASSES), 'head/bias': r(CLASSES)}
    for i in range(DEPTH):
        b = f'MixerBlock_{i}/'
        for ln in ('LayerNorm_0', 'LayerNorm_1'):
            w[b + ln + '/scale'], w[b + ln + '/bias'] = 1 + r(DIM), r(DIM)
        for name, n_in, hidden in (('token_mixing', tokens, d_s), ('channel_mixing', DIM, d_c)):
            w[b + name + '/Dense_0/kernel'], w[b + name + '/Dense_0/bias'] = r(n_in, hidden), r(hidden)
            w[b + name + '/Dense_1/kernel'], w[b + name + '/Dense_1/bias'] = r(hidden, n_in), r(n_in)
    return {prefix + k: v for k, v in w.items()}


# -----------------------------------------------------------------------------
# The Flax forward passes, in numpy float64, for JAX numerics (nn.gelu = tanh approximation).

def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, w, name):  # Flax nn.LayerNorm, epsilon 1e-6
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-6) * w[name + '/scale'] + w[name + '/bias']


def mlp_block(x, w, name):  # Dense_0, gelu, Dense_1
    h = gelu_tanh(x @ w[name + '/Dense_0/kernel'] + w[name + '/Dense_0/bias'])
    return h @ w[name + '/Dense_1/kernel'] + w[name + '/Dense_1/bias']


def conv_patches(x, kernel, bias):  # nn.Conv(kernel p, stride p, VALID) on NHWC x -> (B, h*w, D)
    b, hgt, wid, c = x.shape
    p = kernel.shape[0]
    x = x.reshape(b, hgt // p, p, wid // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, -1, p * p * c) @ kernel.reshape(p * p * c, -1) + bias


def jax_vit(w, x):
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h = conv_patches(x, w['embedding/kernel'], w['embedding/bias'])
    h = np.concatenate([np.broadcast_to(w['cls'], (h.shape[0], 1, h.shape[2])), h], axis=1)
    h = h + w['Transformer/posembed_input/pos_embedding']
    for i in range(DEPTH):
        b = f'Transformer/encoderblock_{i}/'
        a = b + 'MultiHeadDotProductAttention_1/'
        y = layer_norm(h, w, b + 'LayerNorm_0')
        q, k, v = (np.einsum('bnd,dhk->bnhk', y, w[a + n + '/kernel']) + w[a + n + '/bias']
                   for n in ('query', 'key', 'value'))
        att = np.einsum('bqhk,bshk->bhqs', q / math.sqrt(q.shape[-1]), k)
        att = np.exp(att - att.max(-1, keepdims=True))
        att = att / att.sum(-1, keepdims=True)
        out = np.einsum('bhqs,bshk->bqhk', att, v)
        h = h + np.einsum('bqhk,hkd->bqd', out, w[a + 'out/kernel']) + w[a + 'out/bias']
        h = h + mlp_block(layer_norm(h, w, b + 'LayerNorm_2'), w, b + 'MlpBlock_3')
    h = layer_norm(h, w, 'Transformer/encoder_norm')[:, 0]
    return h @ w['head/kernel'] + w['head/bias']


def jax_mixer(w, x):
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h = conv_patches(x, w['stem/kernel'], w['stem/bias'])  # (B, S, C)
    for i in range(DEPTH):
        b = f'MixerBlock_{i}/'
        y = layer_norm(h, w, b + 'LayerNorm_0').swapaxes(1, 2)  # (B, C, S)
        h = h + mlp_block(y, w, b + 'token_mixing').swapaxes(1, 2)
        h = h + mlp_block(layer_norm(h, w, b + 'LayerNorm_1'), w, b + 'channel_mixing')
    h = layer_norm(h, w, 'pre_head_layer_norm').mean(axis=1)
    return h @ w['head/kernel'] + w['head/bias']


def nhwc(x):
    return x.permute(0, 2, 3, 1).double().numpy()


# -----------------------------------------------------------------------------
# ViT .npz

@pytest.mark.parametrize('prefix,compressed', [('', False), ('opt/target/', True)])
def test_vit_npz_loads_like_timms_own_npz_loader(tmp_path, x, prefix, compressed):
    torch.manual_seed(0)
    source = randomise(timm_vit())
    arrays = vit_npz_arrays(source.state_dict(), prefix)
    if prefix:
        arrays['opt/state/step'] = np.array(7)  # optimizer state beside the weights: ignored
    path = tmp_path / 'ViT.npz'
    (np.savez_compressed if compressed else np.savez)(path, **arrays)

    theirs = timm_vit()
    theirs.load_pretrained(str(path))  # timm's independent reading of the same file
    sd = vit.load_npz(path)
    assert all(v.dtype == torch.float32 for v in sd.values())
    ours = loaded(our_vit(), sd)
    close(logits(ours, x), logits(theirs, x))
    close(logits(ours, x), logits(source, x))


def test_vit_npz_with_tanh_gelu_matches_jax_numerics(tmp_path, x):
    """The numpy Flax forward is the oracle; exact GELU is the documented ~1e-3 away from it."""
    torch.manual_seed(0)
    arrays = vit_npz_arrays(randomise(timm_vit()).state_dict())
    np.savez(tmp_path / 'ViT.npz', **arrays)
    ref = torch.from_numpy(jax_vit(arrays, nhwc(x))).float()
    tanh = loaded(our_vit(gelu='tanh'), vit.load_npz(tmp_path / 'ViT.npz'))
    exact = loaded(our_vit(), vit.load_npz(tmp_path / 'ViT.npz'))
    close(logits(tanh, x), ref)
    gap = (logits(exact, x) - ref).abs().max()
    assert 1e-5 < gap < 1e-2 * ref.abs().max()


def test_vit_npz_with_pre_logits_is_refused(tmp_path):
    """A pre-logits layer (Dense + tanh before the head) changes the logits: never drop it silently."""
    arrays = vit_npz_arrays(timm_vit().state_dict())
    arrays['pre_logits/kernel'], arrays['pre_logits/bias'] = np.ones((DIM, DIM), 'f4'), np.zeros(DIM, 'f4')
    np.savez(tmp_path / 'ViT.npz', **arrays)
    with pytest.raises(ValueError, match='pre_logits'):
        vit.load_npz(tmp_path / 'ViT.npz')


@pytest.mark.parametrize('grid', [(8, 8), (2, 2), (3, 5)])
def test_resample_pos_embed_equals_timm(grid):
    """Fine-tuning at another resolution (ViT Sec. 3.2): bicubic, antialiased, class token kept."""
    pos = torch.randn(1, 1 + 16, DIM, generator=torch.Generator().manual_seed(0))
    expected = resample_abs_pos_embed(pos, grid, num_prefix_tokens=1, interpolation='bicubic', antialias=True)
    torch.testing.assert_close(vit.resample_pos_embed(pos, grid), expected)
    torch.testing.assert_close(vit.resample_pos_embed(pos[:, 1:], grid, num_prefix_tokens=0), expected[:, 1:])
    with pytest.raises(ValueError, match='15 patch positions, not a square grid'):
        vit.resample_pos_embed(pos[:, :16], grid)


# -----------------------------------------------------------------------------
# Mixer .npz

def timm_mixer_from_arrays(w):
    """The test's own conversion of the Flax arrays into timm's MlpMixer."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    model = TimmMixer(img_size=IMG, patch_size=PATCH, num_blocks=DEPTH, embed_dim=DIM, num_classes=CLASSES)
    with torch.no_grad():
        model.stem.proj.weight.copy_(t(w['stem/kernel'].transpose(3, 2, 0, 1)))
        model.stem.proj.bias.copy_(t(w['stem/bias']))
        for i, block in enumerate(model.blocks):
            b = f'MixerBlock_{i}/'
            for norm, name in ((block.norm1, 'LayerNorm_0'), (block.norm2, 'LayerNorm_1')):
                norm.weight.copy_(t(w[b + name + '/scale'])), norm.bias.copy_(t(w[b + name + '/bias']))
            for mlp, name in ((block.mlp_tokens, 'token_mixing'), (block.mlp_channels, 'channel_mixing')):
                for fc, dense in ((mlp.fc1, 'Dense_0'), (mlp.fc2, 'Dense_1')):
                    fc.weight.copy_(t(w[f'{b}{name}/{dense}/kernel'].T)), fc.bias.copy_(t(w[f'{b}{name}/{dense}/bias']))
        model.norm.weight.copy_(t(w['pre_head_layer_norm/scale']))
        model.norm.bias.copy_(t(w['pre_head_layer_norm/bias']))
        model.head.weight.copy_(t(w['head/kernel'].T)), model.head.bias.copy_(t(w['head/bias']))
    return model.eval()


@pytest.mark.parametrize('prefix', ['', 'opt/target/'])
def test_mixer_npz_logits_equal_timm_and_jax(tmp_path, x, prefix):
    arrays = mixer_npz_arrays(prefix=prefix)
    np.savez(tmp_path / 'Mixer.npz', **arrays)
    exact = loaded(our_mixer(), mixer.load_npz(tmp_path / 'Mixer.npz'))
    close(logits(exact, x), logits(timm_mixer_from_arrays(mixer_npz_arrays()), x))
    tanh = loaded(our_mixer(gelu='tanh'), mixer.load_npz(tmp_path / 'Mixer.npz'))
    ref = torch.from_numpy(jax_mixer(mixer_npz_arrays(), nhwc(x))).float()
    close(logits(tanh, x), ref)
    gap = (logits(exact, x) - ref).abs().max()
    assert 1e-5 < gap < 1e-2 * ref.abs().max()


# -----------------------------------------------------------------------------
# Bad .npz content: one ValueError that names the array, never an IndexError or a bare numpy error

def npz_files(module):
    return vit_npz_arrays(timm_vit().state_dict()) if module is vit else mixer_npz_arrays()


@pytest.mark.parametrize('module,key', [(vit, 'Transformer/encoderblock_1/MlpBlock_3/Dense_0/bias'),
                                        (vit, 'cls'), (mixer, 'MixerBlock_1/token_mixing/Dense_1/kernel'),
                                        (mixer, 'pre_head_layer_norm/scale')])
def test_npz_missing_array_is_named(tmp_path, module, key):
    arrays = npz_files(module)
    del arrays[key]
    np.savez(tmp_path / 'w.npz', **arrays)
    with pytest.raises(ValueError, match=f"no array '{key}'"):
        module.load_npz(tmp_path / 'w.npz')


def npy_bytes(a):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a)
    return buf.getvalue()


@pytest.mark.parametrize('module', [vit, mixer])
@pytest.mark.parametrize('fault', ['truncated', 'bad_header', 'not_npy', 'wrong_ndim', 'not_float'])
def test_npz_malformed_array_is_named(tmp_path, module, fault):
    arrays = npz_files(module)
    key = 'embedding/bias' if module is vit else 'stem/bias'
    good = npy_bytes(arrays[key])
    member = {'truncated': good[:-8],  # the file ends early
              'bad_header': good[:10] + b"{'descr': <f4" + good[23:],  # not a Python literal
              'not_npy': b'just some bytes',  # no .npy magic: np.load hands back raw bytes
              'wrong_ndim': npy_bytes(arrays[key][None]),
              'not_float': npy_bytes(np.array(['a'] * DIM))}[fault]
    path = tmp_path / 'w.npz'
    with zipfile.ZipFile(path, 'w') as zf:
        for name, a in arrays.items():
            zf.writestr(name + '.npy', member if name == key else npy_bytes(a))
    with pytest.raises(ValueError, match=f"array '{key}'"):
        module.load_npz(path)


# -----------------------------------------------------------------------------
# ConvMixer: locuslab's flat nn.Sequential (built here after locuslab/convmixer's convmixer.py)

class LocuslabResidual(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


def locuslab_convmixer(dim, depth, kernel_size, patch_size, n_classes):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size), nn.GELU(), nn.BatchNorm2d(dim),
        *[nn.Sequential(
            LocuslabResidual(nn.Sequential(nn.Conv2d(dim, dim, kernel_size, groups=dim, padding='same'),
                                           nn.GELU(), nn.BatchNorm2d(dim))),
            nn.Conv2d(dim, dim, kernel_size=1), nn.GELU(), nn.BatchNorm2d(dim)) for _ in range(depth)],
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(dim, n_classes))


CM = dict(dim=32, depth=3, kernel_size=5, patch_size=4)


@pytest.mark.parametrize('kind', ['timm_train_ddp', 'bare_old'])
def test_convmixer_locuslab_file_round_trips_and_equals_timm(tmp_path, x, kind):
    torch.manual_seed(0)
    theirs = randomise(locuslab_convmixer(**CM, n_classes=CLASSES))
    sd = theirs.state_dict()
    if kind == 'timm_train_ddp':  # as timm's train.py saves it (locuslab trained with timm), from DDP
        ckpt = {'state_dict': {'module.' + k: v for k, v in sd.items()}, 'epoch': 149}
    else:  # bare, from a PyTorch before 0.4.1, without BN's num_batches_tracked
        ckpt = {k: v for k, v in sd.items() if not k.endswith('num_batches_tracked')}
    torch.save(ckpt, tmp_path / 'convmixer.pth.tar')
    raw = torch.load(tmp_path / 'convmixer.pth.tar', weights_only=True)  # what load_weights does first
    raw = raw.get('state_dict', raw)
    consume_prefix_in_state_dict_if_present(raw, 'module.')
    ours = loaded(convmixer.ConvMixer(**CM, num_classes=CLASSES), convmixer.from_locuslab(raw))
    close(logits(ours, x), logits(theirs, x))
    timm_model = TimmConvMixer(**CM, num_classes=CLASSES)
    timm_model.load_state_dict(ours.state_dict())
    close(logits(ours, x), logits(timm_model, x))
    # back into the flat layout: parameters and buffers sit in the same order, so it is a zip
    back = locuslab_convmixer(**CM, n_classes=CLASSES)
    back.load_state_dict(dict(zip(back.state_dict(), ours.state_dict().values())))
    for k, v in back.state_dict().items():
        if not k.endswith('num_batches_tracked'):
            torch.testing.assert_close(v, sd[k], rtol=0, atol=0)


def test_convmixer_our_keys_pass_through_unchanged():
    timm_sd = randomise(TimmConvMixer(**CM, num_classes=CLASSES)).state_dict()
    assert convmixer.from_locuslab(timm_sd) is timm_sd
    assert convmixer.from_locuslab({}) == {}


def test_convmixer_locuslab_of_another_depth_fails_strict_loading():
    """The depth is read from the file (head index - 5), so a wrong model is named by torch, not hidden."""
    sd = convmixer.from_locuslab(locuslab_convmixer(**CM, n_classes=CLASSES).state_dict())
    assert 'blocks.2.0.fn.0.weight' in sd and 'head.weight' in sd
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "blocks.2.'):
        convmixer.ConvMixer(**{**CM, 'depth': 2}, num_classes=CLASSES).load_state_dict(sd)


# -----------------------------------------------------------------------------
# Issue 42 (C23): a state_dict that does not fit is one short line naming the flags, not torch's list of tensors.
def our_last_pt(path, net, **args):
    """A last.pt in our scripts' layout (runs.RUN_KEYS; train_imagenet.py's adds steps_per_epoch) holding net."""
    torch.save(dict(model=net.state_dict(), optimizer={}, scaler={}, epoch=1, step=1, history=[], args=args,
                    **({'steps_per_epoch': 1} if 'recipe' in args else {})), path)
    return path


def test_a_checkpoint_that_does_not_fit_is_one_short_line_with_the_runs_flags(tmp_path):
    """A ConvMixer of depth 1, width 16 loaded into depth 2, width 32 (C23's case): torch's message was 4,972
    characters. Now: the counts of missing / extra / reshaped tensors (oracle: the key sets, computed here), the
    first of each, and the flags of the run that wrote the file."""
    import models
    from utils import UserError
    small = convmixer.ConvMixer(dim=16, depth=1, kernel_size=3, patch_size=2, num_classes=10)
    big = convmixer.ConvMixer(dim=32, depth=2, kernel_size=3, patch_size=2, num_classes=10)
    path = our_last_pt(tmp_path / 'last.pt', small, model='convmixer_256_8', model_kw=['dim=16', 'depth=1'],
                       dataset='cifar10', img_size=32, classes=None)
    theirs, own = small.state_dict(), big.state_dict()
    missing, reshaped = [k for k in own if k not in theirs], [k for k in own if k in theirs and
                                                               theirs[k].shape != own[k].shape]
    assert missing and reshaped and not set(theirs) - set(own)
    with pytest.raises(UserError) as e:
        models.load_weights(big, path)
    msg = str(e.value)
    assert '\n' not in msg and len(msg) < 400, (len(msg), msg)
    assert msg == (f'{path} does not fit this --model / --model-kw / --dataset: {len(missing)} tensor(s) missing '
                   f'({missing[0]}, ...); {len(reshaped)} of another shape ({reshaped[0]} '
                   f'{list(theirs[reshaped[0]].shape)}, here {list(own[reshaped[0]].shape)}); its run had --model '
                   'convmixer_256_8 --model-kw dim=16 depth=1 --dataset cifar10 --img-size 32')
    torch.save(theirs, tmp_path / 'bare.pt')  # not one of ours: the differences only
    with pytest.raises(UserError, match=r'\.pt does not fit this --model / --model-kw / --dataset: \d+ tensor\(s\) '
                                        r'missing \(blocks\.1\.[^)]*\); \d+ of another shape \([^)]*\)$'):
        models.load_weights(big, tmp_path / 'bare.pt')


@pytest.mark.parametrize('script', ['train_cifar', 'train_imagenet'])
def test_train_cifar_pretrained_of_our_last_pt_takes_its_model_and_model_kw(tmp_path, script):
    """C23: train_cifar.py --pretrained runs/x/last.pt builds the run's --model and --model-kw (as --checkpoint
    does, and train_imagenet.py's --pretrained), loads its weights exactly, and a --model-kw given still wins."""
    import train_cifar as tc
    kw = ['dim=16', 'depth=1', 'kernel_size=3', 'patch_size=2']
    torch.manual_seed(3)
    run = tc.build_model('convmixer_256_8', 10, 32, tc.parse_model_kw(kw), cifar=True)
    extra = dict(dataset='cifar10', img_size=32) if script == 'train_cifar' else dict(recipe='convmixer', img_size=32)
    path = our_last_pt(tmp_path / 'last.pt', run, model='convmixer_256_8', model_kw=kw, **extra)
    args = tc.get_args(['--pretrained', str(path), '--model-kw', 'kernel_size=3'])
    assert args.model == 'convmixer_256_8' and tc.parse_model_kw(args.model_kw) == tc.parse_model_kw(kw)
    model = tc.make_model(args)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), run.state_dict().values()))
    assert tc.parse_model_kw(tc.get_args(['--pretrained', str(path), '--model-kw', 'depth=2']).model_kw)['depth'] == 2
    assert tc.get_args(['--pretrained', str(path), '--model', 'vit_s4_cifar']).model_kw == []  # another model: its own
