"""Draw docs/parallelism.png: who holds what, and which collective moves what, in data, model and hybrid
parallelism over 4 processes.

    python docs/make_parallelism_diagram.py
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]  # one per slice of the channels / of the batch


def rank_box(ax, x, y, rank, weights, batch, w=2.3, h=1.5):
    """A process: its rank, the weights it holds (list of (label, colour)) and the samples it sees."""
    ax.add_patch(Rectangle((x, y), w, h, fill=False, lw=1.2))
    ax.text(x + 0.08, y + h - 0.22, f"rank {rank}", fontsize=8, weight="bold")
    for i, (label, color) in enumerate(weights):
        ax.add_patch(Rectangle((x + 0.1 + i * 0.52, y + 0.62), 0.46, 0.42, color=color, alpha=0.85))
        ax.text(x + 0.33 + i * 0.52, y + 0.83, label, fontsize=6.5, ha="center", va="center", color="white")
    ax.text(x + 0.1, y + 0.22, batch, fontsize=7)


def arrow(ax, a, b, text="", color="black", at=None):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="<->", mutation_scale=9, lw=1.2, color=color))
    if text:
        ax.text(*(at or ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.12)), text, fontsize=7, ha="center", color=color)


def main():
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.6))
    whole = [(f"W{i}", COLORS[i]) for i in range(4)]
    titles = ("data parallel (--parallel data)", "model parallel (--parallel model)",
              "hybrid 2x2 (--parallel hybrid --model_parallel_size 2)")
    for ax, title in zip(axes, titles):
        ax.set_xlim(0, 6)
        ax.set_ylim(-1.1, 4.6)
        ax.axis("off")
        ax.set_title(title, fontsize=9.5)
    # data: every rank the whole model, a quarter of the batch; gradients summed once per step
    ax = axes[0]
    for r, (x, y) in enumerate(((0.4, 2.4), (3.3, 2.4), (0.4, 0.3), (3.3, 0.3))):
        rank_box(ax, x, y, r, whole, f"samples {r}/4 of the batch")
    ax.text(3.0, 2.1, "allreduce of every gradient (reducers:\nblocking, per_layer, bucketed), overlapped\n"
            "with backward", fontsize=7, ha="center", va="center", color="#444")
    ax.text(3.0, -0.75, "holds: all weights, gradients, optimizer state\nsends per step: the gradients (2x their size, ring)",
            fontsize=7.5, ha="center")
    # model: every rank a quarter of each layer's output channels, the whole batch
    ax = axes[1]
    for r, (x, y) in enumerate(((0.4, 2.4), (3.3, 2.4), (0.4, 0.3), (3.3, 0.3))):
        rank_box(ax, x, y, r, [whole[r]], "the whole batch")
    arrow(ax, (2.7, 3.1), (3.3, 3.1), "all four ranks: allgather / reduce-scatter", "black", at=(3.0, 4.05))
    arrow(ax, (2.7, 1.0), (3.3, 1.0), "", "black")
    ax.text(3.0, 2.1, "forward: allgather of each split output where a\nwhole tensor is needed (next Conv2D/Dense, Flatten,"
            "\nblocks); backward: reduce-scatter (or allreduce) of dx", fontsize=7, ha="center", va="center",
            color="#444")
    ax.text(3.0, -0.75, "holds: 1/4 of every Conv2D/Dense/BatchNorm (output channels)\n"
            "sends per step: activations and their gradients", fontsize=7.5, ha="center")
    # hybrid: two groups of two
    ax = axes[2]
    for r, (x, y) in enumerate(((0.4, 2.4), (3.3, 2.4), (0.4, 0.3), (3.3, 0.3))):
        half = [whole[0], whole[1]] if r % 2 == 0 else [whole[2], whole[3]]
        rank_box(ax, x, y, r, half, f"samples {r // 2}/2 of the batch")
    arrow(ax, (2.7, 3.1), (3.3, 3.1), "rows: model groups {0, 1} and {2, 3}, activations", "black", at=(3.0, 4.05))
    arrow(ax, (2.7, 1.0), (3.3, 1.0), "", "black")
    arrow(ax, (1.55, 2.4), (1.55, 1.8), "", COLORS[2])
    arrow(ax, (4.45, 2.4), (4.45, 1.8), "", COLORS[2])
    ax.text(3.0, 2.1, "columns: replicas of the same slices;\ngradients allreduced across them (data parallel)",
            fontsize=7, ha="center", va="center", color=COLORS[2])
    ax.text(3.0, -0.75, "groups = consecutive ranks (one node); replicas across nodes\n"
            "holds: 1/2 of every layer; sends: activations in a group, gradients across", fontsize=7.5, ha="center")
    fig.text(0.5, 0.02, "W0-W3: a quarter of the output channels of every Conv2D and Dense (and of the BatchNorm "
             "after it); four of them: the whole model", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out = os.path.join(HERE, "parallelism.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
