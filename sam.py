"""Sharpness-Aware Minimization (SAM) and adaptive SAM (ASAM) around any torch.optim optimizer.

SAM is the optimizer with which Chen, Hsieh & Gong 2021 train ViTs and MLP-Mixers from scratch.

Foret, Kleiner, Mobahi & Neyshabur 2020, "Sharpness-Aware Minimization for Efficiently Improving
Generalization" (ICLR 2021), Algorithm 1. One step on a mini-batch S, with w all parameters:

    g      = grad L_S(w)                      first forward/backward, at w           (Alg. 1)
    eps    = rho * g / ||g||_2                eq. (2) with p = 2; ONE norm over all   first_step()
                                              parameters together; w <- w + eps
    g_sam  = grad L_S(w) at w + eps           second forward/backward; the Hessian    (Sec. 2, Alg. 1)
                                              term of the exact gradient is dropped
    w      <- base_step(w_old, g_sam)         w is put back exactly (a saved copy),    second_step()
                                              then the base optimizer (SGD, AdamW...)
                                              steps with g_sam

ASAM (Kwon, Kim, Park & Choi 2021, "ASAM: Adaptive Sharpness-Aware Minimization for Scale-Invariant
Learning of Deep Neural Networks", Sec. 4 / Algorithm 1) is adaptive=True:

    T      = |w| + eta                        elementwise normalisation operator, eta = 0.01 in the
                                              official code (davda54/sam uses eta = 0)
    eps    = rho * T^2 g / ||T g||_2          one norm over all parameters again

Deviation: the official ASAM code applies T only to parameters whose name contains 'weight' (biases
get T = 1). An optimizer does not see names, so here every parameter of an adaptive group gets T.
rho, adaptive and eta are per-param-group settings while the norm stays global, so putting the
biases in a group with adaptive=False matches the official code. The small 1e-12 added to
the norm (as in davda54/sam) only guards g = 0.

Using it, with k micro-batches per pass (k = 1 without accumulation). `scaler` may be a disabled
GradScaler (fp32 / bf16) and `model` may be DDP-wrapped:

    optimizer = SAM(model.parameters(), torch.optim.AdamW, rho=0.05, lr=1e-3, weight_decay=0.05)
    with first_pass(model):                       # DDP: no_sync -> every replica has its own eps
        for xb, yb in micro:
            scaler.scale(loss_fn(model(xb), yb) / k).backward()
    optimizer.first_step(zero_grad=True)          # w <- w + eps
    with second_pass(model):                      # BatchNorm running stats frozen
        for j, (xb, yb) in enumerate(micro):
            with model.no_sync() if is_ddp and j < k - 1 else contextlib.nullcontext():
                scaler.scale(loss_fn(model(xb), yb) / k).backward()   # all-reduced on the last one
    scaler.unscale_(optimizer)                    # optional: clip the SECOND gradient
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)                        # == optimizer.second_step(): w <- w_old, base step
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

Without a scaler call optimizer.second_step(zero_grad=True) at the end. optimizer.step(closure), with a
closure that zeroes the gradients, computes the loss, calls backward() and returns the loss, runs
both passes itself. (davda54/sam expects the first backward done before step(closure). If you do
that here the first closure call adds to it and eps sees 2g, the same direction. So that loop still
works, at the cost of one extra pass.)

Why each piece is where it is:

* Gradient accumulation. Both passes accumulate into .grad as usual. The first pass sums the k
  micro-batch gradients before first_step, so eps comes from the gradient of the whole batch. The
  second pass sums g_sam over the same k micro-batches at the one perturbed point. Dividing each
  loss by k makes the result equal one pass over the concatenated batch (without BatchNorm, whose
  batch statistics depend on the micro-batch size).
* DDP and m-sharpness (Foret et al. Sec. 4.1). The official JAX SAM code computes eps on each
  device from that device's own sub-batch: the first gradient is never all-reduced. That is
  m-sharpness with m = the per-device batch. Only g_sam is averaged, so every replica takes the
  same step. Under DDP that means running the first forward AND backward in model.no_sync(), which
  is all that first_pass(model) does. first_step uses only the local norm (no collective). Each
  replica saves and restores its own w, so replicas stay bit-identical.
* BatchNorm. The running statistics come from the clean first pass only. second_pass(model) makes
  the train-mode BatchNorm layers use batch statistics without updating running_mean/running_var/
  num_batches_tracked.
* Mixed precision. eps is invariant to the loss scale: rho*(s g)/||s g|| = rho*g/||g|| (and the same
  for ASAM), so the first pass may be scaled and is never unscaled. bf16 autocast needs no scaler.
  For fp16 with torch.amp.GradScaler:
    - If the first gradient has an inf/nan, first_step does not move w. It also keeps the bad
      gradients (even with zero_grad=True), so the second backward adds onto them and they stay
      non-finite. GradScaler then skips the step and lowers the scale. Under DDP the kept inf
      reaches every replica through the second-pass all-reduce, so all replicas skip together.
    - SAM sets _step_supports_amp_scaling, so scaler.step(optimizer) always calls SAM.step and
      hands it found_inf (and grad_scale if unscale_ was not called). SAM.step restores w first
      and only then skips the base step when found_inf is set. A perturbed w is never left behind,
      which would happen with a plain optimizer, whose step() GradScaler simply does not call.
  One host sync per step reads the norm (one per device and dtype among the parameters); with an
  enabled GradScaler, SAM.step reads found_inf (one more).
* Clipping. Clip the second gradient, after scaler.unscale_ and before scaler.step / second_step.
  Clipping the first gradient does nothing: it rescales g and eps = rho*g/||g|| ignores the scale
  (for ASAM too).
* Weight decay. Decoupled, in the base optimizer (e.g. AdamW's weight_decay). It is not part of g
  and so not part of eps. The official JAX SAM code instead adds an L2 term on w to the loss (the
  lambda*||w||^2 of Foret et al. eq. (1)), so there the decay term is in the first gradient and
  in eps too. To reproduce that, set the base weight_decay to 0 and add the L2 term to the loss.
* Cost. Two forward/backward passes, plus a few foreach kernels over the parameters (norm, one copy
  of w, w += eps, copy back). Memory: one extra copy of the parameters, plus two temporaries for ASAM.

Self-contained: imports only torch.
"""
import contextlib
import math

