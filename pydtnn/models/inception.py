"""GoogLeNet (Inception v1) and Inception v3, as torchvision builds them (without auxiliary heads).

Every convolution is torchvision's BasicConv2d: conv (no bias) - BatchNorm(eps=0.001) - ReLU,
named conv and bn. Branches are the paths of a ConcatenationBlock. GoogLeNet names its branches
(branch1 ... branch4, Sequentials numbered inside); Inception v3 names each convolution directly
in the module (Mixed_5b.branch5x5_1, Mixed_5b.branch5x5_2), so its branch paths have empty names
and their layers are hoisted into the module's namespace.

torchvision's pretrained GoogLeNet and Inception v3 expect transform_input=True, a fixed per-channel
affine map of the input: apply it in the data pipeline. Their state dicts also hold the auxiliary
classifiers (aux1, aux2, AuxLogits), which these models do not build: drop them
(pydtnn.models.convert.torchvision_state_dict does).
"""

from pydtnn.layers import (
    AvgPool2D,
    BatchNorm,
    ConcatenationBlock,
    Conv2D,
    Dense,
    Dropout,
    GlobalAvgPool2D,
    MaxPool2D,
    ReLU,
    Sequential,
)


def conv_bn(filters, kernel_size, stride=1, padding=0):
    """torchvision's BasicConv2d: conv (no bias) - BatchNorm(eps=0.001) - ReLU."""
    return Sequential({
        "conv": Conv2D(filters, kernel_size, stride=stride, padding=padding, use_bias=False),
        "bn": BatchNorm(eps=1e-3), "relu": ReLU(),
    })


# -- GoogLeNet ------------------------------------------------------------------------------------
def googlenet_module(ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj):
    """Inception module: 1x1 | 1x1-3x3 | 1x1-"5x5" | 3x3 max pool-1x1, concatenated.

    The "5x5" branch uses a 3x3 kernel, as torchvision does (its known deviation from the paper,
    kept so that its weights load).
    """
    return ConcatenationBlock(
        conv_bn(ch1x1, 1),
        [conv_bn(ch3x3red, 1), conv_bn(ch3x3, 3, padding=1)],
        [conv_bn(ch5x5red, 1), conv_bn(ch5x5, 3, padding=1)],
        [MaxPool2D(3, stride=1, padding=1), conv_bn(pool_proj, 1)],  # ceil_mode is moot at stride 1
        names=("branch1", "branch2", "branch3", "branch4"),
    )


GOOGLENET_MODULES = {  # name: (ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj); "pool": max pool
    "inception3a": (64, 96, 128, 16, 32, 32),
    "inception3b": (128, 128, 192, 32, 96, 64),
    "maxpool3": (3, 2),
    "inception4a": (192, 96, 208, 16, 48, 64),
    "inception4b": (160, 112, 224, 24, 64, 64),
    "inception4c": (128, 128, 256, 24, 64, 64),
    "inception4d": (112, 144, 288, 32, 64, 64),
    "inception4e": (256, 160, 320, 32, 128, 128),
    "maxpool4": (2, 2),
    "inception5a": (256, 160, 320, 32, 128, 128),
    "inception5b": (384, 192, 384, 48, 128, 128),
}


def googlenet(stem, num_classes, dropout=0.2):
    """stem, nine Inception modules with ceil-mode max pools between stages, global average
    pooling, dropout and fc (1024 -> num_classes)."""
    body = {
        name: MaxPool2D(*args, ceil_mode=True) if name.startswith("maxpool") else googlenet_module(*args)
        for name, args in GOOGLENET_MODULES.items()
    }
    return Sequential({
        **stem, **body, "avgpool": GlobalAvgPool2D(), "dropout": Dropout(dropout),
        "fc": Dense(num_classes, weight_init="glorot_uniform"),
    })


def googlenet_imagenet(input_shape=(3, 224, 224), num_classes=1000, dropout=0.2):
    """torchvision's googlenet(aux_logits=False): 6,624,904 parameters."""
    stem = {
        "conv1": conv_bn(64, 7, stride=2, padding=3), "maxpool1": MaxPool2D(3, stride=2, ceil_mode=True),
        "conv2": conv_bn(64, 1), "conv3": conv_bn(192, 3, padding=1), "maxpool2": MaxPool2D(3, stride=2, ceil_mode=True),
    }
    return googlenet(stem, num_classes, dropout)


def googlenet_cifar10(input_shape=(3, 32, 32), num_classes=10, dropout=0.2):
    """GoogLeNet for 32x32 inputs (as kuangliu/pytorch-cifar): the ImageNet stem (conv1 ...
    maxpool2) becomes one 3x3 BasicConv2d with 192 channels, so inception3a/3b run at 32x32,
    4a-4e at 16x16 and 5a/5b at 8x8. 5,490,986 parameters for 10 classes."""
    return googlenet({"conv1": conv_bn(192, 3, padding=1)}, num_classes, dropout)


# -- Inception v3 ---------------------------------------------------------------------------------
def _pool_branch(pool_features):
    """3x3/1 average pool (zero padding counted, as F.avg_pool2d) - 1x1 BasicConv2d."""
    return {"avgpool": AvgPool2D(3, stride=1, padding=1), "branch_pool": conv_bn(pool_features, 1)}


