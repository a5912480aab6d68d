"""The figures of geometry.py and robustness.py, drawn with matplotlib (imported only when a figure is drawn) and
written atomically. Each takes the numbers a script computed and a path; none computes anything of its own."""
import numpy as np
import torch
import torch.nn.functional as F

import matfree
from runs import save_atomic
from utils import EXTRAS, UserError


def pyplot(hint=''):  # matplotlib's pyplot (Agg), or a UserError saying how to install it
    try:
        import matplotlib
    except ImportError:
        raise UserError(f'plots need matplotlib; {EXTRAS}{hint}') from None
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi=110):
    save_atomic(path, lambda f: fig.savefig(f, format='png', dpi=dpi, bbox_inches='tight'))
    pyplot().close(fig)


# ----------------------------------------------------------------------------- geometry.py
def landscape(name, coords, losses, out_dir):
    """1-D: the loss along the direction (landscape_curve.png); 2-D: contours and the surface (paper Fig. 1)."""
    fig, ax = pyplot().subplots(figsize=(4, 3) if losses.dim() == 1 else (4, 3.5))
    if losses.dim() == 1:
        ax.plot(coords.numpy(), losses.numpy())
        ax.set(xlabel='alpha', ylabel='training loss', title=name)
        return save_figure(fig, f'{out_dir}/landscape_curve.png')
    ax.clabel(ax.contour(coords.numpy(), coords.numpy(), losses.T.numpy(), levels=20), fontsize=6)  # [a, b]: a on x
    ax.set(xlabel='direction 1', ylabel='direction 2', title=f'{name}: training loss')
    save_figure(fig, f'{out_dir}/landscape_contour.png')
    save_figure(surfaces([(name, coords, losses)]), f'{out_dir}/landscape_surface.png')


def surfaces(panels):
    """3-D surfaces side by side, one per (title, coords, losses), on one z scale (paper Fig. 1)."""
    plt = pyplot()
    fig, top = plt.figure(figsize=(4.2 * len(panels), 3.6)), max(l.max().item() for _, _, l in panels)
    for i, (title, coords, losses) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1, projection='3d')
        a, b = torch.meshgrid(coords, coords, indexing='ij')
        ax.plot_surface(a.numpy(), b.numpy(), losses.numpy(), cmap='viridis', linewidth=0)
        ax.set(zlim=(0, top), title=title, zlabel='training loss')
    return fig


def attention_distances(panels, img_size):
    """Mean attention distance of every head against depth (ViT paper Fig. 7), one panel per (title, dist)."""
    fig, axes = pyplot().subplots(1, len(panels), figsize=(3.6 * len(panels), 3), squeeze=False, sharey=True)
    for ax, (title, dist) in zip(axes[0], panels):
        layers = torch.arange(1, dist.shape[0] + 1)[:, None].expand_as(dist)
        ax.scatter(layers.flatten().numpy(), dist.flatten().numpy(), s=12)
        ax.set(xlabel='network depth (layer)', title=title, ylim=(0, img_size), xticks=layers[:, 0].tolist())
    axes[0, 0].set_ylabel('mean attention distance (px)')
    return fig


def attention_maps(shown, last, rollout, path):
    """Per image (rows): the image, the class token's last-layer attention, the rollout, upsampled onto it."""
    k = len(shown)
    fig, axes = pyplot().subplots(k, 3, figsize=(6, 2 * k), squeeze=False)
    for i, maps in enumerate(zip([None] * k, last, rollout)):
        for j, (title, m) in enumerate(zip(('image', 'class token, last layer', 'rollout'), maps)):
            axes[i, j].imshow(shown[i].permute(1, 2, 0).numpy())
            if m is not None:  # the patch grid upsampled onto the image
                up = F.interpolate(m[None, None], size=shown.shape[-2:], mode='nearest')[0, 0]
                axes[i, j].imshow((up / up.max()).numpy(), cmap='jet', alpha=0.5)
            axes[i, j].set_axis_off()
            axes[i, j].set_title(title if i == 0 else '', fontsize=8)
    save_figure(fig, path)


# ----------------------------------------------------------------------------- robustness.py
def heatmap(r, path, hint=''):
    """Accuracy per corruption (rows) and severity (columns) of one robustness.py result."""
    plt = pyplot(hint)
    sev, grid = list(next(iter(r['acc'].values()))), np.array([list(per.values()) for per in r['acc'].values()])
    fig, ax = plt.subplots(figsize=(1.1 * len(sev) + 3.5, 0.32 * len(grid) + 1.6))
    im = ax.imshow(grid, cmap='viridis', vmin=0, vmax=100, aspect='auto')
    for (i, j), a in np.ndenumerate(grid):
        ax.text(j, i, f'{a:.1f}', ha='center', va='center', fontsize=7, color='w' if a < 60 else 'k')
    ax.set_xticks(range(len(sev)), [f'severity {s}' for s in sev], fontsize=8)
    ax.set_yticks(range(len(grid)), list(r['acc']), fontsize=8)
    ax.set_title(f'{r["model"]}, {r["benchmark"]} on {r["dataset"]}: mean {r["mean_acc"]:.1f}%, '
                 f'clean {r["clean"]["acc"]:.1f}%', fontsize=9)
    fig.colorbar(im, ax=ax, label='top-1 accuracy (%)')
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def corruption_bars(runs, labels, title, path, hint=''):
    """Grouped bars: each run's mean accuracy per corruption, then its mean over all cells, then clean."""
    plt = pyplot(hint)
    keys = [c for c in runs[0]['corruption_mean'] if all(c in r['corruption_mean'] for r in runs)]
    fig, ax = plt.subplots(figsize=(0.3 * (len(keys) + 2) * len(runs) + 2.5, 4))
    for j, (r, label) in enumerate(zip(runs, labels)):
        values = [r['corruption_mean'][c] for c in keys] + [r['mean_acc'], r['clean']['acc']]
        width = 0.8 / len(runs)
        ax.bar(np.arange(len(values)) + (j - (len(runs) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(range(len(keys) + 2), keys + ['mean', 'clean'], rotation=60, ha='right', fontsize=8)
    ax.set(ylabel='top-1 accuracy (%), mean over severities', title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def spectral_density(runs, path, bins=400):
    """geometry.py hessian --density: the SLQ quadrature of each run [(nodes, weights)], averaged, each node a
    Gaussian of std 1/200 of the range (matfree.density_curve; PyHessian smooths the same way); log density."""
    nodes, weights = torch.cat([n for n, _ in runs]).double(), torch.cat([w for _, w in runs]).double() / len(runs)
    lo, hi = nodes.min().item(), nodes.max().item()
    pad = 0.05 * (hi - lo) + 1e-12
    grid = torch.linspace(lo - pad, hi + pad, bins, dtype=torch.float64)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.semilogy(grid, matfree.density_curve(nodes, weights, grid, (hi - lo) / 200 + 1e-12).clamp_min(1e-12))
    ax.set(xlabel='eigenvalue', ylabel='density (log)', title='Hessian spectral density (SLQ)')
    save_figure(fig, path)
