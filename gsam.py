"""GSAM: Zhuang et al. 2022, "Surrogate Gap Guided Sharpness-Aware Minimization" (ICLR 2022), Algorithm 1, as the
official code computes it (big_vision trainers/proj/gsam/gsam.py, gsam_gradient; train.py: pmean after it). SAM
(sam.py) with rho following the learning rate and the update g_p - alpha g_perp:

    rho_t  = rho_min + (rho - rho_min) (lr_t - lr_min) / (lr_max - lr_min), in [rho_min, rho]   first_step()
    g      = grad L(w)                                   clean pass (saved: one flat copy)
    w     <- w + rho_t g / (||g|| + 1e-12)               as SAM (or ASAM, or adaptive_perturbation below)
    g_p    = grad L(w + eps)                             perturbed pass; f_p - f = h, the surrogate gap
    g_perp = g - <g, g_p>/||g_p||^2 g_p                  (g_p = 0: g_perp = g, not 0/0)
    d      = g_p - alpha g_perp                          minimize_fp=True (the paper)       gsam_gradient()
             g + alpha (g_p - <g, g_p>/||g||^2 g)        minimize_fp=False (big_vision's option)
    w     <- w_old; base step with d, averaged over replicas AFTER the decomposition        step()

The loop is SAM's with one more call, right after the last second backward pass:

    with first_pass(model):
        scaler.scale(loss_fn(model(x), y)).backward()
    optimizer.first_step(zero_grad=True)               # saves g; w <- w + rho_t g / ||g||
    with second_pass(model, sync=False):               # DDP: each replica decomposes its own g_p
        scaler.scale(loss_fn(model(x), y)).backward()
    optimizer.gsam_gradient(all_reduce=torch.distributed.is_initialized())   # .grad <- d (DDP: the mean)
    scaler.unscale_(optimizer)                         # unscales d
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)    # clips d, as big_vision (after the pmean)
    scaler.step(optimizer); scaler.update(); optimizer.zero_grad(set_to_none=True)

or loss = optimizer.step(closure, model=model). gsam_gradient() goes BEFORE unscale_ and clipping: g and g_p then
carry the same loss scale (it cancels in <g, g_p>/||g_p||^2; d carries it, for unscale_), and clipping bounds d.
A step without it (SAM's loop unchanged: unscale_, clip, scaler.step) is refused, with w restored: it would mix
a scaled g with an unscaled g_p (a step ~S times too long) and clip g_p, not d. m-sharpness: SAM's group loop
with sync=False throughout; each group decomposes its own g_p, then the mean. lr_t is the group's lr at
first_step; lr_max, lr_min: the schedule's range (without them rho_min must equal rho). alpha = 0 and rho_min =
rho is SAM bit for bit; rho = 0 the base optimizer. No host sync. Imports only torch and sam.py.
"""
import torch

from sam import SAM, check_bool, check_number


