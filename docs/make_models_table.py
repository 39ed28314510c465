"""Write docs/models.md: every registered model, built at its default input shape.

    python docs/make_models_table.py            # from the repository root; about a minute

It also writes pydtnn/models/catalog.py, the same facts as data for `pydtnn-train --list_models`.

Parameters are Model.count_params() (trainable scalars; BatchNorm running statistics excluded),
GFLOPs are Model.flops() (forward, per sample, a multiply-add counting 2), and the layer counts
come from the built layer tree. Nothing here is typed in by hand except the notes below.
"""

import gc
import sys
from pathlib import Path

from pydtnn import models
from pydtnn.layers import Container, Conv2D, Dense

HEADER = """\
# Model zoo

`pydtnn.models.names()` lists these; `pydtnn.models.create(name, input_shape=None, num_classes=None,
backend=None, **options)` builds one (`--model NAME` on the command line). Each model is built at
its default input shape (C, H, W) and number of classes. *Parameters*: trainable scalars
(`Model.count_params()`, BatchNorm running statistics excluded). *GFLOPs*: forward floating-point
operations per sample (`Model.flops()`, a multiply-add counts 2). *Conv/dense*: Conv2D and Dense
layers, projection shortcuts included. *Layers*: all leaf layers (activations, pooling, BatchNorm...).

"""

NOTES = """
## Family names and other data

`--model` (and `pydtnn.models.create`) also takes a family name: `vgg11` ... `vgg19`, `vgg11bn` ...
`vgg19bn`, `resnet18` ... `resnet152`, `resnet20` ... `resnet110`, `densenet121`, `densenet169`,
`densenet201`, `densenet100` (DenseNet-BC-100), `alexnet`, `googlenet`, `inceptionv3`, `mobilenetv1`.
It picks the variant that fits the data (`pydtnn/models/families.py`), and the run's header says
which:

- A family with a CIFAR-10 and an ImageNet variant takes the CIFAR-10 one for images of at most 64
  pixels a side and the ImageNet one for larger images. A family with one variant takes it.
- A model adapts to the data in two ways only: its first layer takes the data's channels, its last
  layer gives the data's classes. The header lists each adaptation (`first layer takes 1 channel
  (designed for 3)`); the architecture is otherwise the named one.
- Images smaller than the variant's design size are zero-padded, centred, up to it when that takes
  at most 1.5 times the pixels: the embedded 28x28 digits become 32x32 for every CIFAR-10 variant,
  so `pydtnn-train --model vgg16` trains VGG-16 as designed for 32x32 images. Otherwise the model is
  built for the images as they are (the ImageNet variants end in adaptive pooling: `resnet50` trains
  on 28x28 digits); a model that cannot take them (`inceptionv3`, `densenet121`, `vgg16_imagenet` on
  28x28) stops with one line naming a dataset and the models that fit.
- Each family trains from its default initialization with the command line's defaults (SGD, momentum
  0.9, 0.05 per process, 64 samples per process, 10 epochs), except where `RECIPES` in
  `pydtnn/models/families.py` says otherwise: VGG without BatchNorm sits on a plateau for its first
  hundred or so updates and dies at 0.05, so it takes 16 samples per process at 0.005 with a cosine
  decay, for 7 epochs; MobileNet v1 takes 0.025 (at 0.05 per process its loss climbs from 2.7 to 6).
  The flags override any of these. tests/test_families.py runs every family's defaults on the digits,
  as two processes would, and checks that the loss falls.

## Where the architectures come from

- **ImageNet models** (`*_imagenet`) reproduce torchvision's architectures and state-dict names
  (`features.0.weight`, `layer1.0.downsample.0.weight`, `features.denseblock1.denselayer1.norm1.weight`,
  `inception3a.branch2.1.conv.weight`, `Mixed_7c.branch3x3dbl_3b.bn.running_var`, ...), and their
  parameter counts equal torchvision's. A torchvision state dict saved with safetensors loads with
  `model.load_state_dict(pydtnn.models.convert.torchvision_state_dict(safetensors.numpy.load_file(path)))`,
  which drops BatchNorm's `num_batches_tracked` and the auxiliary classifiers.
  - GoogLeNet and Inception v3 are built without their auxiliary classifiers (`aux_logits=False`):
    6,624,904 and 23,834,568 parameters (13,004,888 and 27,161,264 with them). torchvision's pretrained
    weights for both expect `transform_input=True`, a fixed per-channel affine map of the input that
    belongs in the data pipeline. GoogLeNet's "5x5" branch uses a 3x3 kernel, as torchvision's does.
  - ResNets are torchvision's v1.5 (stride in the 3x3 convolution of bottleneck blocks). Every ResNet,
    ImageNet and CIFAR-10, starts each residual block as its shortcut: the block's last BatchNorm
    weight is 0 (torchvision's `zero_init_residual=True`, Goyal et al. 2017). With torchvision's default
    (option `zero_init_residual=False`) ResNet-50 starts at a loss of 3.8 on ten classes, against
    ln 10 = 2.3, and at the usual learning rate of 0.1 its loss climbs past 20 in its first updates.
  - VGG and AlexNet end their features with adaptive average pooling (7x7, 6x6), so smaller inputs work.
  - MobileNet v1 follows Keras's `MobileNet(alpha=1.0)` (Keras names: `conv_dw_1`, `conv_pw_1_bn`,
    `conv_preds`; 4,231,976 trainable parameters) with ReLU for ReLU6 and PyTorch BatchNorm defaults.
    Option `alpha` scales the width.
- **CIFAR-10 models** (`*_cifar10`, 3x32x32):
  - `resnet{20,32,44,56,110}_cifar10`: He et al. 2016 (section 4.2), 16/32/64 channels, option-B
    shortcuts (1x1 convolution + BatchNorm where the shape changes): ResNet-20 has 272,474 parameters
    (269,722 with option A's parameter-free shortcuts).
  - `densenet_cifar10`: DenseNet-BC-100 with growth rate 12 (Huang et al. 2017). Options `block_config`
    and `growth_rate`: `block_config=(6, 12, 24, 16)` gives PyDTNN's densenet_cifar10.
  - `vgg*_cifar10` and `alexnet_cifar10`: PyDTNN's definitions (torchvision's VGG features with a
    512-4096-4096 classifier; AlexNet with 3x3 convolutions), with torchvision's names.
  - `googlenet_cifar10`: torchvision's GoogLeNet with its stem replaced by one 3x3 convolution of 192
    channels (as kuangliu/pytorch-cifar). `mobilenetv1_cifar10`: MobileNet v1 with a stride-1 stem.
- **MNIST**: `lenet5` (LeCun et al. 1998, tanh and average pooling, full C3 connectivity),
  `simplecnn`, `simplemlp`.

## Export to ONNX

Any built model exports to an ONNX graph for inference (BatchNorm on its running statistics, Dropout
as the identity), to run in onnxruntime, TensorRT or anything else that reads ONNX. It needs the
`onnx` package (`pip install -e ".[onnx]"`); `import pydtnn` does not.

```python
from pydtnn.export import to_onnx
to_onnx(model, "resnet50.onnx")                  # opset=17, batch_size=None (a dynamic batch "N")
```

```
pydtnn-export net.onnx --checkpoint ckpt/        # a checkpoint written by pydtnn-train --checkpoint_dir
pydtnn-export net.onnx --model resnet18_imagenet --input_shape 3,64,64 --num_classes 100 \\
              --weights resnet18.safetensors     # a zoo architecture; untrained without --weights
```

(`python -m pydtnn.export` is the same command; `--opset N` (13 or later) and `--batch_size N`
apply to both forms.) The graph takes `input` (N, C, H, W) float32 and gives `output` (N, classes);
a float64 model's weights are rounded to float32. Initializers are named as in the state dict
(`features.0.weight`, `layer1.0.bn1.running_var`). Every layer of the zoo maps to standard operators:
Conv2D to Conv (strides, dilation, groups, 'same' padding as explicit, possibly asymmetric pads),
Dense to Gemm, pools to MaxPool (ceil_mode as extra bottom/right padding) and AveragePool (zero
padding counted, `count_include_pad=1`, as pydtnn does), residual and concatenation blocks to Sum and
Concat, ReLU6 to Clip. AdaptiveAvgPool2D is exported for the input size the model was built with: an
AveragePool when the bins are equal, otherwise a MatMul with the exact bin-averaging matrix; export
again for another input size. The graph is checked with `onnx.checker` (shapes included) before the
file is written (under a temporary name, then renamed). A layer type with no ONNX mapping (a custom
Layer subclass) is a ConfigError naming the layer and its type; `pydtnn-export` reports it, like any
user error, as one line `pydtnn: error: ...` with exit code 2 and leaves no file.
"""


