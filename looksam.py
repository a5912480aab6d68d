"""LookSAM: SAM's two passes only every k-th step; in between one pass plus the cached part of the last SAM gradient
orthogonal to its clean gradient. Liu, Mai, Chen, Hsieh & You 2022, "Towards Efficient and Scalable Sharpness-Aware
Minimization" (CVPR 2022, arXiv 2203.02714), Algorithm 1, with g, g_s, g_v ONE vector over all parameters (as SAM's
eps_hat, Foret et al. eq. 2) and t counting the optimizer's steps from 0:

    t mod k == 0 (refresh, 2 passes)   g     = grad L(w)                          first pass       first_step()
                                       g_s   = grad L(w + rho g/||g||)            second pass, as SAM
                                       g_v   = g_s - (<g_s, g>/||g||^2) g         orthogonal to g; cached as
                                       g_hat = g_s                                g_v/||g_v||   look_gradient()
    otherwise    (reuse, 1 pass)       g_hat = g + alpha (||g||/||g_v||) g_v      added term: norm alpha ||g||
    w <- base_optimizer(w, g_hat)                                                                     step()

k = 1 is SAM bit for bit (g_v, never used, is not computed); alpha = 0 is SAM every k-th step and the base optimizer
between (MosaicML Composer's SAM `interval`); rho = 0 is the base optimizer bit for bit (g_s = g makes g_v = 0
exactly). per_tensor=True is what most ports do (c and ||g||, ||g_v|| per parameter tensor): another algorithm,
offered by name only. Checked against (the paper's own text could not be read here beyond its abstract): two
independent transcriptions of Algorithm 1 that agree with the above, junaidaliop.github.io/zij/math/looksam (g_v =
g_s - ||g_s|| cos(g, g_s) g/||g||) and the LookSAM the MSAM authors ran in their comparison (MarlonBecker/MSAM
optimizer/looksam.py: global vectors, + alpha ||g|| g_v/||g_v||; read, not copied: GPL-3.0). alpha = 0.1 by default,
not the paper's ViT value 0.7 (as that code's config and the transcriptions give it): 0.1 is what the MSAM authors ran
with AdamW in their ImageNet comparison (k 5), and at CPU scale here (docs/sam.md) AdamW with 0.7 fell from SAM's 43%
to 28% test accuracy (its training loss too: the stale g_v, rotated in by 35 degrees, hampers Adam), 0.1 stayed at
42.6%.

The loop is sam.py's, a reuse step one pass over the groups as micro-batches, and one call after the last backward
(before unscale_ and clipping, so that clipping clips g_hat):

    two = optimizer.refresh                     # t mod k == 0: this step makes two passes
    for j, (x, y) in enumerate(groups):         # m-sharpness groups of m images (one group: the batch)
        with first_pass(model) if two or j < len(groups) - 1 else nullcontext():
            scaler.scale(loss_fn(model(x), y) / (1 if two else len(groups))).backward()
        if two:
            optimizer.first_step(zero_grad=True)                  # w <- w + eps_hat_j; g_j kept
            with second_pass(model, sync=j == len(groups) - 1):
                scaler.scale(loss_fn(model(x), y) / len(groups)).backward()
            if j < len(groups) - 1:
                optimizer.next_group()
    optimizer.look_gradient(all_reduce=distributed)   # refresh: cache g_v; reuse: .grad <- g_hat
    scaler.unscale_(optimizer); clip; scaler.step(optimizer); scaler.update(); zero_grad

or loss = optimizer.step(closure, model=model), the same step (the closure: zero_grad, forward, backward, loss).
DDP: a refresh is SAM's step (each replica its own eps_hat) and DDP averages g_s; look_gradient(all_reduce=True)
sums the clean g over the replicas in one all-reduce of a flat buffer (its scale cancels in g_v, as the sum over
m-sharpness groups does), so every replica caches the same g_v (without it their g_v and weights drift apart). A
reuse step's g is DDP's average: the same g_hat everywhere. GradScaler: the loss scale cancels in g_v/||g_v|| (as
clipping does) and the reuse term scales with g; an overflow in any pass keeps the cached g_v (a mask on the device)
and SAM.step skips the step with w exact; t counts step() calls, skipped or not (a skip-dependent count
would read found_inf once more). BatchNorm: statistics from the clean passes only. state_dict(): the base's, with t
and g_v: a run resumes bit for bit anywhere in a cycle. No host sync; an enabled GradScaler's one read of found_inf
is SAM.step's. Cost over SAM on a refresh: a flat copy of g, a transient one of g_s, three dot products; the cached
g_v (one flat copy of the parameters); a reuse step: one norm and one multi-tensor add over the base step.
"""
import math
import numbers

