"""Family names (vgg16, resnet50, mobilenetv1) resolved to the registered variant that fits the data.

    choice, model = resolve("vgg16", input_shape=(1, 28, 28), num_classes=10)
    choice.name         # 'vgg16_cifar10': images up to 64 pixels a side take the CIFAR-10 variant
    choice.input_shape  # (1, 32, 32): VGG's CIFAR-10 variant needs 32x32, so 28x28 digits are padded
    choice.notes        # what was adapted, for the run's header

The rules, in docs/models.md ("Family names and other data"):
- A family with a CIFAR-10 and an ImageNet variant takes the CIFAR-10 one for images of at most
  SMALL_SIDE pixels a side, the ImageNet one for larger images. A family with one variant takes it.
- Every model adapts to the data in two documented ways only: its first layer takes the data's
  channels and its last layer gives the data's classes (both said in the header when they differ
  from the design). The architecture is otherwise the named one.
- Images smaller than a variant's design size are zero-padded (centred) up to it when that takes at
  most MAX_PAD_AREA times the pixels (28x28 -> 32x32: 1.31x), so the layers see the shapes they were
  designed for. Otherwise the model is built for the images as they are (the ImageNet variants end in
  adaptive pooling); where it cannot take them, the run stops with one line naming what fits.
"""

from dataclasses import dataclass, field

from pydtnn import models
from pydtnn.errors import ConfigError, ShapeError, TooLarge
from pydtnn.models.family_table import FAMILIES, SMALL_SIDE, family_of, pick  # noqa: F401 (importable from here)

MAX_PAD_AREA = 1.5


@dataclass
class Choice:
    """A registered variant and the sample shape it is built for (the data's, or the data's padded)."""

    name: str
    input_shape: tuple
    num_classes: int
    notes: list = field(default_factory=list)


def variant(name, input_shape):
    """The registered name `name` stands for, for samples of input_shape (C, H, W); name itself if registered."""
    if name in models.names():
        return name
    if name not in FAMILIES:
        raise models.unknown_model(name)
    return pick(name, input_shape)


def resolve(name, input_shape, num_classes, build=None):
    """Choice of variant and input shape for data of `input_shape` (C, H, W) in `num_classes` classes.

    build(variant, input_shape) -> anything (default: models.create); a ShapeError from it becomes a
    ConfigError naming what fits. Returns (Choice, what build returned).
    """
    build = build or (lambda n, shape: models.create(n, input_shape=shape, num_classes=num_classes))
    chosen = variant(name, input_shape)
    design_shape, design_classes = models.defaults(chosen)
    shape = tuple(int(s) for s in input_shape)
    notes = []
    check_kind(chosen, shape, design_shape)
    if chosen != name:
        what = f"windows of {shape[0]} tokens" if len(shape) == 1 else f"{'x'.join(map(str, shape))} images"
        notes.append(f"{name} is {chosen} for {what}")
    if len(shape) == 3 and shape[0] != design_shape[0]:
        notes.append(f"first layer takes {shape[0]} channel{'s' * (shape[0] != 1)} (designed for {design_shape[0]})")
    if num_classes != design_classes:
        notes.append(f"a vocabulary of {num_classes} tokens (designed for {design_classes})" if len(shape) == 1 else
                     f"last layer gives {num_classes} classes (designed for {design_classes})")
    if len(shape) == 3 and len(design_shape) == 3:
        h, w = max(shape[1], design_shape[1]), max(shape[2], design_shape[2])
        if (h, w) != shape[1:] and h * w <= MAX_PAD_AREA * shape[1] * shape[2]:
            notes.append(f"{shape[1]}x{shape[2]} images zero-padded to its design size {h}x{w}")
            shape = (shape[0], h, w)
    try:
        return Choice(chosen, shape, num_classes, notes), build(chosen, shape)
    except TooLarge:  # the images fit the model; the machine cannot hold it
        raise
    except ShapeError as e:
        small = sorted(f for f, v in FAMILIES.items() if v["cifar10"])
        raise ConfigError(f"model {chosen} cannot take {'x'.join(map(str, shape))} images (its design input is "
                          f"{'x'.join(map(str, design_shape))}): {e}; use a dataset with larger images "
                          f"(imagenet) or a model for small images ({', '.join(small)})") from None


