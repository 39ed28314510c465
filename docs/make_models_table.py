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
`densenet201`, `densenet100` (DenseNet-BC-100), `alexnet`, `googlenet`, `inceptionv3`, `mobilenetv1`,
`vit` (`vit_tiny`) and `vit_small`, and for text `gpt` (`gpt_nano`; `gpt_mini` by its name). It picks the variant
that fits the data (`pydtnn/models/families.py`), and the run's header says which:

- A family with a CIFAR-10 and an ImageNet variant takes the CIFAR-10 one for images of at most 64
  pixels a side and the ImageNet one for larger images. A family with one variant takes it.
- A model adapts to the data in two ways only: its first layer takes the data's channels, its last
  layer gives the data's classes. The header lists each adaptation (`first layer takes 1 channel
  (designed for 3)`); the architecture is otherwise the named one.
- A token model (`gpt_nano`, `gpt_mini`) takes windows of token ids from a text dataset (docs/datasets.md,
  "Text"): its context is the window (`--context_length`, default the design's 128 or 256) and its vocabulary
  the text's (`a vocabulary of 111 tokens (designed for 256)`). A token model given images, or an image model
  given text, stops with one line naming what it takes.
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
  decay, for 7 epochs; MobileNet v1 takes 0.025 (at 0.05 per process its loss climbs from 2.7 to 6);
  the ViTs take AdamW (0.001 per process, weight decay 0.01) with a cosine decay for 4 epochs (with SGD
  the loss was still 2.1 after 115 updates on Fashion-MNIST, with AdamW 1.3 after 68); the GPTs take AdamW
  with a cosine decay too, for 5 epochs.
  The flags override any of these. tests/test_families.py runs each kind of family's defaults on the
  digits (one member where others of its kind only add depth: VGG-11, VGG-16, VGG-11-BN, ResNet-20, -110, -18
  and -50, DenseNet-121 on larger images), and the GPT's on a text, as two processes would, and checks that the
  loss falls.
- `vit` at its defaults on Fashion-MNIST (`mpiexec -n 2 python -m pydtnn --model vit --dataset fashion_mnist
  --dataset_train_path /usr/share/datasets/fashion-mnist`, the Debian package `dataset-fashion-mnist`): 4
  epochs of AdamW at 0.002 (0.001 x 2 processes) with a cosine decay ended at 85.6% test accuracy (`final:
  test_loss 0.3924, test_accuracy 0.8563`) in 12 min 15 s on a two-core AMD EPYC (AVX2) virtual machine,
  332 samples/s; after 3 epochs (the same schedule over 3) it was 84.9%.
- `gpt` at its defaults on the fortunes text (`mpiexec -n 2 python -m pydtnn --model gpt --dataset text
  --checkpoint_dir gpt`, the Debian package `fortunes`): 5 epochs (705 updates) of AdamW at 0.002 (0.001 x 2
  processes) with a cosine decay ended at a test loss of 2.186 nats a character, 3.15 bits, perplexity 8.9
  (`final: test_loss 2.186, test_accuracy 0.3774, test_bits_per_token 3.154, test_perplexity 8.904`), in 8 min
  29 s on the same two-core AMD EPYC (AVX2), 179 samples/s. `pydtnn-generate --checkpoint gpt --prompt "The
  secret of life is" --tokens 300 --seed 1` then writes "The secret of life is way it of oor lan everysine what
  prane / ost the brough aris earss corudes of tither the inald / be siring the you ever is one lie for with
  with dees thaw foor ine whis it your is": the common words (the, of, is, what, with, your, one, for, ever)
  among misspelt ones, what 222,575 parameters learn from 2.3 MB of text in 705 updates.

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
  - `vit_tiny_cifar10` and `vit_small_cifar10`: vision transformers (Dosovitskiy et al. 2021) on 4x4
    patches, a class token, learned positions, 6 pre-norm blocks of 4 heads (dim 64 and MLP 128; dim 128
    and MLP 256), a final LayerNorm and a head on the class token (`pydtnn/models/transformer.py`).
    Smaller than ImageNet's ViT-Ti/S (dim 192/384, 12 blocks), sized to train on two CPU cores in
    minutes; any image whose sides are multiples of 4 works. The conv/dense column counts the patch
    convolution and the Dense layers, not the attention's projections.
- **Text models** (`gpt_nano`, `gpt_mini`; input: T token ids, output: T x vocabulary next-token logits):
  GPT-2's layout as nanoGPT writes it (Radford et al. 2019): token and learned position embeddings, pre-norm
  blocks with causal self-attention and a GELU MLP of 4x the width, a final LayerNorm and a linear head at
  every position (not tied to the embedding). `gpt_nano`: dim 64, 4 blocks of 4 heads, context 128;
  `gpt_mini`: dim 128, 6 blocks of 8 heads, context 256. Listed with 256 byte tokens; a character vocabulary
  makes the embedding and head smaller (`gpt_nano` on the fortunes text: 222,575 parameters).
  `pydtnn-generate --checkpoint DIR --prompt TEXT [--tokens 200] [--temperature 0.8] [--top_k 40]
  [--samples 1] [--seed 0]` samples text from a trained one with the vocabulary its checkpoint holds: each
  token drawn from the softmax of the logits over the temperature, among the top_k most likely (0: all;
  temperature 0: the most likely), given the last T tokens; a character outside the vocabulary in the prompt
  is refused in one line.
- **MNIST**: `lenet5` (LeCun et al. 1998, tanh and average pooling, full C3 connectivity),
  `simplecnn`, `simplemlp`.

## Export to ONNX

