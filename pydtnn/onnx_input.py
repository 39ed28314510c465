"""What an exported graph's input holds: a dataset's images as the trainer fed them to the model.

    contract = input_contract("mnist5k", model.input_shape)   # InputContract
    describe_input(contract, model.input_shape)                # one sentence, for the doc_string
    metadata(contract, model.input_shape)                      # the graph's metadata_props

The trainer feeds a model its dataset's uint8 pixels times 1/255, minus a per-channel mean and
divided by a std where the dataset has them (CIFAR, ImageNet), zero-padded (black) up to the
model's input when a family variant was built for larger images (28x28 digits for a 32x32 network).
The graph records that in its metadata_props ("pydtnn.input", "pydtnn.dataset",
"pydtnn.normalization", "pydtnn.padding", "pydtnn.preprocessing") and doc_string;
preprocessing_nodes puts it into the graph itself (Cast, Pad, Mul, Sub, Div), which then takes the
dataset's images as stored.
"""

import json
from dataclasses import dataclass

import numpy as np

from pydtnn.errors import ConfigError


@dataclass(frozen=True)
class InputContract:
    """What the graph's input holds: a dataset's images as the trainer fed them to the model.

    The model's float32 input is (pixels * scale - mean) / std per channel, where pixels are the
    dataset's uint8 images of data_shape (C, H, W), zero-padded (black pixels, before normalization)
    by pads = (top, left, bottom, right) rows and columns, centred, up to the model's input shape.
    mean, std: (C,) tuples, or None where the dataset applies none. scale None: data without pixels
    (synthetic), of which only the name is known.
    """

    dataset: str
    data_shape: tuple
    scale: float = None
    mean: tuple = None
    std: tuple = None
    pads: tuple = (0, 0, 0, 0)

    def input_shape(self):
        """(C, H, W) of the model's input: data_shape plus the padding."""
        c, h, w = self.data_shape
        t, left, b, r = self.pads
        return c, h + t + b, w + left + r

    def formula(self):
        """The float input in words: 'pixels / 255, minus mean (...), divided by std (...) per channel'."""
        inverse = 1 / self.scale
        parts = [f"pixels / {round(inverse)}" if abs(inverse - round(inverse)) < 1e-9 * inverse
                 else f"pixels * {self.scale:g}"]
        if self.mean is not None:
            parts.append(f"minus mean ({', '.join(f'{m:g}' for m in self.mean)})")
        if self.std is not None:
            parts.append(f"divided by std ({', '.join(f'{v:g}' for v in self.std)})")
        return ", ".join(parts) + (" per channel" if self.mean is not None or self.std is not None else "")

    def padding(self):
        """The padding in words: 'to 1x32x32 (2 rows top, 2 bottom, 2 columns left, 2 right)'; '' when none."""
        if not any(self.pads):
            return ""
        t, left, b, r = self.pads
        return (f"to {shape_text(self.input_shape(), 'x')} ({t} rows top, {b} bottom, {left} columns left, "
                f"{r} right)")


def shape_text(shape, sep=", "):
    """A shape in words: (1, 28, 28) -> '1, 28, 28', or with sep='x' '1x28x28'."""
    return sep.join(str(int(s)) for s in shape)


def describe_input(contract, input_shape, with_preprocessing=False, batch="N"):
    """One sentence: what the graph's input "input" holds (dtype, layout, shape, and the pixels' transform)."""
    if len(input_shape) == 1:  # a token model (a GPT)
        return f"float32 token ids ({batch}, {input_shape[0]}), whole numbers in the model's vocabulary"
    if contract is None:
        return (f"float32 NCHW ({batch}, {shape_text(input_shape)}); the data the model was trained on is not "
                f"recorded (export with --dataset NAME to record it)")
    if contract.scale is None:
        return (f"float32 NCHW ({batch}, {shape_text(input_shape)}): {contract.dataset} data as generated, "
                f"not normalized")
    if with_preprocessing:
        pad = f"zero-pads them (black pixels), centred, {contract.padding()}, then " if any(contract.pads) else ""
        return (f"uint8 NCHW ({batch}, {shape_text(contract.data_shape)}): {contract.dataset} images as stored, pixels "
                f"0..255; the graph itself {pad}computes {contract.formula()}")
    pad = (f"; {shape_text(contract.data_shape, 'x')} images zero-padded (black pixels, before normalization), "
           f"centred, {contract.padding()}") if any(contract.pads) else ""
    return f"float32 NCHW ({batch}, {shape_text(input_shape)}): {contract.dataset} images, {contract.formula()}{pad}"


def metadata(contract, input_shape, with_preprocessing=False):
    """The graph's metadata_props: "pydtnn.input" (describe_input), and where the data is known
    "pydtnn.dataset", "pydtnn.preprocessing" ("in the graph" or "outside the graph"), and as JSON
    "pydtnn.normalization" {scale, mean, std} (float input = (pixels * scale - mean) / std per
    channel; null: not applied) and "pydtnn.padding" {data_shape, input_shape, top, left, bottom, right}."""
    props = {"pydtnn.input": describe_input(contract, input_shape, with_preprocessing)}
    if contract is None:
        return props
    props["pydtnn.dataset"] = contract.dataset
    if contract.scale is None:
        return props
    t, left, b, r = contract.pads
    props["pydtnn.preprocessing"] = "in the graph" if with_preprocessing else "outside the graph"
    props["pydtnn.normalization"] = json.dumps({"scale": contract.scale,
                                               "mean": None if contract.mean is None else list(contract.mean),
                                               "std": None if contract.std is None else list(contract.std)})
    props["pydtnn.padding"] = json.dumps({"data_shape": list(contract.data_shape),
                                          "input_shape": list(contract.input_shape()),
                                          "top": t, "left": left, "bottom": b, "right": r})
    return props


