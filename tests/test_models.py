"""The three architectures against timm (the numerical oracle) and the papers' parameter counts."""
import math
import subprocess
import sys

import pytest
import timm
import torch
from timm.models.convmixer import ConvMixer as TimmConvMixer
from timm.models.mlp_mixer import MlpMixer as TimmMixer
from timm.models.vision_transformer import VisionTransformer as TimmViT

import convmixer
import mixer
import vit
from conftest import REPO

MODULES = {'vit': vit, 'mixer': mixer, 'convmixer': convmixer}

# timm's counts for 1000 classes at 224 px (and 10 classes for the CIFAR ConvMixers).
# vit_s8 is 22,055,272 with a 1000-class head; timm's *default* vit_small_patch8_224 is the
# headless DINO model (21,670,272 = 22,055,272 - 384*1000 - 1000), which is not what we build.
PARAM_COUNTS = {
    'vit_ti16': 5_717_416, 'vit_s32': 22_878_952, 'vit_s16': 22_050_664, 'vit_s8': 22_055_272,
    'vit_b32': 88_224_232, 'vit_b16': 86_567_656, 'vit_b8': 86_576_872, 'vit_l16': 304_326_632,
    'mixer_s32': 19_104_624, 'mixer_s16': 18_528_264, 'mixer_b32': 60_293_428,
    'mixer_b16': 59_880_472, 'mixer_l32': 206_939_264, 'mixer_l16': 208_196_168,
    'convmixer_1536_20': 51_625_960, 'convmixer_768_32': 21_110_248,
    'convmixer_1024_20': 24_383_464, 'convmixer_256_8': 594_186, 'convmixer_256_8_k9_p1': 706_570,
}
TIMM_NAMES = {
    'vit_ti16': 'vit_tiny_patch16_224', 'vit_s32': 'vit_small_patch32_224',
    'vit_s16': 'vit_small_patch16_224', 'vit_b16': 'vit_base_patch16_224',
    'vit_l32': 'vit_large_patch32_224', 'mixer_s16': 'mixer_s16_224', 'mixer_b16': 'mixer_b16_224',
    'mixer_l32': 'mixer_l32_224', 'convmixer_1536_20': 'convmixer_1536_20',
    'convmixer_768_32': 'convmixer_768_32', 'convmixer_1024_20': 'convmixer_1024_20_ks9_p14',
}
ALL_CONFIGS = [(fam, name) for fam, mod in MODULES.items() for name in mod.configs]


def count(model):
    return sum(p.numel() for p in model.parameters())


def meta_model(module, name, **kw):
    with torch.device('meta'):
        return module.create(name, **kw)


def module_of(name):
    return MODULES[name.split('_')[0]]


@pytest.mark.parametrize('name', sorted(PARAM_COUNTS))
def test_parameter_count_matches_paper_table(name):
    assert count(meta_model(module_of(name), name)) == PARAM_COUNTS[name]


@pytest.mark.parametrize('name', sorted(TIMM_NAMES))
def test_parameter_count_and_keys_match_timm(name):
    ours = meta_model(module_of(name), name)
    with torch.device('meta'):
        theirs = timm.create_model(TIMM_NAMES[name], pretrained=False, num_classes=1000)
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert list(ours_sd) == list(theirs_sd)
    assert all(ours_sd[k].shape == theirs_sd[k].shape for k in ours_sd)


@pytest.mark.parametrize('family,name', ALL_CONFIGS)
def test_every_config_runs_forward_and_backward(family, name):
    """Full width and depth of each config, but a tiny input so it fits a CPU test."""
    torch.manual_seed(0)
    cfg = MODULES[family].configs[name]
    patch = cfg.get('patch_size', 16)
    size = 2 * patch  # 4 tokens
    kw = {} if family == 'convmixer' else {'img_size': size}
    model = MODULES[family].create(name, **kw)
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a zero head (ViT, Mixer) zeroes every gradient
    x = torch.randn(2, 3, size, size)
    out = model(x)
    assert out.shape == (2, model.num_classes)
    out.square().mean().backward()
    n_nograd = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not n_nograd, n_nograd
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_unknown_name_lists_valid_names():
    for mod in MODULES.values():
        with pytest.raises(ValueError) as err:
            mod.create('resnet9000')
        assert all(name in str(err.value) for name in mod.configs)