Any built model exports to an ONNX graph for inference (BatchNorm on its running statistics, Dropout
as the identity), to run in onnxruntime, TensorRT or anything else that reads ONNX. It needs the
`onnx` package (`pip install -e ".[onnx]"`); `import pydtnn` does not.

```python
from pydtnn.export import input_contract, to_onnx
to_onnx(model, "resnet50.onnx")                  # opset=17, batch_size=None (a dynamic batch "N")
to_onnx(model, "digits.onnx", contract=input_contract("mnist5k", model.input_shape),
        with_preprocessing=True)                 # the graph takes uint8 digits as stored
```

```
pydtnn-export net.onnx --checkpoint ckpt/        # a checkpoint written by pydtnn-train --checkpoint_dir
pydtnn-export net.onnx --model resnet18_imagenet --input_shape 3,64,64 --num_classes 100 \\
              --weights resnet18.safetensors     # a zoo architecture; untrained without --weights
pydtnn-export net.onnx --checkpoint ckpt/ --with_preprocessing        # input: raw uint8 images
pydtnn-export net.onnx --model resnet20 --dataset mnist --with_preprocessing
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
again for another input size. The transformer layers (`pydtnn/onnx_transformer.py`) map to
LayerNormalization (opset 17 or later; an earlier `--opset` is refused in one line), Erf or Tanh
compositions for GELU, Gather for Embedding and class-token pooling, Expand and Concat for the class
token, ReduceMean for mean pooling, and MatMul / Reshape / Transpose / Softmax for attention, its causal
mask an added constant; a token model's `input` holds the ids as float32. The graph is checked with `onnx.checker` (shapes included) before the
file is written (under a temporary name, then renamed). A layer type with no ONNX mapping (a custom
Layer subclass) is a ConfigError naming the layer and its type; `pydtnn-export` reports it, like any
user error, as one line `pydtnn: error: ...` with exit code 2 and leaves no file.

**The output is checked before any work.** Its folder must exist (a missing one is refused, never
created), nothing but a regular file may stand at its name (a FIFO or a device is refused), and it may
not be a file the command reads: a file of the checkpoint (`model.safetensors`,
`optimizer.safetensors`, `meta.json`, `config.json`, or their `.tmp` names), the `--weights` file, or
a symbolic or hard link to one of them. An input shape whose parameters need more memory than the
machine has is refused when the layer is built, before anything is allocated (one line naming the
layer, the parameter's shape and the memory; pydtnn-train refuses it the same way), and a graph over
protobuf's 2 GB (adaptive-pooling matrices for a huge input included) before it is made.

**What the input holds.** A model is only as good as the input it is given, so the graph says what
that is. pydtnn-train feeds a model its dataset's uint8 pixels divided by 255 (IDX digits, CIFAR,
ImageNet; float files already in [0, 1] are used as they are), then for CIFAR-10/100 and ImageNet
minus the dataset's per-channel mean and divided by its std (docs/datasets.md), and, when a family
variant was built for larger images, zero-padded (black pixels, before normalization), centred, to
the variant's design size: 28x28 digits become 32x32 for `resnet20` or `vgg16`. ImageNet images are
first resized (shorter side 256) and centre-cropped to 224x224 by the loader; that stays outside the
graph. The export records this contract in the graph's `metadata_props` and `doc_string`, and
prints it in its success line:

| key | value |
|---|---|
| `pydtnn.input` | one sentence, e.g. `float32 NCHW (N, 1, 32, 32): mnist5k images, pixels / 255; 1x28x28 images zero-padded (...), centred, to 1x32x32 (2 rows top, 2 bottom, 2 columns left, 2 right)` |
| `pydtnn.dataset` | the dataset's name (`mnist5k`, `cifar10`, ...) |
| `pydtnn.normalization` | JSON `{"scale": 1/255, "mean": [...] or null, "std": [...] or null}`: input = (pixels * scale - mean) / std per channel |
| `pydtnn.padding` | JSON `{"data_shape": [C, H, W], "input_shape": [C, H2, W2], "top", "left", "bottom", "right"}` |
| `pydtnn.preprocessing` | `outside the graph`, or `in the graph` with `--with_preprocessing` |

A checkpoint says which dataset it was trained on (its saved `--dataset`, or `synthetic` with
`--use_synthetic_data`); the size of the images before padding comes from `config.json`'s effective
`data_shape` when the run recorded it, else from the dataset's usual size (28x28 digits, 32x32 CIFAR,
224x224 ImageNet) where the trainer pads that to the model's input, else it is the model's input
size. With `--model`, `--dataset NAME` records the data (and, without `--input_shape`, builds the
variant and input shape pydtnn-train builds for that data); without it the metadata says the data is
not recorded. A checkpoint that records no dataset takes `--dataset`; one that records another is
refused.

**`--with_preprocessing`** puts the contract into the graph: `input` is then the dataset's images
as stored, uint8 (N, C, H, W) of the dataset's size (1x28x28 for the digits), and the graph itself
computes Cast, Pad (zeros, when the model pads), Mul by 1/255, Sub mean and Div std (when the dataset
normalizes), with standard operators, in the order and precision the data loaders use. It needs a
dataset of images: `--model` without `--dataset` (or a checkpoint that records none), and synthetic
data, are refused with one line before a model is built.
"""


def leaf_layers(model):
    return [layer for _, layer in model.layers() if not isinstance(layer, Container)]


def facts(name):
    """(input shape, classes, parameters, forward GFLOPs per sample, conv/dense layers, leaf layers) of
    `name` built at its default input shape."""
    model = models.create(name)
    leaves = leaf_layers(model)
    weight_layers = sum(isinstance(layer, (Conv2D, Dense)) for layer in leaves)
    return (tuple(model.input_shape), model.output_shape[-1], model.count_params(), round(model.flops() / 1e9, 3),
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