@dataclass(frozen=True)
class Pixels:
    """How a dataset's loader turns its uint8 images (usually of `shape`) into the model's input."""

    scale: float
    mean: tuple
    std: tuple
    shape: tuple
    classes: int


def dataset_pixels(dataset):
    """Pixels of `dataset` (a pydtnn.data name), read from its loader's constants; None for synthetic
    data and text (no pixels). ConfigError for a name pydtnn.data does not know."""
    from pydtnn.data import cifar, imagenet
    from pydtnn.data.datasets import NAMES, SHAPES, TEXT
    from pydtnn.suggest import did_you_mean

    if dataset in cifar.LAYOUTS:
        spec = cifar.LAYOUTS[dataset]
        return Pixels(1 / 255, spec["mean"], spec["std"], *SHAPES[dataset])
    if dataset == "imagenet":  # ImageFolder's evaluation view: shorter side resized to 256, centre 224x224 crop
        return Pixels(1 / 255, imagenet.IMAGENET_MEAN, imagenet.IMAGENET_STD, SHAPES[dataset][0], None)
    if dataset in ("mnist5k", "mnist", "fashion_mnist"):  # IDX files: grey images, scaled only
        return Pixels(1 / 255, None, None, *SHAPES[dataset])
    if dataset == "synthetic" or dataset in TEXT:  # generated floats, or token ids: no pixels
        return None
    raise ConfigError(f"unknown dataset {dataset!r}{did_you_mean(str(dataset), NAMES) or ';'} expected one of "
                      f"{', '.join(NAMES)}")


def input_contract(dataset, input_shape, data_shape=None):
    """InputContract of a model taking `input_shape` (C, H, W), trained on `dataset` (a pydtnn.data name).

    data_shape: (C, H, W) of the dataset's images; by default its usual size where the trainer pads
    that to input_shape (models/families.py's rule), else input_shape itself (the trainer builds the
    model for the data's own size unless it pads). The padding is the one pydtnn.data.pad's
    PaddedDataset applies. ConfigError for an unknown dataset, or images the trainer could not have
    given this model (other channels, larger than its input).
    """
    from pydtnn.data.dataset import ArrayDataset
    from pydtnn.data.pad import PaddedDataset
    from pydtnn.models.families import MAX_PAD_AREA

    input_shape = tuple(int(s) for s in input_shape)
    pixels = dataset_pixels(dataset)
    if pixels is None:
        return InputContract(dataset, input_shape)
    if len(input_shape) != 3 or input_shape[0] != pixels.shape[0]:
        raise ConfigError(f"dataset {dataset} has {shape_text(pixels.shape, 'x')} images; the model takes input "
                          f"{input_shape}, not images of {pixels.shape[0]} channel{'s' * (pixels.shape[0] > 1)}: "
                          f"give the dataset it was trained on")
    if data_shape is None:
        (_, h, w), (_, h2, w2) = pixels.shape, input_shape
        fits = h <= h2 and w <= w2 and h2 * w2 <= MAX_PAD_AREA * h * w
        data_shape = pixels.shape if fits else input_shape
    data_shape = tuple(int(s) for s in data_shape)
    images = ArrayDataset(np.zeros((1, *data_shape), np.uint8), np.zeros(1, np.int64), 1, pixels.scale,
                          pixels.mean, pixels.std, name=dataset)
    padded = PaddedDataset(images, input_shape)  # the trainer's padding; ConfigError for shapes it cannot pad
    _, h, w = data_shape
    pads = (padded.top, padded.left, input_shape[1] - h - padded.top, input_shape[2] - w - padded.left)
    return InputContract(dataset, data_shape, pixels.scale, pixels.mean, pixels.std, pads)


def preprocessing_nodes(g, contract, x, float_type):
    """Nodes from uint8 images (N, *data_shape) to the model's float32 input, in the trainer's order:
    Cast, Pad (zeros: black pixels), Mul by scale, Sub mean, Div std (float32, as the data loaders do)."""
    x = g.node("Cast", [x], "preprocessing/cast", to=float_type)
    if any(contract.pads):
        t, left, b, r = contract.pads
        x = g.node("Pad", [x, g.constant("preprocessing.pads", np.array([0, 0, t, left, 0, 0, b, r], np.int64))],
                   "preprocessing/pad")
    x = g.node("Mul", [x, g.constant("preprocessing.scale", np.array(contract.scale, np.float32))],
               "preprocessing/scale")
    c = contract.data_shape[0]
    if contract.mean is not None:
        mean = np.array(contract.mean, np.float32).reshape(1, c, 1, 1)
        x = g.node("Sub", [x, g.constant("preprocessing.mean", mean)], "preprocessing/mean")
    if contract.std is not None:
        std = np.array(contract.std, np.float32).reshape(1, c, 1, 1)
        x = g.node("Div", [x, g.constant("preprocessing.std", std)], "preprocessing/std")
    return x


def image_datasets():
    """The names of pydtnn.data's datasets of images (all but synthetic data), comma-separated."""
    from pydtnn.data.datasets import NAMES

    return ", ".join(n for n in NAMES if dataset_pixels(n) is not None)
