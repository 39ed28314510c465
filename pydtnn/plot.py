"""`pydtnn-plot METRICS.jsonl [-o curves.png]`: loss and accuracy curves of a run, as a PNG.

Reads the JSON Lines file written by --metrics_file; train and validation curves share an axis.
"""

import argparse
import json
import os
import sys

from pydtnn.errors import ConfigError, DataError, PydtnnError


def read_metrics(path):
    """(epoch records, final record or None) from a metrics file; DataError if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [s for s in f.read().splitlines() if s.strip()]
    except OSError as e:
        raise DataError(f"cannot read metrics file {path}: {e.strerror}") from None
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            raise DataError(f"{path}:{i}: not a JSON object; expected the JSON Lines of --metrics_file") from None
    epochs = [r for r in records if isinstance(r, dict) and "epoch" in r and not r.get("final")]
    finals = [r for r in records if isinstance(r, dict) and r.get("final")]
    if not epochs:
        raise DataError(f"{path}: no per-epoch records (objects with an 'epoch' key)")
    return epochs, (finals[-1] if finals else None)


def plot(path, out=None, title=None):
    """Draw loss and accuracy against epoch; returns the PNG path written."""
    import matplotlib.pyplot as plt

    fig = figure(path, title)
    out = out or os.path.splitext(path)[0] + ".png"
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror}") from None
    finally:
        plt.close(fig)
    return out


def figure(path, title=None):
    """The matplotlib Figure of plot(): loss and accuracy against whole epochs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs, final = read_metrics(path)
    x = [r["epoch"] for r in epochs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, key in zip(axes, ("loss", "accuracy")):
        for prefix, style in (("", "-o"), ("val_", "--s")):
            ys = [r.get(prefix + key) for r in epochs]
            if any(y is not None for y in ys):
                ax.plot(x, [float("nan") if y is None else y for y in ys], style, ms=3, label=f"{prefix or 'train '}{key}".replace("_", " "))
        if final and final.get(f"test_{key}") is not None:
            ax.axhline(final[f"test_{key}"], color="gray", lw=1, ls=":", label=f"test {key} {final[f'test_{key}']:.4g}")
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole: no tick at 1.5
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(title or os.path.basename(path))
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(prog="pydtnn-plot", description="Plot loss/accuracy curves from a --metrics_file.")
    p.add_argument("metrics_file")
    p.add_argument("-o", "--output", help="PNG to write (default: the metrics file's name with .png)")
    p.add_argument("--title")
    args = p.parse_args(argv)
    try:
        print(plot(args.metrics_file, args.output, args.title))
    except PydtnnError as e:
        print(f"pydtnn-plot: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
