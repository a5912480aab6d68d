"""Evaluation of a frozen backbone (train_contrastive.py), exact under torchrun: rank r embeds images
[n*r/W, n*(r+1)/W) (no padding, no duplicates), the training features gathered whole onto every rank; then DINO's
weighted k-NN (Caron et al. 2021, eval_knn.py) or a linear probe (MoCo v3's main_lincls.py objective and init,
solved full-batch by L-BFGS). args: the script's flags (eval_batch_size, linear_epochs, linear_wd, seed)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from augment import normalize
from images import decoded_images


@torch.no_grad()
def features(backbone, images, lo, hi, args, autocast, mean, std):
    backbone.eval()
    if isinstance(images, torch.Tensor):
        batches = (images[s:min(s + args.eval_batch_size, hi)] for s in range(lo, hi, args.eval_batch_size))
    else:  # load_data's loader of rows lo..hi-1; an unreadable image is named (images.check_decoded)
        batches = (decoded_images(batch, images.dataset) for batch in images)
    out = [torch.zeros(0, backbone.pos_embed.shape[-1], device=mean.device)]
    for x in batches:
        with autocast:
            out.append(backbone(normalize(x.to(mean.device, non_blocking=True), mean, std)).float())
    backbone.train()
    return torch.cat(out)


def gather_rows(t, n, world):
    """The row blocks [n*r//W, n*(r+1)//W) of all ranks, in order (padded for all_gather, then trimmed)."""
    if world == 1:
        return t
    sizes = [n * (r + 1) // world - n * r // world for r in range(world)]
    buf = [t.new_empty(max(sizes), *t.shape[1:]) for _ in sizes]
    dist.all_gather(buf, torch.cat([t, t.new_zeros(max(sizes) - len(t), *t.shape[1:])]))
    return torch.cat([b[:s] for b, s in zip(buf, sizes)])


def knn_scores(train_f, train_y, test_f, classes, k, T):
    """Weighted k-NN (Wu et al. 2018; DINO eval_knn.py): the k most cosine-similar training features vote
    for their labels with weight exp(cos / T), computed as exp((cos - max cos) / T): DINO's exp(cos / T) overflows
    float32 below T ~0.011. Returns (n_test, classes) vote shares."""
    train_f, test_f = F.normalize(train_f, dim=1), F.normalize(test_f, dim=1)
    chunk, out = max(1, 2 ** 25 // max(len(train_f), 1)), [torch.zeros(0, classes, device=test_f.device)]
    for s in range(0, len(test_f), chunk):  # similarity blocks of <= 128 MB
        sim, idx = (test_f[s:s + chunk] @ train_f.T).topk(min(k, len(train_f)), dim=1)  # (sorted: the max first)
        weight = ((sim - sim[:, :1]) / T).exp()  # exp(cos / T) over its row's largest: the same shares, and no
        votes = torch.zeros(len(sim), classes, device=sim.device).scatter_add_(1, train_y[idx], weight)  # overflow
        out.append(votes / votes.sum(1, keepdim=True))
    return torch.cat(out)


def linear_probe(train_f, train_y, classes, args):
    """A linear classifier on frozen features standardised with the training mean/std (the MAE probe's
    affine-free BN), main_lincls.py's init N(0, 0.01), trained on all the cached unaugmented features at once by
    L-BFGS (strong Wolfe line search) for --linear-epochs iterations: the objective main_lincls.py's SGD (batch
    256, 100 epochs: ~500k tiny steps on ImageNet) descends, in ~100 full-batch steps (deviation: no SGD noise or
    schedule; README, Performance, compares the two). Deterministic given the seed. -> (classifier, mu, sd)"""
    mu, sd = train_f.mean(0), train_f.std(0) + 1e-6
    z = (train_f - mu) / sd  # (n, D): on ImageNet-1k with ViT-B, 3.9 GB in float32, and logits of 5.1 GB
    g = torch.Generator(train_f.device).manual_seed(args.seed)
    clf = nn.Linear(train_f.shape[1], classes).to(train_f.device)
    nn.init.normal_(clf.weight, std=0.01, generator=g)
    nn.init.zeros_(clf.bias)
    opt = torch.optim.LBFGS(clf.parameters(), max_iter=args.linear_epochs, history_size=20,
                            tolerance_grad=1e-9, tolerance_change=1e-12, line_search_fn='strong_wolfe')

    def closure():  # the whole objective (L-BFGS reads it on the host: one sync per evaluation)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(clf(z), train_y) + args.linear_wd / 2 * clf.weight.pow(2).sum()
        loss.backward()
        return loss
    with torch.enable_grad():
        opt.step(closure)
    return clf, mu, sd