import torch


class SAM(torch.optim.Optimizer):
    """SAM(params, base_optimizer, rho=0.05, adaptive=False, eta=0.01, **base_kwargs).

    base_optimizer is an optimizer CLASS (e.g. torch.optim.AdamW), built here with base_kwargs on the
    same param groups: self.param_groups IS self.base_optimizer.param_groups and self.state IS
    self.base_optimizer.state, so an LR scheduler may drive either object. rho, adaptive and eta
    are per-group options. state_dict() is the base optimizer's (its groups carry rho/adaptive/eta).
    """

    # GradScaler.step(self) then calls self.step() even when it found infs, handing over
    # self.found_inf (and self.grad_scale when the grads are still scaled); see step().
    _step_supports_amp_scaling = True

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, eta=0.01, **base_kwargs):
        if isinstance(base_optimizer, torch.optim.Optimizer) or not callable(base_optimizer):
            raise TypeError('base_optimizer must be an optimizer class such as torch.optim.AdamW, '
                            'with its arguments passed to SAM: '
                            'SAM(model.parameters(), torch.optim.AdamW, rho=0.05, lr=1e-3)')
        if not rho >= 0.0:
            raise ValueError(f'rho must be >= 0, got {rho}')
        if not eta >= 0.0:
            raise ValueError(f'eta must be >= 0, got {eta}')
        super().__init__(params, dict(rho=rho, adaptive=adaptive, eta=eta))
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        # One set of group dicts and one state for both objects (schedulers, checkpoints).
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state
        self.defaults = {**self.base_optimizer.defaults, **self.defaults}
        self._w_old = {}   # param -> buffer holding w while the model sits at w + eps
        self._moved = None  # params first_step moved; None = no SAM step in progress

    def add_param_group(self, param_group):
        if not hasattr(self, 'base_optimizer'):  # Optimizer.__init__, before the base exists
            return super().add_param_group(param_group)
        self.base_optimizer.add_param_group(self._sam_keys(param_group))  # appends to the shared list

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        """w <- w + eps (Alg. 1; eq. (2), or ASAM's eps). Params whose grad is None are skipped.

        If any gradient is inf/nan (fp16 overflow), w is not moved and the gradients are kept even
        with zero_grad=True, so that GradScaler sees the overflow after the second pass and skips.
        """
        if self._moved is not None:
            raise RuntimeError('SAM.first_step() was called twice: finish the step with '
                               'second_step() (or scaler.step(optimizer)) before the next one')
        groups, norm_terms = [], []
        for group in self.param_groups:
            params = [p for p in group['params'] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group['adaptive']:
                t = torch._foreach_abs(params)
                torch._foreach_add_(t, group['eta'])        # T = |w| + eta
                direction = torch._foreach_mul(t, grads)      # T g: its norm is the denominator
            else:
                t, direction = None, grads                    # g
            norm_terms += direction
            groups.append((group, params, t, direction))

        norm = _global_norm(norm_terms)  # ||g|| or ||T g|| over all parameters; a host sync
        if not math.isfinite(norm):      # fp16 overflow: keep w and the non-finite grads
            self._moved = []
            return

        moved = []
        for group, params, t, direction in groups:
            torch._foreach_copy_(self._buffers(params), params)   # save w for an exact restore
            if t is not None:
                torch._foreach_mul_(direction, t)                  # T^2 g
            # w <- w + rho/||.|| * direction, fused per tensor (no temporaries)
            torch._foreach_add_(params, direction, alpha=group['rho'] / (norm + 1e-12))
            moved += params
        self._moved = moved
        if zero_grad:
            self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        """w <- w_old (bit-exact), then base_optimizer.step() with the current (second) gradient."""
        self._restore()
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad(set_to_none=True)

    def step(self, closure=None):
        """step(closure): the whole two-pass SAM step; returns the first (clean) pass's loss.

        step() without a closure is second_step(). That is what GradScaler.step(optimizer) calls.
        An enabled GradScaler also sets self.found_inf (and self.grad_scale when unscale_ was not
        called) because of _step_supports_amp_scaling. Then w is restored first, and the base step
        is skipped on overflow, so the weights stay exactly as before the SAM step.
        """
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.first_step(zero_grad=True)
            with torch.enable_grad():
                closure()
            self.second_step()
            return loss

        found_inf = getattr(self, 'found_inf', None)  # set only by an enabled GradScaler
        with torch.no_grad():
            if found_inf is not None and float(found_inf) > 0:  # overflow in either pass: restore w,
                self._restore()                                 # skip; GradScaler lowers the scale
                return None
            grad_scale = getattr(self, 'grad_scale', None)
            if grad_scale is not None:  # user did not call scaler.unscale_: unscale like it does
                self._unscale(grad_scale)
        self.second_step()
        return None

    def state_dict(self):
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.base_optimizer.load_state_dict(state_dict)
        # The base builds new group dicts on load: share them again. A plain base-optimizer
        # checkpoint has no SAM keys, so fill them from the constructor's values.
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state
        for group in self.param_groups:
            self._sam_keys(group)

    # --- helpers -------------------------------------------------------------------------------
    def _sam_keys(self, group):
        """Fill in rho, adaptive and eta the group does not set, from the constructor's values."""
        for key in ('rho', 'adaptive', 'eta'):
            group.setdefault(key, self.defaults[key])
        return group

    def _buffers(self, params):
        """Persistent buffers for w (allocated once; re-made if a param changed shape/device)."""
        bufs = []
        for p in params:
            b = self._w_old.get(p)
            if b is None or b.shape != p.shape or b.dtype != p.dtype or b.device != p.device:
                b = self._w_old[p] = torch.empty_like(p, memory_format=torch.preserve_format)
            bufs.append(b)
        return bufs

    def _restore(self):
        if self._moved is None:
            raise RuntimeError('SAM.second_step() / step() without a closure finishes a SAM step: '
                               'call first_step() after the first backward pass, or pass a closure '
                               'to step()')
        if self._moved:
            torch._foreach_copy_(self._moved, [self._w_old[p] for p in self._moved])
        self._moved = None

    def _unscale(self, grad_scale):
        inv_scale = grad_scale.double().reciprocal().float()  # as GradScaler.unscale_ does
        by_device = {}
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, inv_scale.to(device))