def leaf_layers(model):
    return [layer for _, layer in model.layers() if not isinstance(layer, Container)]


def facts(name):
    """(input shape, classes, parameters, forward GFLOPs per sample, conv/dense layers, leaf layers) of
    `name` built at its default input shape."""
    model = models.create(name)
    leaves = leaf_layers(model)
    weight_layers = sum(isinstance(layer, (Conv2D, Dense)) for layer in leaves)
    return (tuple(model.input_shape), model.output_shape[0], model.count_params(), round(model.flops() / 1e9, 3),
            weight_layers, len(leaves))


def row(name, f):
    shape, classes, params, gflops, weight_layers, leaves = f
    return f"| `{name}` | {'x'.join(map(str, shape))} | {classes} | {params:,} | {gflops:.3f} | {weight_layers} | {leaves} |"


CATALOG_HEADER = '''"""Facts of every registered model at its default input shape, for `--list_models` (no model is built).

Generated by `python docs/make_models_table.py`; do not edit by hand. tests/test_models.py checks
these against built models.
"""

# name: (input shape, classes, trainable parameters, forward GFLOPs per sample, conv/dense layers, leaf layers)
CATALOG = {
'''


def main(out=Path(__file__).with_name("models.md"), catalog=Path(__file__).parents[1] / "pydtnn/models/catalog.py"):
    lines = [
        "| model | input | classes | parameters | GFLOPs | conv/dense | layers |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    entries = []
    for name in models.names():
        f = facts(name)
        lines.append(row(name, f))
        entries.append(f"    {name!r}: {f!r},")
        print(lines[-1], file=sys.stderr, flush=True)
        gc.collect()  # the VGG models hold 0.5 GB each; free one before building the next
    generated = "Generated by `python docs/make_models_table.py`; do not edit by hand.\n\n"
    out.write_text(HEADER + generated + "\n".join(lines) + "\n" + NOTES)
    catalog.write_text(CATALOG_HEADER + "\n".join(entries) + "\n}\n")
    print(f"wrote {out} and {catalog}", file=sys.stderr)


if __name__ == "__main__":
    main()