import torch

from sam import SAM


def buckets(param_groups):
    """(device, dtype) -> the params with a gradient: foreach kernels and flat buffers want one of each."""
    out = {}
    for group in param_groups:
        for p in group['params']:
            if p.grad is not None:
                out.setdefault((p.device, p.dtype), []).append(p)
    return out


class LookSAM(SAM):
    """LookSAM(params, base_optimizer, rho=0.05, k=5, alpha=0.1, per_tensor=False, adaptive=False, eta=0.01,
    **base_kwargs): sam.SAM with the refresh/reuse cycle above (rho, adaptive, eta: SAM's, on refresh steps)."""

    def __init__(self, params, base_optimizer, rho=0.05, k=5, alpha=0.1, per_tensor=False, adaptive=False, eta=0.01,
                 **base_kwargs):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f'k (steps per refresh) must be an integer >= 1, got {k!r}')
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f'alpha must be a finite number >= 0, got {alpha!r}')
        super().__init__(params, base_optimizer, rho=rho, adaptive=adaptive, eta=eta, **base_kwargs)
        self.k, self.alpha, self.per_tensor = int(k), float(alpha), bool(per_tensor)
        self.t = 0           # step() calls so far: t mod k == 0 is a refresh
        self.g_sum = None    # refresh: (device, dtype) -> (params, flat sum of the groups' clean g)
        self.g_v = {}        # param -> its slice of the cached g_v/||g_v|| (per_tensor: its own unit vector)
        self.looked = False  # look_gradient() done in this step

    @property
    def refresh(self):
        """True when this step makes SAM's two passes (t mod k == 0)."""
        return self.t % self.k == 0

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        """SAM's first_step, on refresh steps only; keeps this group's clean g (summed over m-sharpness groups)."""
        if not self.refresh:
            raise RuntimeError('LookSAM: this step reuses g_v (one pass): call first_step() only when '
                               'optimizer.refresh is True')
        if self.k > 1 and self.moved is None:  # (a second call: SAM's first_step raises)
            self.g_sum = {} if self.g_sum is None else self.g_sum
            for key, ps in buckets(self.param_groups).items():
                flat = torch.cat([p.grad.reshape(-1) for p in ps])
                self.g_sum[key] = (ps, self.g_sum[key][1].add_(flat) if key in self.g_sum else flat)
        super().first_step(zero_grad)

    @torch.no_grad()
    def look_gradient(self, all_reduce=False):
        """After the last backward of the step, before unscale_/clipping/step. Refresh: caches g_v (all_reduce:
        g averaged over the replicas of the default process group first). Reuse: .grad <- g_hat."""
        if self.looked:
            raise RuntimeError('LookSAM.look_gradient() was called twice in one step')
        if self.refresh and self.k > 1 and self.g_sum is None:
            raise RuntimeError('LookSAM: this step is a refresh (optimizer.refresh): make two passes, with '
                               'first_step() after the first backward')
        self.looked = True
        if self.refresh and self.k > 1:
            self.decompose(all_reduce)
        elif not self.refresh and self.alpha > 0:
            self.reuse()

    def decompose(self, all_reduce):
        """g_v = g_s - (<g_s, g>/||g||^2) g, cached as g_v/||g_v|| (0 where g_v = 0); an overflow keeps the old."""
        parts = list(self.g_sum.values())
        g = [flat for _, flat in parts]
        v = [torch.cat([p.grad.reshape(-1) for p in ps]) for ps, _ in parts]  # g_s; g_v in place below
        if all_reduce:
            for x in g:
                torch.distributed.all_reduce(x)  # (the sum: its scale cancels in g_v)
        dev = g[0].device
        if self.per_tensor:  # one segment (c, ||g_v||) per tensor
            cut = lambda xs: [s for x, (ps, _) in zip(xs, parts) for s in x.split([p.numel() for p in ps])]  # noqa
            g_seg, v_seg = cut(g), cut(v)
            dots = lambda a, b: [torch.dot(x, y) for x, y in zip(a, b)]  # noqa: E731
        else:  # one segment per bucket, one global value for all of them
            g_seg, v_seg = g, v
            dots = lambda a, b: [sum(torch.dot(x, y).to(dev) for x, y in zip(a, b))] * len(a)  # noqa: E731
        gg, gsg = dots(g_seg, g_seg), dots(v_seg, g_seg)
        torch._foreach_addcmul_(v_seg, g_seg, [torch.where(a > 0, b / a, 0.0) for a, b in zip(gg, gsg)], value=-1)
        vv = dots(v_seg, v_seg)
        ok = torch.stack([x.to(dev) for x in (*gg, *gsg, *vv)]).isfinite().all()  # not: an overflow in a pass
        inv = [torch.where(ok & (a > 0), a.rsqrt(), 0.0) for a in vv]
        for x in v:
            x.nan_to_num_(0.0, 0.0, 0.0)  # (an overflow: 0 * inf = nan; ok is False there)
        torch._foreach_mul_(v_seg, inv)
        for (ps, _), x in zip(parts, v):
            x.add_(torch.cat([self.g_v.get(p, torch.zeros_like(p)).reshape(-1) for p in ps]) * (~ok).to(x.dtype))
            self.g_v.update((p, u.view_as(p)) for p, u in zip(ps, x.split([p.numel() for p in ps])))
        self.g_sum = None

    def reuse(self):
        """.grad <- g + alpha ||g|| g_v/||g_v|| (per_tensor: ||g_p|| and g_v's unit vector per tensor)."""
        grads = [p.grad for group in self.param_groups for p in group['params'] if p.grad is not None]
        cached = [p for group in self.param_groups for p in group['params'] if p.grad is not None and p in self.g_v]
        if self.per_tensor:
            scales = torch._foreach_mul(torch._foreach_norm([p.grad for p in cached]), self.alpha)
            torch._foreach_add_([p.grad for p in cached], torch._foreach_mul([self.g_v[p] for p in cached], scales))
            return
        norm = torch.nn.utils.get_total_norm(grads)  # ||g|| over all parameters
        for (device, dtype), ps in buckets([{'params': cached}]).items():
            scale = (self.alpha * norm).to(device, dtype)
            torch._foreach_add_([p.grad for p in ps], torch._foreach_mul([self.g_v[p] for p in ps], scale))

    def step(self, closure=None, model=None):
        """With a closure and the model: the whole step (refresh: SAM's two passes, in first_pass / second_pass;
        reuse: one), returning the first pass's loss. Without (what GradScaler.step calls): look_gradient() if it
        was not called, then SAM's step (w restored, the base step)."""
        if closure is not None:
            if self.refresh:
                loss = self.both_passes(closure, model)
            else:
                with torch.enable_grad():
                    loss = closure()
            self.step()
            return loss
        if not self.looked:
            self.look_gradient()  # (this process alone: under DDP call look_gradient(all_reduce=True) first)
        if not self.refresh:
            self.moved = []  # nothing was moved: SAM.step's restore has nothing to do
        self.t, self.looked = self.t + 1, False
        return super().step()

    def state_dict(self):
        order = [p for group in self.param_groups for p in group['params']]
        return {**super().state_dict(), 'looksam': {'t': self.t, 'g_v': [self.g_v.get(p) for p in order]}}

    def load_state_dict(self, state_dict):
        """The base's state, and t and g_v when the file has them (a SAM checkpoint: t = 0, no g_v)."""
        super().load_state_dict(state_dict)
        saved = state_dict.get('looksam', {'t': 0, 'g_v': []})
        order = [p for group in self.param_groups for p in group['params']]
        self.t = int(saved['t'])
        self.g_v = {p: v.to(p.device, p.dtype) for p, v in zip(order, saved['g_v']) if v is not None}