def _split(name_a, conv_a, name_b, conv_b):
    """Two convolutions on the same input, concatenated (InceptionE's 1x3 | 3x1 pairs)."""
    return ConcatenationBlock({name_a: conv_a}, {name_b: conv_b}, names=("", ""))


def _module(*branches):
    """Concatenation of branch dicts, each hoisted into the module's namespace."""
    return ConcatenationBlock(*branches, names=("",) * len(branches))


def inception_a(pool_features):
    """35x35 module: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | pool-1x1 (64 + 64 + 96 + pool_features)."""
    return _module(
        {"branch1x1": conv_bn(64, 1)},
        {"branch5x5_1": conv_bn(48, 1), "branch5x5_2": conv_bn(64, 5, padding=2)},
        {"branch3x3dbl_1": conv_bn(64, 1), "branch3x3dbl_2": conv_bn(96, 3, padding=1),
         "branch3x3dbl_3": conv_bn(96, 3, padding=1)},
        _pool_branch(pool_features),
    )


def inception_b():
    """Grid reduction 35 -> 17: 3x3/2 | 1x1-3x3-3x3/2 | 3x3/2 max pool."""
    return _module(
        {"branch3x3": conv_bn(384, 3, stride=2)},
        {"branch3x3dbl_1": conv_bn(64, 1), "branch3x3dbl_2": conv_bn(96, 3, padding=1),
         "branch3x3dbl_3": conv_bn(96, 3, stride=2)},
        {"maxpool": MaxPool2D(3, stride=2)},
    )


def inception_c(c7):
    """17x17 module with factorized 7x7 convolutions (1x7 and 7x1), c7 inner channels; 768 out."""
    return _module(
        {"branch1x1": conv_bn(192, 1)},
        {"branch7x7_1": conv_bn(c7, 1), "branch7x7_2": conv_bn(c7, (1, 7), padding=(0, 3)),
         "branch7x7_3": conv_bn(192, (7, 1), padding=(3, 0))},
        {"branch7x7dbl_1": conv_bn(c7, 1), "branch7x7dbl_2": conv_bn(c7, (7, 1), padding=(3, 0)),
         "branch7x7dbl_3": conv_bn(c7, (1, 7), padding=(0, 3)), "branch7x7dbl_4": conv_bn(c7, (7, 1), padding=(3, 0)),
         "branch7x7dbl_5": conv_bn(192, (1, 7), padding=(0, 3))},
        _pool_branch(192),
    )


def inception_d():
    """Grid reduction 17 -> 8: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | 3x3/2 max pool."""
    return _module(
        {"branch3x3_1": conv_bn(192, 1), "branch3x3_2": conv_bn(320, 3, stride=2)},
        {"branch7x7x3_1": conv_bn(192, 1), "branch7x7x3_2": conv_bn(192, (1, 7), padding=(0, 3)),
         "branch7x7x3_3": conv_bn(192, (7, 1), padding=(3, 0)), "branch7x7x3_4": conv_bn(192, 3, stride=2)},
        {"maxpool": MaxPool2D(3, stride=2)},
    )


def inception_e():
    """8x8 module with expanded filter banks: 1x1 | 1x1-(1x3|3x1) | 1x1-3x3-(1x3|3x1) | pool-1x1; 2048 out."""
    return _module(
        {"branch1x1": conv_bn(320, 1)},
        {"branch3x3_1": conv_bn(384, 1),
         "": _split("branch3x3_2a", conv_bn(384, (1, 3), padding=(0, 1)),
                    "branch3x3_2b", conv_bn(384, (3, 1), padding=(1, 0)))},
        {"branch3x3dbl_1": conv_bn(448, 1), "branch3x3dbl_2": conv_bn(384, 3, padding=1),
         "": _split("branch3x3dbl_3a", conv_bn(384, (1, 3), padding=(0, 1)),
                    "branch3x3dbl_3b", conv_bn(384, (3, 1), padding=(1, 0)))},
        _pool_branch(192),
    )


def inceptionv3_imagenet(input_shape=(3, 299, 299), num_classes=1000, dropout=0.5):
    """torchvision's inception_v3(aux_logits=False): 23,834,568 parameters (27,161,264 with the
    AuxLogits head, which this model leaves out). Inputs of at least 75x75."""
    return Sequential({
        "Conv2d_1a_3x3": conv_bn(32, 3, stride=2), "Conv2d_2a_3x3": conv_bn(32, 3),
        "Conv2d_2b_3x3": conv_bn(64, 3, padding=1), "maxpool1": MaxPool2D(3, stride=2),
        "Conv2d_3b_1x1": conv_bn(80, 1), "Conv2d_4a_3x3": conv_bn(192, 3), "maxpool2": MaxPool2D(3, stride=2),
        "Mixed_5b": inception_a(32), "Mixed_5c": inception_a(64), "Mixed_5d": inception_a(64),
        "Mixed_6a": inception_b(),
        "Mixed_6b": inception_c(128), "Mixed_6c": inception_c(160), "Mixed_6d": inception_c(160),
        "Mixed_6e": inception_c(192),
        "Mixed_7a": inception_d(), "Mixed_7b": inception_e(), "Mixed_7c": inception_e(),
        "avgpool": GlobalAvgPool2D(), "dropout": Dropout(dropout),
        "fc": Dense(num_classes, weight_init="glorot_uniform"),
    })
