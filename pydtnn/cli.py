"""`pydtnn-train`, `python -m pydtnn` and `python examples/train.py`: one program.

Flag names follow PyDTNN (underscores); each is also accepted with dashes. Exit codes: 0 success,
2 user error (one line `pydtnn: error: ...`, no traceback), 1 internal error.
"""

import argparse
import json
import sys

from pydtnn.errors import ConfigError, PydtnnError

TRUE, FALSE = ("true", "1", "yes", "y", "on"), ("false", "0", "no", "n", "off")


def parse_bool(text):
    """PyDTNN passes booleans as values: '--evaluate', '--evaluate true', '--evaluate False' all work."""
    t = str(text).strip().lower()
    if t in TRUE:
        return True
    if t in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false/1/0/yes/no), got {text!r}")


def positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def non_negative_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2."""

    def error(self, message):
        raise ConfigError(message)

    def flag(self, group, name, **kw):
        """Add --name (PyDTNN's underscore spelling) and its dashed twin."""
        names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        if kw.get("type") is parse_bool:
            kw.setdefault("nargs", "?")
            kw.setdefault("const", True)
            kw.setdefault("metavar", "BOOL")
        group.add_argument(*names, **kw)


def build_parser():
    from pydtnn import data, losses, models, optim

    p = Parser(prog="pydtnn", description="Train a model with pydtnn.", allow_abbrev=False)
    g = p.add_argument_group("model")
    p.flag(g, "model", default="simplecnn", help=f"architecture: {', '.join(models.names())} (default simplecnn)")
    p.flag(g, "list_models", type=parse_bool, default=False, help="list the model zoo and exit")
    p.flag(g, "batch_size", type=positive_int, default=64, help="samples per step and process (default 64)")
    p.flag(g, "num_epochs", type=positive_int, default=10, help="epochs to train (default 10)")
    p.flag(g, "steps_per_epoch", type=positive_int, default=None, help="cap on steps per epoch (default: whole dataset)")
    p.flag(g, "dtype", choices=("float32", "float64"), default="float32", help="parameter/activation dtype")
    p.flag(g, "summary", type=parse_bool, default=False, help="print the per-layer summary before training")

    g = p.add_argument_group("dataset")
    p.flag(g, "dataset", default="mnist5k", help=f"{', '.join(data.NAMES)} (default mnist5k: embedded, 5,000 MNIST digits)")
    p.flag(g, "dataset_train_path", default=None, help="directory holding the training files")
    p.flag(g, "dataset_test_path", default=None, help="directory holding the test files (default: the training one)")

    g = p.add_argument_group("optimizer")
    p.flag(g, "optimizer", default="sgd", choices=optim.NAMES, help="default sgd")
    p.flag(g, "learning_rate", type=non_negative_float, default=None,
           help="default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_LR.items()))
    p.flag(g, "momentum", type=non_negative_float, default=None, help="SGD/RMSProp momentum (default: sgd 0.9, rmsprop 0)")
    p.flag(g, "nesterov", type=parse_bool, default=False, help="Nesterov momentum for SGD")
    p.flag(g, "decay", type=non_negative_float, default=None,
           help="weight decay: L2 added to the gradient; decoupled for adamw (default 0, adamw 0.01)")
    p.flag(g, "beta1", type=non_negative_float, default=0.9, help="Adam/AdamW/Nadam beta1 (default 0.9)")
    p.flag(g, "beta2", type=non_negative_float, default=0.999, help="Adam/AdamW/Nadam beta2 (default 0.999)")
    p.flag(g, "epsilon", type=non_negative_float, default=1e-8, help="denominator epsilon (default 1e-8)")
    p.flag(g, "rho", type=non_negative_float, default=0.99, help="RMSProp decay of the squared average (default 0.99)")
    p.flag(g, "loss_func", default="categorical_cross_entropy", choices=losses.NAMES, help="loss")
    p.flag(g, "metrics", default="accuracy", help=f"comma-separated: {', '.join(_metric_names())}")

    g = p.add_argument_group("output")
    p.flag(g, "seed", type=int, default=0, help="seed of initialization, dropout and data order (default 0)")
    p.flag(g, "metrics_file", default=None, help="JSON Lines file of per-epoch and final metrics")
    p.flag(g, "progress", type=parse_bool, default=True, help="show progress bars (default true)")
    return p


def _metric_names():
    from pydtnn import metrics

    return metrics.NAMES


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def run(args):
    """Train and evaluate as the parsed flags say; returns the final metrics record."""
    from pydtnn import data, losses, models, optim
    from pydtnn.backends import get_backend
    from pydtnn.trainer import Trainer, format_record

    if args.list_models:
        print("\n".join(models.names()))
        return None
    metric_names = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    backend = get_backend("cpu", args.dtype, args.seed)
    train, test = data.load(args.dataset, args.dataset_train_path, args.dataset_test_path)
    model = models.create(args.model, input_shape=train.input_shape, num_classes=train.num_classes, backend=backend)
    optimizer = optim.create(args.optimizer, model.parameters(), **optimizer_options(args))
    trainer = Trainer(model, losses.create(args.loss_func), optimizer, metrics=metric_names, seed=args.seed,
                      progress=args.progress, metrics_file=args.metrics_file)
    config = {k: v for k, v in sorted(vars(args).items()) if k not in ("list_models",)}
    print(f"pydtnn: {args.model} on {args.dataset} ({len(train)} train, {len(test)} test); {model.count_params():,} "
          f"parameters; config {json.dumps(config)}", file=sys.stderr)
    if args.summary:
        model.summary(file=sys.stderr)
    trainer.fit(train, args.num_epochs, args.batch_size, test=test, steps_per_epoch=args.steps_per_epoch)
    print(format_record(trainer.final))
    return trainer.final


DEFAULT_LR = {"sgd": 0.05, "rmsprop": 0.001, "adam": 0.001, "adamw": 0.001, "nadam": 0.002}


def optimizer_options(args):
    """Keyword arguments of the chosen optimizer from the flags that apply to it.

    Flags left unset take the optimizer's own default (AdamW's weight decay stays 0.01), except
    the learning rate (DEFAULT_LR) and SGD's momentum (0.9), which suit the default model.
    """
    name = args.optimizer
    opts = {"lr": args.learning_rate if args.learning_rate is not None else DEFAULT_LR[name]}
    if args.decay is not None:
        opts["weight_decay"] = args.decay
    if name == "sgd":
        opts.update(momentum=0.9 if args.momentum is None else args.momentum, nesterov=args.nesterov)
    elif name == "rmsprop":
        opts.update(rho=args.rho, eps=args.epsilon)
        if args.momentum is not None:
            opts["momentum"] = args.momentum
    else:
        opts.update(beta1=args.beta1, beta2=args.beta2, eps=args.epsilon)
    return opts


def main(argv=None):
    """Entry point; returns the exit code (and exits with it when run as a script)."""
    try:
        run(parse_args(argv))
    except PydtnnError as e:
        print(f"pydtnn: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pydtnn: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