def check_kind(chosen, shape, design_shape):
    """ConfigError where a token model (input (T,)) is given images, or an image model token windows."""
    if (len(shape) == 1) == (len(design_shape) == 1):
        return
    if len(design_shape) == 1:
        raise ConfigError(f"model {chosen} takes windows of token ids (a text dataset: --dataset text or "
                          f"tiny_shakespeare); got {'x'.join(map(str, shape))} images")
    tokens = sorted(f for f, v in FAMILIES.items() if v.get("text"))
    raise ConfigError(f"model {chosen} takes images; got windows of {shape[0]} tokens (a text dataset): expected a "
                      f"token model ({', '.join(tokens)})")


# How a family trains from the command line where --learning_rate, --batch_size, --num_epochs or
# --lr_schedulers are not given. VGG without BatchNorm sits on a plateau (loss ~2.3) for its first ~100
# updates whatever the batch, and a rate that leaves it sooner (0.05 per process) ends it at a loss of
# ln 10 for good; so it takes small batches, many updates, at 0.005 per 16 samples, with a cosine decay
# that settles it. Measured on the embedded digits with two processes (docs/models.md): 97.5% test
# accuracy after 5 and 6 of 7 epochs (96.5% after 8 epochs at a constant rate).
# MobileNet v1 (no residuals, depthwise layers) climbs from a loss of 2.7 to 6 in its first ten updates
# at 0.05 per process (0.1 for two), and falls from the start at half that.
RECIPES = {
    **{f"vgg{d}": {"learning_rate": 0.005, "batch_size": 16, "num_epochs": 7, "lr_schedulers": "cosine"}
       for d in (11, 13, 16, 19)},
    "mobilenetv1": {"learning_rate": 0.025},
    # ViT with SGD (momentum 0.9, 0.05 per process) is still at a loss of 2.1 on Fashion-MNIST after 115 updates at
    # np 2, where AdamW at 0.001 per process is at 1.3 after 68: transformers train with Adam-family optimizers
    **{f: {"optimizer": "adamw", "num_epochs": 4, "lr_schedulers": "cosine"} for f in ("vit", "vit_tiny", "vit_small")},
    **{f: {"optimizer": "adamw", "num_epochs": 5, "lr_schedulers": "cosine"} for f in ("gpt", "gpt_nano", "gpt_mini")},
}
DEFAULT_RECIPE = {"batch_size": 64, "num_epochs": 10, "lr_schedulers": ""}
# what a first run of a family looks like, where it would otherwise look broken (printed in the header)
EXPECT = {f"vgg{d}": ("VGG without BatchNorm stays near chance (loss about 2.3) for its first ~100 updates, so its "
                      "first epoch's accuracy can be 0.1-0.3; it then climbs (97.5% test accuracy after 7 epochs on "
                      "the embedded digits, docs/models.md)") for d in (11, 13, 16, 19)}


def expectation(name):
    """A sentence on how training model `name` (registered or family) starts, where that looks unusual; else None."""
    return EXPECT.get(family_of(name) or name)
# learning rate per optimizer where neither --learning_rate nor the family's recipe gives one
DEFAULT_LR = {"sgd": 0.05, "rmsprop": 0.001, "adam": 0.001, "adamw": 0.001, "nadam": 0.002}


def recipe(name, optimizer="sgd"):
    """{"batch_size", "num_epochs", "lr_schedulers"[, "learning_rate"]} the command line uses for
    registered model `name` where the flags are not given; the learning rate is the family's for SGD
    only (else the optimizer's). The family's optimizer is default_optimizer's."""
    out = {**DEFAULT_RECIPE, **RECIPES.get(family_of(name) or name, {})}
    out.pop("optimizer", None)
    if optimizer != "sgd":
        out.pop("learning_rate", None)
    return out


def default_optimizer(name):
    """The optimizer a run of model `name` (a family or a registered variant; None: a model file) takes when
    --optimizer is not given: its family's recipe's, else "sgd"."""
    return RECIPES.get(family_of(name) or name, {}).get("optimizer", "sgd") if name else "sgd"
