"""ONNX export of a built Model, for inference: BatchNorm uses its running statistics, Dropout is the identity.

    from pydtnn.export import to_onnx
    to_onnx(model, "net.onnx")          # input "input" (N, C, H, W), output "output" (N, classes)

    contract = input_contract("mnist5k", model.input_shape)      # what the input holds, for the metadata
    to_onnx(model, "net.onnx", contract=contract, with_preprocessing=True)   # input: uint8 images as stored

    pydtnn-export net.onnx --checkpoint DIR                  # a checkpoint written by pydtnn-train
    pydtnn-export net.onnx --model resnet18_imagenet --input_shape 3,64,64 [--weights w.safetensors]
    pydtnn-export net.onnx --checkpoint DIR --with_preprocessing     # takes raw uint8 images

The graph is float32 (a float64 model's weights are rounded to float32), NCHW, with a dynamic batch
dimension "N" unless batch_size is given; pydtnn.onnx_graph says which operators each layer becomes,
pydtnn.onnx_input what the input holds (InputContract) and how the graph records it.

`onnx` is imported only here, when an export runs: `import pydtnn` does not need it.
"""

import json
import os
import sys

import numpy as np

from pydtnn.errors import ConfigError, DataError, command_status
from pydtnn.onnx_graph import INPUT, OUTPUT, Graph, export_layer, state_bytes
from pydtnn.onnx_input import (
    InputContract,
    dataset_pixels,
    describe_input,
    image_datasets,
    input_contract,
    metadata,
    preprocessing_nodes,
    shape_text,
)

MIN_OPSET = 13  # Softmax over one axis (opset 13); Clip with min/max inputs (opset 11)
_PROTOBUF_LIMIT = 2**31 - 1  # bytes: one ONNX file without external data


def _import_onnx():
    try:
        import onnx
    except ImportError:
        raise ConfigError("ONNX export needs the onnx package: pip install onnx "
                          "(or pip install -e '.[onnx]')") from None
    return onnx


# -- the model ----------------------------------------------------------------------------------
def to_proto(model, opset=17, batch_size=None, contract=None, with_preprocessing=False):
    """onnx.ModelProto of a built Model, checked with onnx.checker (full check: shapes inferred and compared).

    contract: the InputContract of the data the model was trained on (None: not known), recorded in
    the graph's metadata_props (see metadata) and doc_string. with_preprocessing: the graph takes
    the dataset's uint8 images (N, *contract.data_shape) and applies the contract itself.
    Raises ConfigError for an opset out of range, a bad batch size, a layer type with no ONNX
    equivalent (naming the layer and its type), a model over protobuf's 2 GB, a missing onnx, or
    with_preprocessing without a contract of pixels that pad to the model's input shape.
    """
    proto = _build(model, opset, batch_size, contract, with_preprocessing)
    _import_onnx().checker.check_model(proto, full_check=True)
    return proto


def to_onnx(model, path, opset=17, batch_size=None, contract=None, with_preprocessing=False):
    """Write `model` (a built Model) to `path` as an ONNX graph for inference; returns the path.

    Input "input" (N, *model.input_shape) float32, or with_preprocessing (N, *contract.data_shape)
    uint8; output "output" (N, *model.output_shape) float32; N is dynamic unless batch_size is given.
    The graph is checked as to_proto says before the file appears, and written under a temporary
    name in the same folder, then renamed: a failure leaves no file (and an older file at `path` as
    it was). The folder must exist.
    """
    from pydtnn.files import write_atomic

    data = _build(model, opset, batch_size, contract, with_preprocessing).SerializeToString()
    _import_onnx().checker.check_model(data, full_check=True)  # the bytes: serialized once, not twice
    write_atomic(path, data)
    return path


