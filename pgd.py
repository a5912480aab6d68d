"""Projected gradient descent (PGD-k, L-inf) and FGSM adversarial examples for any classifier.

Madry, Makelov, Schmidt, Tsipras & Vladu 2018, "Towards Deep Learning Models Resistant to
Adversarial Attacks" (ICLR 2018), eq. (2) and Sec. 2.1. With x0 the clean image in [0, 1] pixels,
S = B_eps(x0) the L-inf ball of radius eps around it (intersected with the [0, 1] image box), and
L the classification loss of the model at the true label y:

    x  <- x0 + U(-eps, eps)^d                    random start (Madry et al. Sec. 2.1; optional)
    x  <- Proj_S(x + alpha * sign(grad_x L(x, y)))       repeated `steps` times (PGD-k, k = steps)

Proj_S clamps x - x0 to [-eps, eps], then x to [0, 1]. FGSM (Goodfellow, Shlens & Szegedy 2015,
"Explaining and Harnessing Adversarial Examples") is the one-step case from x0: alpha = eps, no
random start.

Units: eps and alpha are in [0, 1] pixel units (8/255 is the usual CIFAR eps). The model usually
expects normalised input, so pass `normalize` (a function of [0, 1] pixels): it is applied INSIDE
the attacked function, and eps is measured on pixels, not on normalised values.

The model is in eval mode for the attack, then back in its own mode; only grad_x is computed (autograd.grad):
no parameter's .grad is touched, so the attack can run in the middle of a training step.

    x_adv = pgd(model, x, y, eps=8/255, alpha=2/255, steps=10,
                normalize=lambda x: (x - mean) / std)      # mean, std: (1, 3, 1, 1) tensors

This is torchattacks.PGD / torchattacks.FGSM (3.5.1), which tests/test_pgd.py checks it against:
the same update, the same order of clamps, and the same random start drawn from torch's global
RNG (torch.empty_like(x).uniform_(-eps, eps)), so both give the same x_adv from the same seed.
One difference: the gradient of the batch's summed loss, not its mean. Only its sign is used (sign(B g) =
sign(g)), but under fp16 autocast (train_cifar.py --adv, no GradScaler) the mean's 1/B flushes small input
gradients below fp16's smallest subnormal to 0, and those pixels would not move (tests/test_pgd.py builds a case).
"""
import math
import numbers

import torch
import torch.nn.functional as F


def pgd(model, x, y, eps, alpha, steps, random_start=True, normalize=None, loss_fn=F.cross_entropy):
    """x (B, C, H, W) in [0, 1], y (B,) labels -> x_adv (B, C, H, W), detached, in B_eps(x) and [0, 1].
    loss_fn(logits, y, reduction='sum'): a torch.nn.functional loss (the sum: module docstring).

    random_start: True draws the start x0 + U(-eps, eps) from torch's global RNG (as torchattacks);
    False starts at x0 (FGSM's start); a tensor delta (shape of x) starts at x0 + delta, for
    reproducible starts independent of the batch (robustness.py seeds one per image)."""
    check(x, y, eps, alpha, steps, random_start)
    was_training = model.training
    model.eval()
    try:
        x0 = x.detach()
        x_adv = x0.clone()
        if isinstance(random_start, torch.Tensor):
            x_adv = torch.clamp(x0 + random_start.clamp(-eps, eps), 0, 1)
        elif random_start:
            x_adv = torch.clamp(x_adv + torch.empty_like(x_adv).uniform_(-eps, eps), 0, 1)
        with torch.enable_grad():  # also when called under torch.no_grad(), e.g. inside an evaluation
            for _ in range(steps):
                x_adv.requires_grad_(True)
                # summed, not averaged: the mean's 1/B underflows fp16 input gradients (module docstring)
                loss = loss_fn(model(x_adv if normalize is None else normalize(x_adv)), y, reduction='sum')
                grad, = torch.autograd.grad(loss, x_adv)
                x_adv = x_adv.detach() + alpha * grad.sign()
                delta = torch.clamp(x_adv - x0, -eps, eps)       # Proj onto B_eps(x0) ...
                x_adv = torch.clamp(x0 + delta, 0, 1).detach()   # ... and onto the image box [0, 1]
    finally:  # the caller's mode back, also when the model or loss_fn raised
        model.train(was_training)
    return x_adv


def fgsm(model, x, y, eps, normalize=None, loss_fn=F.cross_entropy):
    """FGSM: x_adv = clamp(x + eps * sign(grad_x L), 0, 1), one PGD step from x without a random start."""
    return pgd(model, x, y, eps, alpha=eps, steps=1, random_start=False, normalize=normalize, loss_fn=loss_fn)


def check(x, y, eps, alpha, steps, random_start):  # what a caller can get wrong, named (x's values are not read)
    for name, v in (('eps', eps), ('alpha', alpha)):  # pixel units: 1 is the whole box, so above is 8 for 8/255
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and 0 <= v <= 1):
            raise ValueError(f'{name} must be a number in [0, 1] pixel units (8/255, not 8), got {v!r}')
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f'steps must be an integer >= 0 (0: the start alone), got {steps!r}')
    if not isinstance(random_start, (bool, torch.Tensor)):  # the string 'no' would be truthy: a random start
        raise TypeError(f'random_start must be True, False or a tensor, got {random_start!r}')
    if not (isinstance(x, torch.Tensor) and x.is_floating_point() and isinstance(y, torch.Tensor)
            and y.shape[:1] == x.shape[:1] and getattr(random_start, 'shape', x.shape) == x.shape):
        raise ValueError('x must be a float image batch in [0, 1], y one label per image, a random_start tensor '
                         f'the shape of x; got {[getattr(t, "shape", type(t).__name__) for t in (x, y, random_start)]}')