@pytest.mark.parametrize('family', list(MODULES))
def test_python_file_prints_every_count(family):
    out = subprocess.run([sys.executable, f'{family}.py'], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=120).stdout
    for name in MODULES[family].configs:
        line = next(line for line in out.splitlines() if line.split()[0] == name)
        expected = count(meta_model(MODULES[family], name))
        assert f'{expected:,d}' in line


# -----------------------------------------------------------------------------
# Numerical equivalence with timm: copy timm's (randomised) weights into ours, compare logits.

def randomise(model, seed=0, scale=0.05):
    """Perturb every weight and buffer so that zero/one inits cannot hide a mismatch."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            noise = scale * torch.randn(v.shape, generator=g)
            v = (v + noise).abs() + 0.5 if 'running_var' in k else v + noise
        sd[k] = v
    model.load_state_dict(sd)
    return model


EQUIVALENCE = [
    # (ours, overrides, timm constructor, timm kwargs, input size)
    ('vit', 'vit_s16', {}, TimmViT, dict(patch_size=16, embed_dim=384, depth=12, num_heads=6), 224),
    ('vit', 'vit_ti16', dict(pool='avg'), TimmViT,
     dict(embed_dim=192, depth=12, num_heads=3, global_pool='avg', class_token=False), 224),
    ('vit', 'vit_s16', dict(img_size=32, patch_size=4, num_classes=10), TimmViT,
     dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6, num_classes=10), 32),
    ('vit', 'vit_s4_cifar', {}, TimmViT,
     dict(img_size=32, patch_size=4, embed_dim=384, depth=6, num_heads=6, num_classes=10), 32),
    ('mixer', 'mixer_s16', {}, TimmMixer, dict(patch_size=16, num_blocks=8, embed_dim=512), 224),
    ('mixer', 'mixer_b16', dict(img_size=32, patch_size=4, num_classes=10), TimmMixer,
     dict(img_size=32, patch_size=4, num_blocks=12, embed_dim=768, num_classes=10), 32),
    ('convmixer', 'convmixer_768_32', {}, TimmConvMixer,
     dict(dim=768, depth=32, kernel_size=7, patch_size=7, act_layer=torch.nn.ReLU), 64),
    ('convmixer', 'convmixer_1024_20', {}, TimmConvMixer,
     dict(dim=1024, depth=20, kernel_size=9, patch_size=14), 112),
    ('convmixer', 'convmixer_256_8', {}, TimmConvMixer,
     dict(dim=256, depth=8, kernel_size=5, patch_size=2, num_classes=10), 32),
]


@pytest.mark.parametrize('family,name,overrides,timm_cls,timm_kw,size', EQUIVALENCE,
                         ids=[f'{e[1]}-{e[5]}px-{len(e[2])}' for e in EQUIVALENCE])
def test_logits_equal_timm(family, name, overrides, timm_cls, timm_kw, size):
    torch.manual_seed(0)
    theirs = randomise(timm_cls(**timm_kw)).eval()
    ours = MODULES[family].create(name, **overrides).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        ref, out = theirs(x), ours(x)
    assert ref.abs().max() > 0.1  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


GRADIENT_CASES = [  # small configs in train mode: BatchNorm uses batch statistics
    ('vit', dict(img_size=32, patch_size=8, dim=64, depth=2, heads=4, num_classes=10), TimmViT,
     dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)),
    ('mixer', dict(img_size=32, patch_size=8, dim=64, depth=2, num_classes=10), TimmMixer,
     dict(img_size=32, patch_size=8, embed_dim=64, num_blocks=2, num_classes=10)),
    ('convmixer', dict(dim=32, depth=2, kernel_size=5, patch_size=2, num_classes=10), TimmConvMixer,
     dict(dim=32, depth=2, kernel_size=5, patch_size=2, num_classes=10)),
]


@pytest.mark.parametrize('family,ours_kw,timm_cls,timm_kw', GRADIENT_CASES, ids=[c[0] for c in GRADIENT_CASES])
def test_gradients_equal_timm(family, ours_kw, timm_cls, timm_kw):
    """The speed changes (ViT's class-token-only last block, Mixer's baddbmm, ConvMixer's in-place
    residual) keep the backward pass: every gradient and BN running stat equals timm's."""
    torch.manual_seed(0)
    theirs = randomise(timm_cls(**timm_kw)).train()
    cls = {'vit': vit.VisionTransformer, 'mixer': mixer.MlpMixer, 'convmixer': convmixer.ConvMixer}[family]
    ours = cls(**ours_kw).train()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(4, 3, 32, 32)
    for model in (theirs, ours):
        model(x).square().mean().backward()
    ref = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert ref[name].grad.abs().max() > 0 or name.endswith('bias'), name
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    for (name, b), b_ref in zip(ours.named_buffers(), theirs.buffers()):
        torch.testing.assert_close(b, b_ref, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize('size', [160, 288])
def test_vit_other_input_size_matches_timm_dynamic_size(size):
    """Built for 224 px, run at another size: the position grid is resampled as timm does."""
    torch.manual_seed(0)
    theirs = randomise(TimmViT(embed_dim=192, depth=2, num_heads=3, dynamic_img_size=True)).eval()
    ours = vit.VisionTransformer(dim=192, depth=2, heads=3).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)