def _build(model, opset, batch_size, contract=None, with_preprocessing=False):
    from pydtnn import __version__
    from pydtnn.model import Model

    onnx = _import_onnx()
    helper = onnx.helper
    if not isinstance(model, Model):
        raise TypeError(f"to_onnx expects a built pydtnn.model.Model, got {type(model).__name__}")
    if contract is not None and not isinstance(contract, InputContract):
        raise TypeError(f"contract: expected an InputContract (input_contract()), got {type(contract).__name__}")
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, (int, np.integer)) or not MIN_OPSET <= opset <= newest:
        raise ConfigError(f"ONNX opset {opset!r} is not supported; expected an integer from {MIN_OPSET} to {newest} "
                          f"(the newest this onnx {onnx.__version__} knows)")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ConfigError(f"batch_size {batch_size!r} is not valid; expected a positive integer, or None for a "
                          f"dynamic batch")
    if with_preprocessing:
        if contract is None or contract.scale is None:
            raise ConfigError(f"preprocessing in the graph needs the images the model was trained on; "
                              f"{'synthetic data has no pixels' if contract is not None else 'no dataset is known'}: "
                              f"expected a dataset of images ({image_datasets()})")
        if tuple(contract.input_shape()) != tuple(model.input_shape):
            raise ConfigError(f"{contract.dataset} images {shape_text(contract.data_shape, 'x')} padded by "
                              f"{contract.pads} give {shape_text(contract.input_shape(), 'x')}; the model takes "
                              f"{shape_text(model.input_shape, 'x')}")
    size, pooling = state_bytes(model)
    if size + pooling > _PROTOBUF_LIMIT:  # checked before the graph allocates any of it
        what = f" and {pooling / 2**30:.1f} GiB of adaptive-pooling matrices for input {model.input_shape}"
        what *= bool(pooling)
        raise ConfigError(f"model {model.name!r} has {size / 2**30:.1f} GiB of float32 state{what}; an ONNX file "
                          f"without external data holds at most 2 GiB: export it for a smaller input shape")

    g = Graph(onnx, opset)
    x = preprocessing_nodes(g, contract, INPUT, onnx.TensorProto.FLOAT) if with_preprocessing else INPUT
    y = export_layer(g, model.root, x)
    if y == x:  # the model is the identity (e.g. only Dropout)
        y = g.node("Identity", [x], OUTPUT)
    for node in g.nodes:  # the last value computed becomes the graph's output; nothing consumes it
        node.output[:] = [OUTPUT if o == y else o for o in node.output]

    batch = "N" if batch_size is None else int(batch_size)
    if with_preprocessing:
        given = helper.make_tensor_value_info(INPUT, onnx.TensorProto.UINT8, [batch, *contract.data_shape])
    else:
        given = helper.make_tensor_value_info(INPUT, onnx.TensorProto.FLOAT, [batch, *model.input_shape])
    graph = helper.make_graph(
        g.nodes, model.name, [given],
        [helper.make_tensor_value_info(OUTPUT, onnx.TensorProto.FLOAT, [batch, *model.output_shape])],
        initializer=g.initializers,
    )
    opsets = [helper.make_opsetid("", int(opset))]
    described = describe_input(contract, model.input_shape, with_preprocessing, batch)
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="pydtnn", producer_version=__version__,
                              doc_string=f"pydtnn model {model.name}, inference mode. Input: {described}")
    helper.set_model_props(proto, metadata(contract, model.input_shape, with_preprocessing))
    proto.ir_version = helper.find_min_ir_version_for(opsets)  # readable by the oldest runtime that has the opset
    return proto


