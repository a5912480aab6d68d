"""Sharpness-Aware Minimization (SAM) and adaptive SAM (ASAM) around any torch.optim optimizer; GSAM (class GSAM,
its equations in its docstring) is SAM with rho following the lr and the update g_p - alpha g_perp.

SAM is how Chen, Hsieh & Gong 2021 train ViTs and MLP-Mixers from scratch to flat minima.
Foret, Kleiner, Mobahi & Neyshabur 2020, "Sharpness-Aware Minimization for Efficiently Improving
Generalization" (ICLR 2021), Algorithm 1, for one mini-batch with w = all parameters:

    g       = grad L(w)                     first forward + backward, at w
    eps_hat = rho * g / ||g||_2             eq. (2), p = 2: ONE norm over all parameters   first_step()
    w      <- w + eps_hat
    g_sam   = grad L(w) at w + eps_hat      second forward + backward (eq. (3) without the
                                            Hessian term, as in the paper)
    w      <- w_old; base step with g_sam   w restored exactly from a saved copy           second_step()

ASAM (Kwon et al. 2021, "ASAM: Adaptive Sharpness-Aware Minimization", Sec. 4) is adaptive=True:
eps_hat = rho * T^2 g / ||T g||_2 with T = |w| + eta (eta = 0.01 in the official code). Deviation:
the official code gives T only to parameters named 'weight'; an optimizer sees no names, so here
every parameter of an adaptive group gets T; put biases in a group with adaptive=False to match.
rho, adaptive and eta are per-group settings; the norm is always global.

One step with k micro-batches (k = 1 without accumulation); `model` may be DDP-wrapped and
`scaler` a disabled GradScaler (fp32, bf16):

    with first_pass(model):                     # DDP: no_sync, each replica its own eps_hat
        for x, y in micro:
            scaler.scale(loss_fn(model(x), y) / k).backward()
    optimizer.first_step(zero_grad=True)        # w <- w + eps_hat
    with second_pass(model):                    # BatchNorm running stats from the first pass only
        for j, (x, y) in enumerate(micro):      # (under DDP: no_sync on all but the last)
            scaler.scale(loss_fn(model(x), y) / k).backward()
    scaler.unscale_(optimizer)                  # optional: clip the SECOND gradient
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)                      # = second_step(): w <- w_old, then the base step
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

Without a scaler end with optimizer.second_step(zero_grad=True), or let optimizer.step(closure)
run both passes (closure: zero_grad, forward, backward, return the loss).

m-sharpness (Foret et al. Sec. 4.1): eps_hat is computed per group of m images, not per batch.
The paper's JAX code takes it per device, from that device's share of the batch, and finds a
smaller m generalises better. Above, m = the per-device batch (first_pass: DDP no_sync). For a
smaller m, cut the device's batch into k groups of m (x.split(m)); each group perturbs w with its
own gradient, the SAM gradients of the groups are averaged, and the base optimizer steps once:

    for j, (x, y) in enumerate(groups):         # k groups of m images
        with first_pass(model):                 # a clean gradient of group j alone
            scaler.scale(loss_fn(model(x), y)).backward()
        optimizer.first_step(zero_grad=True)    # w <- w + eps_hat_j; .grad <- sum of g_sam so far
        with second_pass(model, sync=j == k - 1):  # DDP: one all-reduce, on the last backward
            scaler.scale(loss_fn(model(x), y) / k).backward()
        if j < k - 1:
            optimizer.next_group()              # w <- w_old exactly; the sum of g_sam set aside
    scaler.unscale_(optimizer); clip; scaler.step(optimizer); scaler.update(); zero_grad as above

k = 1 is the step above, bit for bit. GradScaler: an overflow in any group's first gradient
leaves w where it is and keeps that gradient in the sum, so the whole step is skipped. Clipping
(after the loop) clips the averaged g_sam. Micro-batches within a group: as above, with the
second loss / (k * micro) and no_sync on all but the very last backward. ASAM: T = |w| + eta at
the restored w, per group. BatchNorm running statistics: each group's clean first pass (k updates).

Which line does what, in brief (README "SAM" explains each choice and the tests that check it):
first_pass -> m-sharpness under DDP (the official JAX code never all-reduces the first
gradient); second_pass -> BatchNorm statistics from the clean pass; first_step keeps w and the
non-finite gradients on an fp16 overflow (eps_hat does not depend on the loss scale: g/||g|| is
scale-free), and SAM.step restores w before GradScaler skips a step; weight decay stays decoupled
in the base optimizer, outside eps_hat. No host sync: rho/||g|| stays on the device, and w is
saved, moved and restored by multi-tensor (torch._foreach_*) kernels, so the CPU can queue ahead.
The one sync left is an enabled GradScaler's (fp16): whether to skip the base step is a Python
decision on found_inf, as in GradScaler itself. Without a scaler or with a disabled one: none.
Cost: two forward/backward passes, one saved copy of w, and while first_step runs one flat copy
of the move (ASAM: two more, of T and T g). Self-contained: imports only torch.
"""
import contextlib
import math
import numbers