def test_convmixer_takes_any_input_size():
    model = convmixer.create('convmixer_256_8', dim=16, depth=2).eval()
    with torch.no_grad():
        for h, w in [(32, 32), (20, 36), (64, 48)]:
            assert model(torch.randn(1, 3, h, w)).shape == (1, 10)


def test_mixer_wrong_input_size_is_a_clear_error():
    model = mixer.create('mixer_s4_cifar', depth=1)
    with pytest.raises(ValueError, match='32 px'):
        model(torch.randn(1, 3, 64, 64))


# -----------------------------------------------------------------------------
# Faithful details.

def test_mixer_mlp_widths_are_half_and_four_times_c():
    """D_S = C/2 (token-mixing), D_C = 4C (channel-mixing): lucidrains swaps these."""
    model = meta_model(mixer, 'mixer_b16')
    block = model.blocks[0]
    assert block.mlp_tokens.fc1.weight.shape == (384, 196)  # (D_S, S)
    assert block.mlp_channels.fc1.weight.shape == (3072, 768)  # (D_C, C)
    default = meta_model(mixer, 'mixer_b16', tokens_mlp_dim=None, channels_mlp_dim=None)
    assert default.blocks[0].mlp_tokens.fc1.weight.shape == (384, 196)


def test_mixer_token_mixing_matches_transposed_linear():
    """Our transpose-free token MLP equals the paper's W2 GELU(W1 X^T) written literally."""
    torch.manual_seed(0)
    mlp = mixer.MlpBlock(16, 8, 'tokens', 0.0, 'exact')
    x = torch.randn(3, 16, 5)  # (B, S, C)
    ref = mlp.fc2(torch.nn.functional.gelu(mlp.fc1(x.transpose(1, 2)))).transpose(1, 2)
    torch.testing.assert_close(mlp(x), ref)


def test_convmixer_layout_is_conv_act_bn_with_depthwise_residual_only():
    model = convmixer.create('convmixer_768_32', dim=8, depth=1)
    block = model.blocks[0]
    types = [type(m).__name__ for m in block[0].fn] + [type(m).__name__ for m in block[1:]]
    assert types == ['Conv2d', 'ReLU', 'BatchNorm2d', 'Conv2d', 'ReLU', 'BatchNorm2d']
    assert block[0].fn[0].groups == 8 and block[1].kernel_size == (1, 1)
    # Residual around the depthwise part only: with BN at identity and the pointwise conv zeroed,
    # the block outputs BN(act(0)) = 0, whatever the residual branch carried.
    model.eval()
    with torch.no_grad():
        block[1].weight.zero_(), block[1].bias.zero_()
        x = torch.randn(1, 8, 6, 6)
        assert block(x).abs().max() == 0
        y = block[0](x)
        torch.testing.assert_close(y - x, block[0].fn(x))


