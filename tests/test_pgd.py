"""pgd.py against the torchattacks 3.5.1 oracle (PGD, FGSM), and the eps-ball / [0, 1] invariant."""
import pytest
import torch
import torch.nn as nn

torchattacks = pytest.importorskip('torchattacks')

from pgd import fgsm, pgd  # noqa: E402

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2471, 0.2435, 0.2616]).view(1, 3, 1, 1)


class Normalize(nn.Module):  # the oracle's side: normalisation as the model's first layer
    def forward(self, x):
        return (x - MEAN) / STD


def tiny_net(seed=0):
    """BatchNorm and dropout, so that eval mode during the attack matters."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def batch(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 16, 16, generator=g)
    x[:2] = x[:2].round()  # pixels exactly at 0 and 1: the box constraint is active there
    return x, torch.randint(0, 10, (n,), generator=g)


def warm_bn(net):
    net.train()
    with torch.no_grad():  # give BatchNorm running statistics that differ from batch statistics
        net(torch.rand(64, 3, 16, 16) * 0.5)


@pytest.mark.parametrize('random_start', [False, True, 'injected'])
@pytest.mark.parametrize('normalised', [False, True])
def test_pgd_equals_torchattacks(random_start, normalised):
    net = tiny_net()
    warm_bn(net)  # left in train mode: both attacks must switch to eval themselves
    x, y = batch()
    eps, alpha, steps = 8 / 255, 2 / 255, 10
    oracle_model = nn.Sequential(Normalize(), net) if normalised else net
    torch.manual_seed(123)
    want = torchattacks.PGD(oracle_model, eps=eps, alpha=alpha, steps=steps,
                            random_start=random_start is not False)(x, y)
    torch.manual_seed(123)
    if random_start == 'injected':  # the same draw torchattacks makes, handed over as a tensor
        start = torch.empty_like(x).uniform_(-eps, eps)
        torch.manual_seed(999)  # pgd must not draw from the global RNG when given a start
    else:
        start = random_start
    got = pgd(net, x, y, eps, alpha, steps, random_start=start,
              normalize=(lambda v: (v - MEAN) / STD) if normalised else None)
    assert net.training  # mode restored
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got - x).abs().max() > 0.9 * eps  # and the attack really moved the images


def test_fgsm_equals_torchattacks():
    net = tiny_net(seed=3)
    warm_bn(net)
    x, y = batch(seed=4)
    for eps in (2 / 255, 8 / 255):
        want = torchattacks.FGSM(nn.Sequential(Normalize(), net), eps=eps)(x, y)
        got = fgsm(net, x, y, eps, normalize=lambda v: (v - MEAN) / STD)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_attack_stays_in_ball_and_box_and_touches_nothing():
    net = tiny_net(seed=5)
    warm_bn(net)
    bn = net[1]
    stats = [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]
    x, y = batch(32, seed=6)
    for eps, alpha, steps in [(8 / 255, 2 / 255, 10), (4 / 255, 10 / 255, 7), (0.3, 0.5, 3)]:
        with torch.no_grad():  # the attack enables gradients itself
            x_adv = pgd(net, x, y, eps, alpha, steps)
        assert (x_adv - x).abs().max() <= eps + 1e-6
        assert x_adv.min() >= 0 and x_adv.max() <= 1
        assert (x_adv - x).abs().max() > 0.99 * eps  # alpha >= eps/4 x 10 steps reach the boundary
    # eval mode inside: BatchNorm statistics untouched, dropout off (two runs from the same start agree)
    for s, now in zip(stats, [bn.running_mean, bn.running_var, bn.num_batches_tracked]):
        torch.testing.assert_close(now, s, rtol=0, atol=0)
    assert all(p.grad is None for p in net.parameters())
    torch.testing.assert_close(pgd(net, x, y, 0.1, 0.02, 5, random_start=False),
                               pgd(net, x, y, 0.1, 0.02, 5, random_start=False), rtol=0, atol=0)
    net.eval()
    pgd(net, x, y, 0.1, 0.02, 1)
    assert not net.training  # eval stays eval


def test_fp16_autocast_input_gradient_does_not_underflow():
    """Under fp16 autocast, unscaled (train_cifar.py --adv --amp fp16): a model whose input gradient is
    small, 2e-6 per pixel for the summed loss and so 2e-6 / 256 = 8e-9 for the batch mean, below fp16's
    smallest subnormal (6e-8). The mean's gradient flushes to 0 and sign(0) = 0 leaves every pixel where it
    was; the summed loss pgd takes (pgd.py docstring) moves every pixel by alpha, as fp32 does."""
    B, d, s = 256, 3 * 8 * 8, 2e-6
    net = nn.Sequential(nn.Flatten(), nn.Linear(d, 2, bias=False))
    with torch.no_grad():  # logit 0 = s * sum(x), logit 1 = -s * sum(x): d loss / d pixel = -s per image
        net[1].weight.copy_(torch.stack([torch.full((d,), s), torch.full((d,), -s)]))
    x = 0.1 + 0.8 * torch.rand(B, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(B, dtype=torch.long)
    alpha = 2 / 255
    want = pgd(net, x, y, 8 / 255, alpha, 1, random_start=False)  # fp32
    torch.testing.assert_close(want, x - alpha, rtol=0, atol=1e-6)  # every pixel down by alpha (gradient -s)
    with torch.autocast('cpu', dtype=torch.float16):
        got = pgd(net, x, y, 8 / 255, alpha, 1, random_start=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize('kw, match', [
    (dict(eps=8), r'eps must be a number in \[0, 1\] pixel units \(8/255, not 8\), got 8'),
    (dict(eps=float('nan')), 'eps must be a number'), (dict(alpha='0.1'), 'alpha must be a number'),
    (dict(steps=2.5), 'steps must be an integer >= 0'), (dict(steps=-1), 'steps must be an integer >= 0'),
    (dict(random_start='no'), "random_start must be True, False or a tensor, got 'no'"),
    (dict(y=torch.zeros(3, dtype=torch.long)), 'y one label per image'),
    (dict(x=torch.zeros(4, 3, 8, 8, dtype=torch.uint8)), 'x must be a float image batch'),
    (dict(random_start=torch.zeros(1, 3, 8, 8)), 'a random_start tensor the shape of x')])
def test_bad_arguments_are_named_and_the_mode_is_kept(kw, match):
    """A library call that trusts its caller (bad-inputs-3's kind): eps 8 for 8/255 would attack with the whole
    pixel range, a fractional step count ran int(steps)... Each is one ValueError/TypeError naming it, and the
    model's mode is back also when the model itself raises."""
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 3)).train()
    args = dict(x=torch.rand(4, 3, 8, 8), y=torch.zeros(4, dtype=torch.long), eps=0.1, alpha=0.02, steps=2)
    with pytest.raises((ValueError, TypeError), match=match):
        pgd(net, **{**args, **kw})
    assert net.training
    wrong = torch.nn.Sequential(torch.nn.Linear(5, 3)).train()
    with pytest.raises(RuntimeError):  # a model that does not take the images: its mode is still restored
        pgd(wrong, **args)
    assert wrong.training
