"""`pydtnn-plot METRICS.jsonl [-o curves.png]`: loss and accuracy curves of a run, as a PNG.

Reads the JSON Lines file written by --metrics_file; train and validation curves share an axis.
The output is checked before anything is read or drawn (its folder exists, nothing but a regular
file stands there, it is not the metrics file itself), and written atomically.
"""

import io
import json
import os
import sys

from pydtnn.errors import DataError, command_status

PLOTTED = ("loss", "accuracy", "val_loss", "val_accuracy")  # the values drawn from each epoch record
METRICS_LIMIT = 256 << 20  # bytes: a metrics file holds one short line per epoch; anything this big is not one


def read_metrics(path):
    """(epoch records, final record or None) from a metrics file; DataError if it is not one.

    The file must be a regular file (a FIFO or a device is refused, never read) of at most METRICS_LIMIT bytes.
    """
    from pydtnn.files import read_bytes

    try:
        raw = read_bytes(path, "metrics file", METRICS_LIMIT, DataError)
    except FileNotFoundError:
        raise DataError(f"metrics file {path} does not exist; expected the JSON Lines file of --metrics_file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"metrics file {path} is not UTF-8 text (byte {e.start}); expected the JSON Lines of "
                        f"--metrics_file") from None
    records = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError):
            raise DataError(f"{path}:{i}: not a JSON object; expected the JSON Lines of --metrics_file") from None
    epochs = [r for r in records if isinstance(r, dict) and "epoch" in r and not r.get("final")]
    finals = [r for r in records if isinstance(r, dict) and r.get("final")]
    if not epochs:
        raise DataError(f"{path}: no per-epoch records (objects with an 'epoch' key)")
    plotted = [(r, k) for r in epochs for k in ("epoch", *PLOTTED)] + [(f, f"test_{k}") for f in finals[-1:]
                                                                       for k in ("loss", "accuracy")]
    for record, key in plotted:
        value = record.get(key)
        if not (value is None and key != "epoch") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            epoch = str(record.get("epoch"))[:20]
            raise DataError(f"{path}: {key} {str(value)[:60]!r} in the record of epoch {epoch}; "
                            f"expected a number{'' if key == 'epoch' else ' or null'}")
    return epochs, (finals[-1] if finals else None)


def default_output(path):
    """The PNG a metrics file's curves go to without -o: its name with .png."""
    return os.path.splitext(os.fspath(path))[0] + ".png"


def check_output(path, out):
    """ConfigError, before anything is read or drawn, unless the PNG `out` can be written and is not the
    metrics file `path` (through a symbolic or hard link included)."""
    from pydtnn.files import TMP, check_distinct, check_writable

    check_writable(out, "plot")
    check_distinct([("plot", out), ("plot's temporary file", out + TMP)], [("metrics file", path)])


def plot(path, out=None, title=None):
    """Draw loss and accuracy against epoch into the PNG `out` (default: default_output(path)); returns out."""
    import matplotlib.pyplot as plt

    from pydtnn.files import write_atomic

    path = os.fspath(path)
    out = os.fspath(out) if out else default_output(path)
    check_output(path, out)
    fig = figure(path, title)
    try:
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
    finally:
        plt.close(fig)
    write_atomic(out, png.getvalue())
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


def build_parser():
    from pydtnn.argtypes import Parser

    p = Parser(prog="pydtnn-plot", allow_abbrev=False, description="Plot loss/accuracy curves from a --metrics_file.")
    p.add_argument("metrics_file", help="JSON Lines file written by pydtnn-train --metrics_file")
    p.add_argument("-o", "--output", help="PNG to write, replaced atomically; its folder must exist (default: the "
                                          "metrics file's name with .png)")
    p.add_argument("--title", help="title above the two plots (default: the metrics file's name)")
    return p


def main(argv=None):
    """`pydtnn-plot`: 0 on success; 2 and one line `pydtnn-plot: error: ...` on a user error, no file written."""
    def body():
        args = build_parser().parse_args(argv)
        print(plot(args.metrics_file, args.output, args.title))

    return command_status(body, "pydtnn-plot")


if __name__ == "__main__":
    sys.exit(main())