class GSAM(SAM):
    """GSAM(params, base_optimizer, rho=0.05, rho_min=None, alpha=0.0, lr_max=None, lr_min=None, minimize_fp=True,
    adaptive_perturbation=False, adaptive=False, eta=0.01, **base_kwargs).

    rho is rho_max; rho_min (None: = rho), alpha and adaptive_perturbation are per-group settings like rho, the dot
    products global. adaptive_perturbation=True is big_vision's w + |w| rho_t g/(||g|| + 1e-12) (the norm of g, the
    move |w| g); ASAM (adaptive=True) moves rho T^2 g/||T g||, T = |w| + eta: choose one. rho_t outside [rho_min,
    rho] (an lr below lr_min in a warm-up, or above lr_max) is clamped: big_vision's formula would go on linearly,
    below lr_min to a negative radius where rho_min = 0 (w moved down the gradient, the opposite of SAM's ascent).
    """

    def __init__(self, params, base_optimizer, rho=0.05, rho_min=None, alpha=0.0, lr_max=None, lr_min=None,
                 minimize_fp=True, adaptive_perturbation=False, adaptive=False, eta=0.01, **base_kwargs):
        for name, v in (('lr_max', lr_max), ('lr_min', lr_min)):
            if v is not None:
                check_number(name, v)
        if (lr_max is None) != (lr_min is None) or (lr_max is not None and lr_max < lr_min):
            raise ValueError(f'lr_max and lr_min go together, lr_max >= lr_min: got {lr_max}, {lr_min}')
        check_bool('minimize_fp', minimize_fp)
        self.lr_max, self.lr_min, self.minimize_fp = lr_max, lr_min, minimize_fp
        self.extra_defaults = dict(rho_min=rho_min, alpha=alpha, adaptive_perturbation=adaptive_perturbation)
        super().__init__(params, base_optimizer, rho=rho, adaptive=adaptive, eta=eta, **base_kwargs)
        self.clean = None     # [(group, params, key of the flat g)] from first_step until the decomposition
        self.earlier = None   # m-sharpness: the earlier groups' first terms, set aside as SAM.next_group does
        self.g_flat = {}      # key -> flat buffer of g (kept from step to step: allocated once)
        self.r_sum = {}       # key -> sum of the groups' second terms (m-sharpness, k > 1)
        self.groups_done = 0  # m-sharpness groups decomposed in this step

    def check_group(self, group):
        """SAM's checks; alpha >= 0; 0 <= rho_min <= rho (a negative rho_min would flip eps_hat in a run)."""
        super().check_group(group)
        check_number('alpha', group['alpha'])
        if group['rho_min'] is not None:
            check_number('rho_min', group['rho_min'], group['rho'], 'rho')
        check_bool('adaptive_perturbation', group['adaptive_perturbation'])
        if group['adaptive'] and group['adaptive_perturbation']:
            raise ValueError('adaptive (ASAM: T^2 g/||T g||) and adaptive_perturbation (big_vision: |w| g/||g||) '
                             'are two perturbations: choose one')
        if group['rho_min'] not in (None, group['rho']) and self.lr_max is None:
            raise ValueError('rho_min < rho follows the learning rate: pass lr_max and lr_min (the schedule\'s range)')

    def radius(self, group):
        """rho_t (big_vision: sam_rho) from the lr of this step, clamped to [rho_min, rho]."""
        rho, rho_min = group['rho'], group['rho_min']
        if rho_min is None or self.lr_max == self.lr_min:
            return rho
        return min(max(rho_min + (rho - rho_min) * (group['lr'] - self.lr_min) / (self.lr_max - self.lr_min),
                       rho_min), rho)

    def weights(self, group, params):
        return torch._foreach_abs(params) if group['adaptive_perturbation'] else super().weights(group, params)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        """Saves g (one flat copy per group, device and dtype), then SAM's first_step; the d of earlier m-sharpness
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
        """Right after the last second backward pass, before unscale_, clipping and step: .grad <- d, the mean over
        the groups; all_reduce=True (DDP, every backward under no_sync): and over the replicas."""
        check_bool('all_reduce', all_reduce)
        self.decompose(last=True, all_reduce=all_reduce)
        self.groups_done = 0

    def step(self, closure=None, model=None):
        """With a closure and the model: both passes (the second under no_sync too), gsam_gradient() (DDP: the
        mean), the step. Without: the step, after gsam_gradient()."""
        if closure is not None:
            loss = self.both_passes(closure, model, sync=False)
            self.gsam_gradient(all_reduce=isinstance(model, torch.nn.parallel.DistributedDataParallel))
            super().step()
            return loss
        if self.clean is not None:  # refused, and the step abandoned: w back, the optimizer ready for the next
            with torch.no_grad():
                self.restore()
            self.clean = self.earlier = None
            self.groups_done = 0
            for name in ('found_inf', 'grad_scale'):  # (scaler.step deletes them only when step() returns)
                self.__dict__.pop(name, None)
            raise RuntimeError('GSAM: call optimizer.gsam_gradient() right after the last second backward pass, '
                               'before scaler.unscale_, clipping and step (gsam.py): it turns g_p into the update d')
        return super().step()