import torch

BATCHNORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def check_group(group):
    """rho and eta are finite real numbers >= 0: a string would fail only inside first_step, and rho = inf
    moves w to inf (then NaN) on the first step."""
    for key in ('rho', 'eta'):
        v = group[key]
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f'{key} must be a real number, got {type(v).__name__} {v!r}')
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f'{key} must be a finite number >= 0, got {v}')
    if not isinstance(group.get('adaptive', False), bool):  # first_step tests it for truth: 'no' would be ASAM
        raise TypeError(f"adaptive must be True or False, got {type(group['adaptive']).__name__} {group['adaptive']!r}")


class SAM(torch.optim.Optimizer):
    """SAM(params, base_optimizer, rho=0.05, adaptive=False, eta=0.01, **base_kwargs).

    base_optimizer is an optimizer CLASS (e.g. torch.optim.AdamW), built here with base_kwargs on
    the same param groups: self.param_groups IS self.base_optimizer.param_groups and self.state IS
    its state, so an LR scheduler may drive either object, and state_dict() is the base's.
    """

    # GradScaler.step(self) then calls self.step() even when it found infs, and hands it
    # self.found_inf (and self.grad_scale if unscale_ was not called): see step().
    _step_supports_amp_scaling = True

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, eta=0.01, **base_kwargs):
        if isinstance(base_optimizer, torch.optim.Optimizer) or not callable(base_optimizer):
            raise TypeError('base_optimizer must be an optimizer class such as torch.optim.AdamW, '
                            'with its arguments passed to SAM: '
                            'SAM(model.parameters(), torch.optim.AdamW, rho=0.05, lr=1e-3)')
        check_group(dict(rho=rho, eta=eta))
        super().__init__(params, dict(rho=rho, adaptive=adaptive, eta=eta))
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        self.param_groups = self.base_optimizer.param_groups  # one set of groups for both objects
        self.state = self.base_optimizer.state
        self.defaults = {**self.base_optimizer.defaults, **self.defaults}
        self.w_old = {}        # param -> buffer holding w while the model sits at w + eps_hat
        self.moved = None      # the params first_step moved; None: no SAM step in progress
        self.set_aside = None  # m-sharpness: param -> sum of g_sam over the groups done so far

    def add_param_group(self, param_group):
        if not hasattr(self, 'base_optimizer'):  # during Optimizer.__init__ (it fills in the defaults)
            super().add_param_group(param_group)
            return check_group(self.param_groups[-1])
        for key in ('rho', 'adaptive', 'eta'):
            param_group.setdefault(key, self.defaults[key])
        check_group(param_group)
        self.base_optimizer.add_param_group(param_group)  # appends to the shared list

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        """w <- w + eps_hat. On an inf/nan gradient (fp16 overflow) w stays and the gradients are
        kept even with zero_grad=True, so that GradScaler sees the overflow and skips the step.
        zero_grad=True therefore leaves .grad = 0 (not None): the choice is made on the device.
        After next_group(), the g_sam set aside is then added back onto .grad."""
        if self.moved is not None:
            raise RuntimeError('SAM.first_step() was called twice: finish the step with '
                               'second_step() (or scaler.step(optimizer)), or call next_group() '
                               'between two m-sharpness groups')
        buckets = {}  # foreach kernels want one device and dtype per list
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    buckets.setdefault((id(group), p.device, p.dtype), (group, []))[1].append(p)
        todo = []  # (group, params, grads, T or None, T*g or g); the norm runs over all groups
        for group, ps in buckets.values():
            gs = [p.grad for p in ps]
            t = torch._foreach_add(torch._foreach_abs(ps), group['eta']) if group['adaptive'] else \
                torch._foreach_abs(ps) if group.get('adaptive_perturbation') else None  # (GSAM's option)
            todo.append((group, ps, gs, t, torch._foreach_mul(t, gs) if group['adaptive'] else gs))
        norm = torch.nn.utils.get_total_norm([x for *_, tg in todo for x in tg])
        finite = norm.isfinite()  # a 0-dim tensor: no host sync, the CPU keeps queueing
        self.moved = []
        for group, ps, gs, t, tg in todo:
            scale = torch.where(finite, self.radius(group) / (norm + 1e-12), 0.0)  # 1e-12 guards g = 0
            if t is not None:
                torch._foreach_mul_(t, tg)  # T^2 g (ASAM) or |w| g (GSAM's), in place of T
            # rho g/||g|| (ASAM: rho T^2 g/||T g||) in one flat buffer, so that on an overflow,
            # where 0 * inf = nan, ONE nan_to_num makes the move exactly 0 and w stays w
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
        """m-sharpness, between two groups: w <- w_old exactly, and .grad (the g_sam summed over the
        groups so far) is set aside, so that the next group's first pass gives its own clean
        gradient; its first_step puts the sum back."""
        if self.moved is None and self.set_aside is None:  # (restore() would name second_step instead)
            raise RuntimeError('SAM.next_group() goes between two m-sharpness groups: after the first_step() '
                               '(and the second backward pass) of one group, before the next group\'s first pass')
        self.restore()
        self.set_aside = {}
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    self.set_aside[p], p.grad = p.grad, None

    def second_step(self, zero_grad=False):
        """w <- w_old (bit-exact), then the base optimizer's step with the current gradient g_sam."""
        self.step()  # through self.step, so that an LR scheduler on SAM sees the step
        if zero_grad:
            self.zero_grad(set_to_none=True)

    def step(self, closure=None):
        """With a closure: the whole two-pass step, returning the first (clean) pass's loss.
        Without one: second_step(), which is what GradScaler.step(optimizer) calls; if the scaler
        found an inf/nan in either pass, w is restored and the base step skipped."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.first_step(zero_grad=True)
            with torch.enable_grad():
                closure()
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

    def radius(self, group):  # rho of this step (GSAM: rho_t)
        return group['rho']

    def restore(self):
        if self.set_aside is not None:
            raise RuntimeError('SAM.next_group() set the SAM gradient aside for a next group: call '
                               'it between groups only, not after the last one')
        if self.moved is None:
            raise RuntimeError('SAM.second_step() / step() without a closure finishes a SAM step: '
                               'call first_step() after the first backward pass, or pass a closure '
                               'to step()')
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
        # the base builds new group dicts on load: share them again, and give a plain
        # base-optimizer checkpoint (no SAM keys) the constructor's rho/adaptive/eta
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state
        for group in self.param_groups:
            for key in ('rho', 'adaptive', 'eta'):
                group.setdefault(key, self.defaults[key])


def check_gsam_group(group):
    """alpha >= 0, 0 <= rho_min <= rho (None: = rho), all finite: a negative rho_min would flip eps_hat in a run."""
    for key in ('alpha', 'rho_min'):
        v = group[key]
        if v is None and key == 'rho_min':
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f'{key} must be a real number, got {type(v).__name__} {v!r}')
        if not (math.isfinite(v) and 0 <= v <= (group['rho'] if key == 'rho_min' else math.inf)):
            raise ValueError(f'{key} must be a finite number >= 0' + ' and <= rho' * (key == 'rho_min') + f', got {v}')


class GSAM(SAM):
    """GSAM(params, base_optimizer, rho=0.05, rho_min=None, alpha=0.0, lr_max=None, lr_min=None,
    minimize_fp=True, adaptive_perturbation=False, adaptive=False, eta=0.01, **base_kwargs).

    Zhuang et al. 2022, "Surrogate Gap Guided Sharpness-Aware Minimization" (ICLR 2022), Algorithm 1, as the
    official code computes it (big_vision trainers/proj/gsam/gsam.py, gsam_gradient; train.py: pmean after it):

        rho_t = rho_min + (rho - rho_min) (lr_t - lr_min) / (lr_max - lr_min)   rho_t = rho if lr_max = lr_min
        g     = grad L(w)                                   clean pass (saved: one flat copy)       first_step()
        w    <- w + rho_t g / (||g|| + 1e-12)               as SAM (or ASAM, or adaptive_perturbation below)
        g_p   = grad L(w + eps)                             perturbed pass; f_p - f = h, the surrogate gap
        minimize_fp=True (the paper):  d = g_p - alpha g_perp,   g_perp = g - <g, g_p>/||g_p||^2 g_p
        minimize_fp=False (big_vision's option): d = g + alpha (g_p - <g, g_p>/||g||^2 g)
        w    <- w_old; base step with d, averaged over replicas AFTER the decomposition     second_step()

    lr_t is the lr of the group at first_step (what the script's schedule set for this step; big_vision PR #8
    fixed passing the schedule's factor instead; its train.py reads the schedule at the 1-based step, optax at the
    0-based count, so its rho_t runs one step ahead of its lr: here both are the lr of the step taken). lr_max,
    lr_min: the range of that schedule; without them rho_min must equal rho (rho_t = rho). rho_min (None: = rho)
    and alpha are per-group settings like rho, the dot products global. alpha = 0 and rho_min = rho is SAM bit
    for bit (tests/test_gsam.py).
    adaptive_perturbation=True is big_vision's w + |w| rho_t g / (||g|| + 1e-12): the norm is of g, the move |w| g;
    ASAM (adaptive=True) instead moves rho T^2 g / ||T g|| with T = |w| + eta. They are exclusive.
    <g, g_p>/||g_p||^2 g_p is the official <g, g_p/||g_p||> g_p/||g_p||, computed so that g_p = g (rho = 0) gives
    g_perp = 0 exactly (both dot products by one kernel), so rho = 0 trains as the base optimizer bit for bit.

    The loop is SAM's, with one more call after the last second pass:

        ... first pass, first_step, second pass (each group: DDP no_sync, sync=False) as SAM, next_group() ...
        optimizer.gsam_gradient(all_reduce=distributed)   # d of the last group + the others; one all-reduce (mean)
        scaler.unscale_(optimizer); clip; scaler.step(optimizer); scaler.update(); zero_grad

    Under DDP every backward runs under no_sync (second_pass(model, sync=False)): each replica decomposes its own
    g_p (big_vision: per device, then pmean), and gsam_gradient(all_reduce=True) averages d over the default
    process group in one all-reduce of a flat buffer. Without DDP, step() (or second_step(), or scaler.step)
    calls gsam_gradient() itself if it was not called; the closure form does so too (under DDP a closure's
    backward all-reduces both passes, so d is then computed from the averaged g and g_p).
    m-sharpness: d_j per group j, from the group's own g_j and g_p,j, then the mean over the k groups: with the
    second loss / k (as SAM) d_j/k = g_p,j/k - alpha (g_j - c_j g_p,j)/k; the second term is kept in a second
    flat buffer (only when k > 1) and divided by k, counted here, at the end. GradScaler: the loss scale cancels
    in c_j, d scales with it; an overflow in either pass makes d non-finite (0 * inf = nan), so the step is
    skipped and w restored as in SAM. Cost over SAM: the flat copy of g, a transient flat copy of g_p, two dot
    products, and (DDP) the explicit all-reduce instead of DDP's bucketed one; no host sync.
    """

    def __init__(self, params, base_optimizer, rho=0.05, rho_min=None, alpha=0.0, lr_max=None, lr_min=None,
                 minimize_fp=True, adaptive_perturbation=False, adaptive=False, eta=0.01, **base_kwargs):
        for name, v in (('lr_max', lr_max), ('lr_min', lr_min)):
            if v is not None and not (isinstance(v, numbers.Real) and math.isfinite(v) and v >= 0):
                raise ValueError(f'{name} must be a finite number >= 0, got {v!r}')
        if (lr_max is None) != (lr_min is None) or (lr_max is not None and lr_max < lr_min):
            raise ValueError(f'lr_max and lr_min go together, lr_max >= lr_min: got {lr_max}, {lr_min}')
        self.lr_max, self.lr_min, self.minimize_fp = lr_max, lr_min, minimize_fp
        self.gsam_defaults = dict(rho_min=rho_min, alpha=alpha, adaptive_perturbation=adaptive_perturbation)
        super().__init__(params, base_optimizer, rho=rho, adaptive=adaptive, eta=eta, **base_kwargs)
        self.defaults.update(self.gsam_defaults)
        for group in self.param_groups:
            self.fill_group(group)
        self.clean = None     # [(group, params, flat g)] from first_step until the decomposition
        self.earlier = None   # m-sharpness: the earlier groups' first terms, set aside as SAM.next_group does
        self.g_flat = {}      # bucket -> flat buffer of g (kept from step to step: allocated once)
        self.r_sum = {}       # bucket -> sum of the groups' second terms (m-sharpness, k > 1)
        self.groups_done = 0  # m-sharpness groups decomposed in this step

    def fill_group(self, group):
        for key, v in self.gsam_defaults.items():
            group.setdefault(key, v)
        check_gsam_group(group)
        if group['adaptive'] and group['adaptive_perturbation']:
            raise ValueError('adaptive (ASAM: T^2 g/||T g||) and adaptive_perturbation (big_vision: |w| g/||g||) '
                             'are two perturbations: choose one')
        if group['rho_min'] not in (None, group['rho']) and self.lr_max is None:
            raise ValueError('rho_min < rho follows the learning rate: pass lr_max and lr_min (the schedule\'s range)')

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if hasattr(self, 'base_optimizer'):  # (during SAM.__init__ the groups are filled in after it)
            self.fill_group(self.param_groups[-1])

    def radius(self, group):
        """rho_t (big_vision: sam_rho), from the lr of this step."""
        rho, rho_min = group['rho'], group['rho_min']
        if rho_min is None or self.lr_max is None or self.lr_max == self.lr_min:
            return rho
        return rho_min + (rho - rho_min) * (group['lr'] - self.lr_min) / (self.lr_max - self.lr_min)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        """Saves g (one flat copy per device and dtype), then SAM's first_step; the d of earlier m-sharpness
        groups stays aside until the decomposition (the second pass must give g_p alone)."""
        if self.moved is not None:
            return super().first_step(zero_grad)  # (raises: a step in progress)
        self.clean = []
        for group in self.param_groups:
            for dev_type in dict.fromkeys((p.device, p.dtype) for p in group['params'] if p.grad is not None):
                ps = [p for p in group['params'] if p.grad is not None and (p.device, p.dtype) == dev_type]
                key = (id(group), *dev_type)
                self.g_flat[key] = torch.cat([p.grad.reshape(-1) for p in ps], out=self.g_flat.get(key))
                self.clean.append((group, ps, key))
        self.earlier, self.set_aside = self.set_aside, None
        super().first_step(zero_grad)

    @torch.no_grad()
    def decompose(self, last, all_reduce=False):
        """.grad <- d of this group (+ the earlier groups'); last: the mean over the k groups, then (all_reduce)
        over the replicas of the default process group, in one all-reduce of a flat buffer."""
        if self.clean is None or self.moved is None:
            raise RuntimeError('GSAM.gsam_gradient() / next_group() follows first_step() and the second pass, once')
        if not self.clean:  # no parameter has a gradient: nothing to decompose
            self.earlier = self.clean = None
            return
        gp = [torch.cat([p.grad.reshape(-1) for p in ps]) for _, ps, _ in self.clean]
        g = [self.g_flat[key] for *_, key in self.clean]
        dev = g[0].device
        dot = lambda a, b: sum(torch.dot(x, y).to(dev) for x, y in zip(a, b))  # noqa: E731 (one kernel each)
        g_gp, base = dot(g, gp), dot(gp, gp) if self.minimize_fp else dot(g, g)
        c = torch.where(base > 0, g_gp / base, 0.0)  # <g, g_p>/||g_p||^2 (0 for g_p = 0: no 0/0)
        for (group, ps, key), gi, gpi in zip(self.clean, g, gp):
            if self.minimize_fp:  # d = g_p - alpha (g - c g_p): gp stays, g -> -alpha g_perp
                gi.addcmul_(gpi, c.to(gi.device), value=-1).mul_(-group['alpha'])
            else:  # d = alpha (g_p - c g) + g: gp -> alpha (g_p)_perp, g stays
                gpi.addcmul_(gi, c.to(gi.device), value=-1).mul_(group['alpha'])
            views = [x.view_as(p) for x, p in zip(gpi.split([p.numel() for p in ps]), ps)]
            if self.earlier is not None:  # the earlier groups' first terms (already / k)
                torch._foreach_add_(views, [self.earlier[p] for p in ps])
            if self.groups_done:
                self.r_sum[key].add_(gi)
            elif not last:  # (a buffer kept from step to step)
                self.r_sum[key] = self.r_sum[key].copy_(gi) if key in self.r_sum and \
                    self.r_sum[key].shape == gi.shape else gi.clone()
            if last:  # the mean over the k groups: the terms of g were not divided by k in the first pass
                gpi.add_(self.r_sum[key] if self.groups_done else gi, alpha=1 / (self.groups_done + 1))
                if all_reduce:  # the mean over the replicas (as DDP: divide, then sum)
                    gpi.div_(torch.distributed.get_world_size())
                    torch.distributed.all_reduce(gpi)
            torch._foreach_copy_([p.grad for p in ps], views)
        self.earlier = self.clean = None

    def next_group(self):
        """m-sharpness, between two groups: this group's d (its share of the mean) onto .grad, then SAM's."""
        self.decompose(last=False)
        super().next_group()
        self.groups_done += 1

    def gsam_gradient(self, all_reduce=False):
        """After the last second pass: .grad <- d, the mean over the groups; all_reduce=True (DDP, every backward
        under no_sync): and over the replicas. Before unscale_/clipping/step."""
        self.decompose(last=True, all_reduce=all_reduce)
        self.groups_done = 0

    def step(self, closure=None):
        if closure is None and self.clean is not None:  # gsam_gradient() was not called: this process alone
            self.gsam_gradient()
        return super().step(closure)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # a SAM checkpoint: the constructor's GSAM settings
            for key, v in self.gsam_defaults.items():
                group.setdefault(key, v)


def first_pass(model):
    """Context for the first forward + backward: model.no_sync() for a DDP model, so each replica
    computes eps_hat from its own sub-batch (m-sharpness) and no all-reduce is spent on a gradient
    used only locally. For any other model it does nothing."""
    no_sync = getattr(model, 'no_sync', None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


@contextlib.contextmanager
def second_pass(model, sync=True):
    """Context for the second forward + backward: train-mode BatchNorm layers still normalise with
    the batch statistics, but running_mean/var and num_batches_tracked are not updated, so they
    come from the clean first pass only. sync=False (every m-sharpness group but the last) adds
    DDP's no_sync, so that the summed g_sam is all-reduced once, on the last group's backward."""
    frozen = [m for m in model.modules()
              if isinstance(m, BATCHNORMS) and m.training and m.track_running_stats]
    for m in frozen:
        m.track_running_stats = False
    try:
        with contextlib.nullcontext() if sync else first_pass(model):
            yield
    finally:
        for m in frozen:
            m.track_running_stats = True
