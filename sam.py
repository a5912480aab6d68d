"""Sharpness-Aware Minimization (SAM) and adaptive SAM (ASAM) around any torch.optim optimizer.

Foret, Kleiner, Mobahi & Neyshabur, "Sharpness-Aware Minimization for Efficiently Improving Generalization"
(ICLR 2021), Algorithm 1, for one mini-batch (w = all parameters); Chen, Hsieh & Gong 2021 train ViTs and
MLP-Mixers from scratch with it:

    g       = grad L(w)                     first forward + backward
    eps_hat = rho g / ||g||_2               eq. (2), p = 2: ONE norm over all parameters        first_step()
    w      <- w + eps_hat
    g_sam   = grad L(w) at w + eps_hat      second forward + backward (eq. (3) without the Hessian term)
    w      <- w_old; base step with g_sam   w restored exactly from a saved copy                 second_step()

ASAM (Kwon et al. 2021, Sec. 4), adaptive=True: eps_hat = rho T^2 g / ||T g||_2, T = |w| + eta (eta = 0.01 as
the official code). Deviation: that code gives T only to parameters named 'weight'; an optimizer sees no names,
so every parameter of an adaptive group gets T (put biases in a group with adaptive=False to match).
rho, adaptive and eta are per-group settings; the norm is global.

One step; `model` may be DDP-wrapped, `scaler` a disabled GradScaler (fp32, bf16):

    with first_pass(model):                   # DDP: no all-reduce, each replica its own eps_hat
        scaler.scale(loss_fn(model(x), y)).backward()
    optimizer.first_step(zero_grad=True)      # w <- w + eps_hat
    with second_pass(model):                  # BatchNorm running statistics from the first pass only
        scaler.scale(loss_fn(model(x), y)).backward()
    scaler.unscale_(optimizer)                # optional: clip g_sam
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)                    # = second_step(): w <- w_old, then the base step
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

Without a scaler end with optimizer.second_step(zero_grad=True); or loss = optimizer.step(closure, model=model)
runs both passes as above (closure: zero_grad, forward, backward, return the loss). Accumulation: k micro-batches
in each pass, each loss / k (DDP: no_sync on all but the last backward of the second pass).

m-sharpness (Sec. 4.1): eps_hat comes from a group of m images; the paper's JAX code takes it per device, and a
smaller m generalises better. Above, m = the per-device batch. For a smaller m, k groups (x.split(m)):

    for j, (x, y) in enumerate(groups):
        with first_pass(model):
            scaler.scale(loss_fn(model(x), y)).backward()
        optimizer.first_step(zero_grad=True)        # eps_hat_j from group j alone
        with second_pass(model, sync=j == k - 1):   # DDP: one all-reduce, on the last backward
            scaler.scale(loss_fn(model(x), y) / k).backward()
        if j < k - 1:
            optimizer.next_group()                  # w <- w_old; the sum of g_sam set aside
    # then unscale_, clip (the mean g_sam), scaler.step, as above; k = 1 is the plain step, bit for bit

GradScaler: g / ||g|| is scale-free. An inf in a first gradient leaves w where it is and keeps that gradient, so
the step is skipped; SAM.step restores w before skipping. No host sync beyond an enabled scaler's one read of
found_inf (as GradScaler's own step): w is saved, moved and restored by multi-tensor kernels. Imports only torch.
"""
import contextlib
import math
import numbers

import torch

BATCHNORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def check_number(key, v, most=math.inf, most_name=None):
    """A finite real number in [0, most]: a string would fail deep inside a step, and rho = inf makes w NaN."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f'{key} must be a real number, got {type(v).__name__} {v!r}')
    if not (math.isfinite(v) and 0 <= v <= most):
        raise ValueError(f'{key} must be a finite number >= 0' + (f' and <= {most_name or most}' if most < math.inf
                                                                   else '') + f', got {v}')


def check_bool(key, v):
    """An option tested for truth: 'no' or 0.0 would be taken as True or False without a word."""
    if not isinstance(v, bool):
        raise TypeError(f'{key} must be True or False, got {type(v).__name__} {v!r}')


class SAM(torch.optim.Optimizer):
    """SAM(params, base_optimizer, rho=0.05, adaptive=False, eta=0.01, **base_kwargs).

    base_optimizer is an optimizer CLASS (e.g. torch.optim.AdamW), built here with base_kwargs on the same param
    groups: self.param_groups IS self.base_optimizer.param_groups and self.state IS its state, so an LR scheduler
    may drive either object, and state_dict() is the base's.
    """

    # scaler.step(self) calls self.step() even when it found an inf, handing it self.found_inf (and
    # self.grad_scale when unscale_ was not called): see step()
    _step_supports_amp_scaling = True
    extra_defaults = {}  # a successor's own per-group settings (set before SAM.__init__; checked by check_group)

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, eta=0.01, **base_kwargs):
        if isinstance(base_optimizer, torch.optim.Optimizer) or not callable(base_optimizer):
            raise TypeError('base_optimizer must be an optimizer class such as torch.optim.AdamW, with its arguments '
                            'passed to SAM: SAM(model.parameters(), torch.optim.AdamW, rho=0.05, lr=1e-3)')
        defaults = dict(rho=rho, adaptive=adaptive, eta=eta, **self.extra_defaults)
        self.check_group(dict(defaults))  # (also what a later add_param_group falls back on)
        super().__init__(params, defaults)  # each group checked by add_param_group
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        self.param_groups = self.base_optimizer.param_groups  # one set of groups for both objects
        self.state = self.base_optimizer.state
        self.defaults = {**self.base_optimizer.defaults, **self.defaults}
        self.w_old = {}        # param -> buffer holding w while the model sits at w + eps_hat
        self.moved = None      # the params first_step moved; None: no SAM step in progress
        self.set_aside = None  # m-sharpness: param -> sum of g_sam over the groups done so far

    def check_group(self, group):
        """rho, eta: finite numbers >= 0; adaptive: a bool."""
        check_number('rho', group['rho'])
        check_number('eta', group['eta'])
        check_bool('adaptive', group['adaptive'])

    def add_param_group(self, param_group):
        """The new group is checked before it joins: a refused group leaves the optimizer as it was."""
        if not hasattr(self, 'base_optimizer'):  # in Optimizer.__init__, which fills in the defaults
            super().add_param_group(param_group)
            return self.check_group(self.param_groups[-1])
        keys = ('rho', 'adaptive', 'eta', *self.extra_defaults)
        group = {**{k: self.defaults[k] for k in keys}, **param_group}
        self.check_group(group)
        self.base_optimizer.add_param_group(group)  # appends to the shared list (it checks its own keys first)

    def weights(self, group, params):
        """ASAM's T = |w| + eta per parameter (None: SAM)."""
        return torch._foreach_add(torch._foreach_abs(params), group['eta']) if group['adaptive'] else None

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        """w <- w + eps_hat. On an inf/nan gradient (fp16 overflow) w stays and the gradients are kept even with
        zero_grad=True, so that GradScaler sees the overflow and skips the step; zero_grad=True therefore leaves
        .grad = 0 (not None): the choice is made on the device. After next_group(), the g_sam set aside is then
        added back onto .grad."""
        check_bool('zero_grad', zero_grad)
        if self.moved is not None:
            raise RuntimeError('SAM.first_step() was called twice: finish the step with second_step() (or '
                               'scaler.step(optimizer)), or call next_group() between two m-sharpness groups')
        buckets = {}  # foreach kernels want one device and dtype per list
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    buckets.setdefault((id(group), p.device, p.dtype), (group, []))[1].append(p)
        todo = []  # (group, params, grads, T or None, T g or g); the norm runs over all groups
        for group, ps in buckets.values():
            gs = [p.grad for p in ps]
            t = self.weights(group, ps)
            todo.append((group, ps, gs, t, torch._foreach_mul(t, gs) if group['adaptive'] else gs))
        norm = torch.nn.utils.get_total_norm([x for *_, tg in todo for x in tg])
        finite = norm.isfinite()  # a 0-dim tensor: no host sync, the CPU keeps queueing
        self.moved = []
        for group, ps, gs, t, tg in todo:
            scale = torch.where(finite, self.radius(group) / (norm + 1e-12), 0.0)  # 1e-12 guards g = 0
            if t is not None:
                torch._foreach_mul_(t, tg)  # T^2 g (ASAM), or a successor's T g, in place of T
            # the move in one flat buffer, so that on an overflow (0 * inf = nan) ONE nan_to_num makes it exactly 0
            step = torch.cat([x.reshape(-1) for x in (gs if t is None else t)])
            step.mul_(scale.to(step.device)).nan_to_num_(0.0, 0.0, 0.0)
            for p in ps:
                if p not in self.w_old:
                    self.w_old[p] = torch.empty_like(p)
            torch._foreach_copy_([self.w_old[p] for p in ps], ps)  # exact restore, no arithmetic undo
            moves = step.split([p.numel() for p in ps])
            torch._foreach_add_(ps, [d.view_as(p) for d, p in zip(moves, ps)])
            if zero_grad:  # x 0 if finite (clean for the second pass), x 1 keeps an overflow
                torch._foreach_mul_(gs, (~finite).to(device=gs[0].device, dtype=gs[0].dtype))
            self.moved += ps
        if self.set_aside is not None:  # m-sharpness: the earlier groups' g_sam, back onto .grad
            back = [p for p in self.set_aside if p.grad is not None]
            torch._foreach_add_([p.grad for p in back], [self.set_aside[p] for p in back])
            for p, g in self.set_aside.items():
                if p.grad is None:
                    p.grad = g
            self.set_aside = None

    @torch.no_grad()
    def next_group(self):
        """m-sharpness, between two groups: w <- w_old exactly, and .grad (the g_sam summed over the groups so far)
        is set aside, so that the next group's first pass gives its own clean gradient; its first_step puts the
        sum back."""
        if self.moved is None and self.set_aside is None:  # (restore() would name second_step instead)
            raise RuntimeError('SAM.next_group() goes between two m-sharpness groups: after the first_step() (and '
                               'the second backward pass) of one group, before the next group\'s first pass')
        self.restore()
        self.set_aside = {}
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    self.set_aside[p], p.grad = p.grad, None

    def second_step(self, zero_grad=False):
        """w <- w_old (bit-exact), then the base optimizer's step with the current gradient g_sam."""
        check_bool('zero_grad', zero_grad)
        self.step()  # through self.step, so that an LR scheduler on SAM sees the step
        if zero_grad:
            self.zero_grad(set_to_none=True)

    def step(self, closure=None, model=None):
        """With a closure and the model: both passes in first_pass / second_pass, as the written-out loop, and
        the step; returns the first (clean) pass's loss. Without: second_step(), which is what
        scaler.step(optimizer) calls; if the scaler found an inf/nan in either pass, w is restored and the base
        step skipped."""
        if closure is not None:
            loss = self.both_passes(closure, model)
            self.step()
            return loss
        with torch.no_grad():
            self.restore()
            found_inf = getattr(self, 'found_inf', None)  # set only by an enabled GradScaler
            if found_inf is not None and found_inf.item() > 0:  # its one host sync (fp16 only)
                return None  # GradScaler lowers the scale; w is exactly as before the SAM step
            grad_scale = getattr(self, 'grad_scale', None)
            if grad_scale is not None:  # scaler.unscale_ was not called: unscale as it would (its multiplier,
                inv = grad_scale.double().reciprocal().float()  # one multi-tensor kernel per device and dtype)
                buckets = {}
                for group in self.param_groups:
                    for p in group['params']:
                        if p.grad is not None:
                            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
                for (device, _), grads in buckets.items():
                    torch._foreach_mul_(grads, inv.to(device))
            self.base_optimizer.step()
        return None

    def both_passes(self, closure, model, sync=True):
        """step(closure, model): the first pass, first_step and the second pass of the loop above."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError('step(closure) needs the model too: optimizer.step(closure, model=model), so that the '
                            'second pass runs in second_pass(model) (BatchNorm statistics from the first pass; DDP: '
                            f'no all-reduce of the first gradient) as the written-out loop; got model={model!r}')
        with torch.enable_grad(), first_pass(model):
            loss = closure()
        self.first_step(zero_grad=True)
        with torch.enable_grad(), second_pass(model, sync=sync):
            closure()
        return loss

    def radius(self, group):  # rho of this step (GSAM: rho_t)
        return group['rho']

    def restore(self):
        if self.set_aside is not None:
            raise RuntimeError('SAM.next_group() set the SAM gradient aside for a next group: call it between '
                               'groups only, not after the last one')
        if self.moved is None:
            raise RuntimeError('SAM.second_step() / step() without a closure finishes a SAM step: call '
                               'first_step() after the first backward pass, or pass a closure to step()')
        if self.moved:
            torch._foreach_copy_(self.moved, [self.w_old[p] for p in self.moved])
        self.moved = None

    def state_dict(self):
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        """As every torch optimizer: the saved state wins, param-group settings included (rho, adaptive, eta, lr,
        weight_decay, ...): a SAM built with rho=0.1 holds the file's rho after loading. To continue with new
        settings, put them into param_groups after loading (runs.load_optimizer_state does so for --resume)."""
        self.base_optimizer.load_state_dict(state_dict)
        # the base builds new group dicts on load: share them again, and give a checkpoint without our keys (a
        # plain base optimizer's, or SAM's in a successor) the constructor's settings
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state
        for group in self.param_groups:
            for key in ('rho', 'adaptive', 'eta', *self.extra_defaults):
                group.setdefault(key, self.defaults[key])


def first_pass(model):
    """Context for the first forward + backward: model.no_sync() for a DDP model, so each replica computes eps_hat
    from its own sub-batch (m-sharpness) and no all-reduce is spent on a gradient used only locally. For any other
    model it does nothing."""
    no_sync = getattr(model, 'no_sync', None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


@contextlib.contextmanager
def second_pass(model, sync=True):
    """Context for the second forward + backward: train-mode BatchNorm layers still normalise with the batch
    statistics, but running_mean/var and num_batches_tracked are not updated, so they come from the clean first
    pass only. sync=False (every m-sharpness group but the last; GSAM) adds DDP's no_sync."""
    check_bool('sync', sync)
    frozen = [m for m in model.modules() if isinstance(m, BATCHNORMS) and m.training and m.track_running_stats]
    for m in frozen:
        m.track_running_stats = False
    try:
        with contextlib.nullcontext() if sync else first_pass(model):
            yield
    finally:
        for m in frozen:
            m.track_running_stats = True
