"""The small things the tests share: a tiny MLP and its data (the SAM family's tests), parameter snapshots, a flat
fp64 gradient for the transcribed oracles, and a free TCP port for gloo rendezvous. Spawned DDP workers import
their test module, and so this one: everything stays at top level."""
import socket

import torch
import torch.nn as nn
import torch.nn.functional as F


def toy_mlp(seed, bn=False, dtype=torch.float32):
    """6 -> 16 -> 3 with LayerNorm (per-sample, so accumulation is exact) or BatchNorm1d (bn=True)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16) if bn else nn.LayerNorm(16), nn.GELU(),
                         nn.Linear(16, 3)).to(dtype)


def toy_data(seed, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g)


def clone_params(model):
    return [p.detach().clone() for p in model.parameters()]


def all_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def flat_grad(model, w, x, y):
    """The cross-entropy gradient of `model` at the flat parameter vector w (model's parameters untouched)."""
    shapes = [p.shape for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    w = w.detach().requires_grad_(True)
    views = dict(zip(names, (v.view(s) for v, s in zip(w.split([s.numel() for s in shapes]), shapes))))
    loss = F.cross_entropy(torch.func.functional_call(model, views, (x,)), y)
    return torch.autograd.grad(loss, w)[0]


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]
