"""A prediction against its measurement, one point each: a log-log parity plot with the diagonal and a band
(benchmarks/memory_validation.py, benchmarks/lossy_prices.py)."""

MARKERS = "os^vD<>p"


def parity_plot(path, groups, band, xlabel, ylabel, title, size=(6.4, 5.2)):
    """Write a PNG to `path`: groups {label: [(measured, predicted)]}, each its colour and marker; the diagonal
    and a grey band of x band either side (1.1: ±10%)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, (label, points) in enumerate(groups.items()):
        ax.scatter([m for m, _ in points], [p for _, p in points], label=label, s=28, color=f"C{i}",
                   marker=MARKERS[i % len(MARKERS)], edgecolor="black", linewidth=0.4)
    every = [v for points in groups.values() for pair in points for v in pair]
    lo, hi = min(every) / 1.5, max(every) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.fill_between([lo, hi], [lo / band, hi / band], [lo * band, hi * band], color="gray", alpha=0.15,
                    label=f"±{100 * (band - 1):.0f}%")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2 if len(groups) > 4 else 1)
    fig.savefig(path, dpi=100)
