"""Momentum-SAM (MSAM): SAM's perturbation taken along the base optimizer's momentum instead of a fresh gradient, so
that a step makes ONE forward + backward pass, as the base optimizer does. Becker, Altrock & Risse 2024,
"Momentum-SAM: Sharpness Aware Minimization without Computational Overhead" (arXiv 2401.12033), Algorithm 1, with
m the momentum (SGD's momentum buffer v; Adam/AdamW's first moment exp_avg) and ||m|| ONE norm over all parameters:

    w_tilde = w - rho m/||m||       (m = 0, before the first step: w_tilde = w)                        perturb()
    g       = grad L(w_tilde)       the step's only forward + backward pass
    w      <- w                     exactly, from a saved copy
    w      <- base_optimizer(w, g)  which also moves m on: SGD v <- mu v + g; Adam m <- b1 m + (1 - b1) g   step()

The paper writes the step with the shift carried over (w_tilde_{t+1} = w_{t+1} - rho v_{t+1}/||v_{t+1}|| at the end
of step t, undone by adding rho v_{t+1}/||v_{t+1}|| back at the start of step t+1); here the same shift is made at
the start of the step from the same m and undone by a saved copy: the same gradients, with w exact (an arithmetic
undo leaves w off by a rounding each step), the model at w between steps (evaluation and checkpoints see w, no
move_back at the end), and rho = 0 the base optimizer bit for bit (no move at all). The cost of that: one copy of
w, as SAM's. Adam's bias correction is a scalar, cancelled by the normalisation: m is exp_avg as stored.
Deviations from the official code (github.com/MarlonBecker/MSAM, GPL-3.0: read to check, never copied): weight decay
is the base optimizer's, at w (SGD's L2 term there takes it at w_tilde; AdamW's decay there follows the Adam update,
torch's precedes it: lr^2 wd apart).
Checked against: the paper's Algorithm 1 as transcribed from it (emergentmind.com/papers/2401.12033, "SGD with
Momentum-SAM": w = w_tilde + rho v/||v||; v = mu v + g; w = w - eta v; w_tilde = w - rho v/||v||) and the official
code's optimizer/msam.py and adamW_msam.py (the same steps; AdamW perturbs along exp_avg). Hyper-parameters, from
the official README's commands and configs (the paper's text could not be read here beyond its abstract): rho = 3
for SGD (CIFAR-100 WRN/ResNet, ImageNet ResNet-50) and AdamW (ImageNet ViT-S/32); rho = 0 through the LR warm-up in
the ViT/AdamW run (8 of 90 epochs, its rho scheduler 'startJump'), constant from the first step in the SGD runs
(their 1-epoch warm-up). Note rho is a length in parameter space over ALL parameters: 3 is far beyond SAM's 0.05.

The loop (one pass; rho per param group, e.g. 0 while the LR warms up):

    optimizer.perturb()                       # w <- w_tilde (nothing before the first step: m = 0)
    for x, y in micro:                        # gradient accumulation as usual (DDP: no_sync on all but the last)
        scaler.scale(loss_fn(model(x), y) / len(micro)).backward()
    scaler.unscale_(optimizer); clip          # optional: clips g, the gradient at w_tilde
    scaler.step(optimizer)                    # w restored exactly, then the base step with g
    scaler.update(); optimizer.zero_grad(set_to_none=True)

or optimizer.step(closure) (closure: zero_grad, forward, backward, return the loss, here at w_tilde). DDP: m comes
from all-reduced gradients, so w_tilde is the same on every replica; nothing else is needed. GradScaler: m is
unscaled (the base optimizer steps with unscaled gradients), so the shift does not depend on the loss scale; an
overflow skips the step with w exact (SAM.step restores it first) and m untouched. BatchNorm: the one pass is at
w_tilde and its running statistics are those of that pass (the paper's only pass). state_dict(): the base's, which
holds m: the shift is recomputed from it, so a run resumes bit for bit anywhere. No host sync (rho/||m|| stays on
the device, w is saved and moved by multi-tensor kernels); an enabled GradScaler's read of found_inf is SAM.step's.
"""
import torch

from sam import SAM


class MSAM(SAM):
    """MSAM(params, base_optimizer, rho=3.0, **base_kwargs): base_optimizer torch.optim.SGD with momentum > 0, or
    torch.optim.Adam / AdamW; rho per param group (as SAM's), the norm of m global."""

    def __init__(self, params, base_optimizer, rho=3.0, **base_kwargs):
        super().__init__(params, base_optimizer, rho=rho, **base_kwargs)
        if isinstance(self.base_optimizer, torch.optim.SGD):
            self.key = 'momentum_buffer'
            bad = [g['momentum'] for g in self.param_groups if not g['momentum'] > 0]
        elif isinstance(self.base_optimizer, torch.optim.Adam):  # (AdamW too)
            self.key = 'exp_avg'
            bad = [g['betas'][0] for g in self.param_groups if not g['betas'][0] > 0]
        else:
            raise TypeError('MSAM perturbs along the base optimizer\'s momentum: torch.optim.SGD (momentum > 0), '
                            f'Adam or AdamW, not {type(self.base_optimizer).__name__}')
        if bad:
            raise ValueError(f'MSAM needs momentum: {type(self.base_optimizer).__name__} with momentum (or beta1) > 0, '
                             f'got {bad[0]}')

    @torch.no_grad()
    def perturb(self):
        """w <- w - rho m/||m|| (before the forward pass); w saved for step() to restore exactly."""
        if self.moved is not None:
            raise RuntimeError('MSAM.perturb() was called twice: finish the step with step() (or scaler.step)')
        buckets = {}  # foreach kernels want one device and dtype per list
        for group in self.param_groups:
            for p in group['params']:
                if self.state[p].get(self.key) is not None:
                    buckets.setdefault((id(group), p.device, p.dtype), (group, []))[1].append(p)
        self.moved = []
        ms = [self.state[p][self.key] for _, ps in buckets.values() for p in ps]
        if not ms:  # before the first step: m = 0, no move
            return
        norm = torch.nn.utils.get_total_norm(ms)
        for group, ps in buckets.values():
            if group['rho'] == 0:  # (the warm-up: no copy, no move; the base optimizer bit for bit)
                continue
            scale = torch.where(norm > 0, -group['rho'] / norm, 0.0).to(ps[0].device)  # (m = 0: no 0/0)
            for p in ps:
                if p not in self.w_old:
                    self.w_old[p] = torch.empty_like(p)
            torch._foreach_copy_([self.w_old[p] for p in ps], ps)
            torch._foreach_add_(ps, torch._foreach_mul([self.state[p][self.key] for p in ps], scale))
            self.moved += ps

    def step(self, closure=None, model=None):
        """With a closure: perturb(), the closure's one pass, then the step; returns its loss (at w_tilde); model: as
        SAM's step takes it, not needed here. Without one (what GradScaler.step calls): w restored exactly, then the
        base step (skipped on an fp16 overflow)."""
        if closure is not None:
            self.perturb()
            with torch.enable_grad():
                loss = closure()
            self.step()
            return loss
        if self.moved is None:
            raise RuntimeError('MSAM.step() ends a step that began with perturb() before its forward pass')
        return super().step()

    def first_step(self, zero_grad=False):
        raise RuntimeError('MSAM makes no gradient ascent: call perturb() before the forward pass, then step()')

    def next_group(self):
        raise RuntimeError('MSAM has no m-sharpness groups: one perturbation (along m) per step')