def test_layernorm_eps_and_qkv_bias():
    v, m = meta_model(vit, 'vit_s16'), meta_model(mixer, 'mixer_s16')
    norms = [mod for model in (v, m) for mod in model.modules() if isinstance(mod, torch.nn.LayerNorm)]
    assert norms and all(n.eps == 1e-6 for n in norms)
    assert v.blocks[0].attn.qkv.bias is not None


def test_init_follows_official_jax_code():
    torch.manual_seed(0)
    model = vit.create('vit_b16', depth=2)
    assert model.head.weight.abs().max() == 0 and model.head.bias.abs().max() == 0
    assert model.cls_token.abs().max() == 0
    assert abs(model.pos_embed.std().item() - 0.02) < 0.002
    w = model.patch_embed.proj.weight  # lecun normal: std sqrt(1 / fan_in), fan_in = 3 * 16 * 16
    assert abs(w.std().item() - math.sqrt(1 / 768)) < 0.05 * math.sqrt(1 / 768)
    bound = math.sqrt(6 / (768 + 768))  # xavier-uniform of each (D, D) q, k, v kernel
    qkv = model.blocks[0].attn.qkv.weight
    assert qkv.abs().max() <= bound and qkv.abs().max() > 0.99 * bound
    assert 0 < model.blocks[0].mlp.fc1.bias.abs().max() < 1e-5
    mix = mixer.create('mixer_s16', depth=1)
    assert mix.head.weight.abs().max() == 0
    w = mix.blocks[0].mlp_channels.fc1.weight
    assert abs(w.std().item() - math.sqrt(1 / 512)) < 0.05 * math.sqrt(1 / 512)


def test_attention_maps_slow_path_equals_fused_path():
    torch.manual_seed(0)
    model = randomise(vit.create('vit_ti16', img_size=32, patch_size=8, depth=3)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fast, _ = model.forward_features(x)
        slow, attns = model.forward_features(x, return_attn=True)
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)
    assert len(attns) == 3 and attns[0].shape == (2, 3, 17, 17)
    torch.testing.assert_close(attns[0].sum(-1), torch.ones(2, 3, 17))
    # the first block's map, computed by hand from its weights
    blk = model.blocks[0]
    tokens = torch.cat([model.cls_token.expand(2, -1, -1),
                        model.patch_embed(x)[0]], 1) + model.pos_embed
    q, k, _ = blk.attn.qkv(blk.norm1(tokens)).reshape(2, 17, 3, 3, 64).permute(2, 0, 3, 1, 4)
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
    torch.testing.assert_close(attns[0], ref.detach(), rtol=1e-5, atol=1e-6)


def test_regularisers_and_gelu_option():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    base = randomise(vit.create('vit_s4_cifar', depth=2)).eval()
    reg = vit.create('vit_s4_cifar', depth=2, dropout=0.3, attn_dropout=0.3, drop_path=0.3)
    reg.load_state_dict(base.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reg.eval()(x), base(x))  # inactive in eval mode
        reg.train()
        assert not torch.allclose(reg(x), reg(x))  # active in train mode
    assert reg.blocks[-1].drop_path == pytest.approx(0.3) and reg.blocks[0].drop_path == 0
    tanh = vit.create('vit_s4_cifar', depth=2, gelu='tanh').eval()
    tanh.load_state_dict(base.state_dict())
    with torch.no_grad():
        diff = (tanh(x) - base(x)).abs().max()
    assert 0 < diff < 1e-2  # the tanh approximation is close to, but not, exact GELU