def _global_norm(tensors):
    """||concat(tensors)||_2 as a Python float: one foreach reduction per (device, dtype) group.

    fp16/bf16 tensors are reduced in fp32 (an fp16 norm overflows past 65504).
    """
    by_kind = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    norms = []
    for (_, dtype), ts in by_kind.items():
        acc = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        norms.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts, 2, dtype=acc))))
    return math.hypot(*(n.item() for n in norms))  # inf/nan propagate


def first_pass(model):
    """Context for the first forward+backward. A DDP model runs it in model.no_sync().

    Then each replica's eps comes from its own sub-batch (m-sharpness, Foret et al. Sec. 4.1, as in
    the official JAX code), and no all-reduce is spent on a gradient that is only used locally.
    For any other model it does nothing.
    """
    no_sync = getattr(model, 'no_sync', None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


@contextlib.contextmanager
def second_pass(model):
    """Context for the second forward (+backward): BatchNorm running statistics are left untouched.

    Train-mode BatchNorm layers (incl. SyncBatchNorm) still normalise with the batch statistics,
    exactly as in the first pass. Only running_mean/running_var/num_batches_tracked are not
    updated (track_running_stats is switched off inside the block), so they come from the clean
    first pass only. Eval-mode layers are unaffected.
    """
    frozen = [m for m in model.modules()
              if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
              and m.training and m.track_running_stats]
    for m in frozen:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in frozen:
            m.track_running_stats = True