# -- pydtnn-export ------------------------------------------------------------------------------
def model_from_checkpoint(directory, manifest=None, model_file=None):
    """The Model saved in a checkpoint directory (its architecture, input shape, classes and dtype), weights loaded.

    The manifest (read from the directory unless given) names the architecture and its input shape;
    the number of classes is the one whose state-dict fingerprint matches the checkpoint's (the
    dataset's default, or the size of the classifier's last tensor). A model trained from a model file
    (--model_file) is rebuilt by `model_file`, which the caller gives: a checkpoint never names code to run.
    """
    from pydtnn import checkpoint, models
    from pydtnn.backends import CPUBackend

    if manifest is None:
        manifest = checkpoint.read_manifest(directory)
    where = os.path.join(directory, checkpoint.META_FILE)
    saved_file = _saved_flags(manifest, where).get("model_file")
    if isinstance(saved_file, str) and model_file is None:
        raise ConfigError(f"checkpoint {directory} holds the model of --model_file {saved_file[:300]}; a checkpoint "
                          f"never runs code by itself: give --model_file {saved_file[:300]} to rebuild it")
    if model_file is not None:
        from pydtnn.models import model_file as from_file

        def create(name, input_shape, num_classes, backend):
            return from_file.load(model_file, input_shape, num_classes if num_classes is not None else 10, backend)
    else:
        create = None
    saved = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    name = saved.get("name")
    if not isinstance(name, str) or name == "model":  # a Model built by hand: fall back on the run's flags
        name = _saved_flags(manifest, where).get("model")
    if not isinstance(name, str):
        raise ConfigError(f"{where} does not name the model's architecture; export with --model NAME --weights "
                          f"{os.path.join(directory, checkpoint.MODEL_FILE)}")
    shape, dtype, state = saved.get("input_shape"), saved.get("dtype", "float32"), saved.get("state")
    if not (isinstance(shape, list) and shape and all(isinstance(s, int) and s > 0 for s in shape)):
        raise ConfigError(f"{where}: model input_shape {shape!r} is not a list of positive integers")
    if dtype not in ("float32", "float64"):
        raise ConfigError(f"{where}: model dtype {dtype!r}; expected float32 or float64")
    candidates = [None]
    if isinstance(state, list) and state and isinstance(state[-1], list) and len(state[-1]) > 1:
        last = state[-1][1]
        if isinstance(last, list) and last and isinstance(last[0], int) and last[0] > 0:
            candidates.append(last[0])
    if create is not None and len(candidates) < 2:
        raise ConfigError(f"{where}: cannot tell the classes of the model of --model_file {model_file} (its state "
                          f"ends in no classifier tensor)")
    for classes in candidates[1:] if create is not None else candidates:  # a file has no default classes
        if create is not None:
            model = create(name, shape, classes, CPUBackend(dtype=dtype))
        else:
            model = models.create(name, input_shape=shape, num_classes=classes, backend=CPUBackend(dtype=dtype))
        if state is None or checkpoint.fingerprint(model) == state:
            break
    checkpoint.load(directory, model)  # validates everything; a different architecture is a ShapeError naming it
    return model


def _saved_flags(manifest, where):
    """The run's flags stored in a checkpoint's manifest (meta "config"); {} when it has none."""
    config = manifest["meta"].get("config", {})
    if not isinstance(config, dict):
        raise DataError(f"{where} is corrupt: its 'config' is a {type(config).__name__}; expected an object of "
                        f"flag values")
    return config


def trained_on(manifest, where):
    """The dataset a checkpoint's run trained on ("synthetic" with --use_synthetic_data); None if not recorded."""
    config = _saved_flags(manifest, where)
    if config.get("use_synthetic_data") is True:
        return "synthetic"
    dataset = config.get("dataset")
    if dataset is not None and not isinstance(dataset, str):
        raise DataError(f"{where} is corrupt: its config's dataset is {dataset!r:.80}; expected a name")
    return dataset


def recorded_data_shape(directory):
    """(C, H, W) of the training images as a run recorded them in the checkpoint's config.json
    ("effective": {"data_shape": ...}); None where the file or the value is absent."""
    from pydtnn.checkpoint import CONFIG_FILE
    from pydtnn.cli import CONFIG_LIMIT
    from pydtnn.files import read_bytes

    path = os.path.join(directory, CONFIG_FILE)  # written beside the checkpoint by pydtnn.resume.save_checkpoint
    try:
        raw = read_bytes(path, "checkpoint configuration", CONFIG_LIMIT, DataError)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise DataError(f"{path} is not valid JSON; expected the configuration pydtnn-train writes") from None
    effective = doc.get("effective") if isinstance(doc, dict) else None
    shape = effective.get("data_shape") if isinstance(effective, dict) else None
    if shape is None:
        return None
    if not (isinstance(shape, list) and len(shape) == 3
            and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
        raise DataError(f"{path}: effective data_shape {shape!r:.80} is not [C, H, W] of positive integers")
    return tuple(shape)


def build_parser():
    from pydtnn.argtypes import Parser, parse_bool, positive_int, sample_shape
    from pydtnn.data.datasets import NAMES

    p = Parser(prog="pydtnn-export", allow_abbrev=False,
               description="Write a pydtnn model (a checkpoint, or a zoo architecture) as an ONNX graph for inference.")
    p.add_argument("output", help="ONNX file to write (replaced atomically; its folder must exist)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory written by pydtnn-train --checkpoint_dir")
    src.add_argument("--model", help="zoo architecture (pydtnn-train --list_models), untrained unless --weights")
    p.add_argument("--input_shape", "--input-shape", dest="input_shape", type=sample_shape,
                   help="with --model: C,H,W without the batch (default: the architecture's dataset, or what "
                        "--dataset's images become, as pydtnn-train builds it)")
    p.add_argument("--num_classes", "--num-classes", dest="num_classes", type=positive_int,
                   help="with --model: number of classes (default: the architecture's dataset)")
    p.add_argument("--weights", help="with --model: a .safetensors state dict (ours or PyTorch's, same names)")
    p.add_argument("--model_file", "--model-file", dest="model_file",
                   help="with --checkpoint: the Python file the model was trained from (pydtnn-train --model_file)")
    p.add_argument("--dataset", choices=NAMES, metavar="NAME",
                   help=f"the data the model was trained on ({', '.join(NAMES)}), recorded in the graph's metadata; "
                        f"a checkpoint records its own")
    p.add_argument("--with_preprocessing", "--with-preprocessing", dest="with_preprocessing", type=parse_bool,
                   nargs="?", const=True, default=False, metavar="BOOL",
                   help="the graph takes the dataset's uint8 images (N, C, H, W) as stored and itself scales, "
                        "normalizes and pads them as training did (default false: float32 input, preprocessed)")
    p.add_argument("--opset", type=positive_int, default=17, help=f"ONNX opset, {MIN_OPSET} or later (default 17)")
    p.add_argument("--batch_size", "--batch-size", dest="batch_size", type=positive_int, default=None,
                   help="fixed batch dimension (default: dynamic)")
    return p


def inputs_of(args):
    """[(what, path)] of every file the command reads: each file of the checkpoint (and of a checkpoint
    given as --weights), under its name and its temporary name, or the --weights file."""
    from pydtnn.checkpoint import ALL_FILES, TMP

    def checkpoint_files(directory, what):
        return [(what, os.path.join(directory, name + tmp)) for name in ALL_FILES for tmp in ("", TMP)]

    if args.checkpoint is not None:
        return checkpoint_files(args.checkpoint, "checkpoint file") + [("model file", args.model_file)] * bool(
            args.model_file)
    if args.weights is not None and os.path.isdir(args.weights):
        return checkpoint_files(args.weights, "weights checkpoint file")
    return [("weights file", args.weights)] if args.weights is not None else []


def export_from_args(args):
    """Check the output, build (or load) the model the flags name and write it; returns (model, input
    contract or None, path)."""
    from pydtnn import checkpoint
    from pydtnn.data.datasets import TEXT
    from pydtnn.files import TMP, check_distinct, check_writable

    if args.model_file is not None and args.checkpoint is None:
        raise ConfigError(f"--model_file {args.model_file} goes with --checkpoint (the model a checkpoint was trained "
                          f"from); with --model, export a zoo architecture")
    check_writable(args.output, "ONNX file")  # before any work: a bad output path costs nothing
    check_distinct([("ONNX file", args.output), ("ONNX file's temporary name", args.output + TMP)], inputs_of(args))
    _import_onnx()  # before a model is built: say what is missing first
    if args.checkpoint is not None:
        extra = [f"--{k}" for k in ("input_shape", "num_classes", "weights") if getattr(args, k) is not None]
        if extra:
            raise ConfigError(f"{', '.join(extra)} only go with --model; a checkpoint already holds its shape, "
                              f"classes and weights")
        manifest = checkpoint.read_manifest(args.checkpoint)
        where = os.path.join(args.checkpoint, checkpoint.META_FILE)
        dataset = trained_on(manifest, where)
        if args.dataset is not None and dataset is not None and args.dataset != dataset:
            raise ConfigError(f"--dataset {args.dataset}: the checkpoint {args.checkpoint} was trained on {dataset}; "
                              f"leave --dataset out")
        dataset = dataset or args.dataset
        if dataset in TEXT:  # token ids in, nothing to preprocess: the graph takes them as float32, as the model does
            if args.with_preprocessing:
                raise ConfigError(f"--with_preprocessing: the checkpoint {args.checkpoint} was trained on the text "
                                  f"dataset {dataset}, whose model takes token ids, not images; leave it out")
            dataset = None
        _check_preprocessing(args, dataset, f"the checkpoint {args.checkpoint} does not say what data it was "
                                            f"trained on")
        model = model_from_checkpoint(args.checkpoint, manifest, args.model_file)
        contract = None if dataset is None else input_contract(dataset, model.input_shape,
                                                               recorded_data_shape(args.checkpoint))
    else:
        _check_preprocessing(args, args.dataset, "--model does not say what data it was trained on")
        model = _zoo_model(args)
        contract = None if args.dataset is None else input_contract(args.dataset, model.input_shape)
    return model, contract, to_onnx(model, args.output, args.opset, args.batch_size, contract, args.with_preprocessing)


def _check_preprocessing(args, dataset, unknown):
    """ConfigError, before a model is built, where --with_preprocessing has no images to start from."""
    if not args.with_preprocessing:
        return
    if dataset is None:
        raise ConfigError(f"--with_preprocessing needs the dataset the model was trained on, and {unknown}: give "
                          f"--dataset NAME ({image_datasets()})")
    if dataset_pixels(dataset) is None:
        raise ConfigError(f"--with_preprocessing needs a dataset of images; {dataset} data is generated as floats, "
                          f"with no pixels to preprocess: export without --with_preprocessing")


def _zoo_model(args):
    """The --model architecture: for --input_shape (or its default), or, given --dataset alone, the
    variant and input shape pydtnn-train builds for that data (families.resolve, padding included)."""
    from pydtnn import checkpoint, models
    from pydtnn.backends import CPUBackend
    from pydtnn.models.families import resolve, variant

    pixels = None if args.dataset is None or args.input_shape is not None else dataset_pixels(args.dataset)
    if pixels is None:
        model = models.create(args.model, input_shape=args.input_shape, num_classes=args.num_classes,
                              backend=CPUBackend())
    else:
        classes = args.num_classes or pixels.classes or models.defaults(variant(args.model, pixels.shape))[1]
        _, model = resolve(args.model, pixels.shape, classes,
                           build=lambda name, shape: models.create(name, input_shape=shape, num_classes=classes,
                                                                   backend=CPUBackend()))
    if args.weights is not None:
        checkpoint.load_weights(args.weights, model)
    return model


def main(argv=None):
    """`pydtnn-export`: 0 on success; 2 and one line `pydtnn: error: ...` on a user error, no file written."""
    done = {}

    def body():
        done["args"] = build_parser().parse_args(argv)
        done["result"] = export_from_args(done["args"])

    status = command_status(body)
    if status:
        return status
    args, (model, contract, path) = done["args"], done["result"]
    batch = "N" if args.batch_size is None else args.batch_size
    given = describe_input(contract, model.input_shape, args.with_preprocessing, batch)
    print(f"pydtnn-export: wrote {path} ({model.name}, input {given}; output ({batch}, "
          f"{', '.join(map(str, model.output_shape))}), opset {args.opset}, {os.path.getsize(path) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
