"""Residual networks: torchvision's ImageNet ResNets and He et al.'s CIFAR-10 ResNets.

A block is AdditionBlock(main path, shortcut) followed by ReLU. The main path's layers are
hoisted into the block's namespace (empty name) and the projection shortcut is called
"downsample", which reproduces torchvision's state-dict names:

    layer2.0.conv1.weight, layer2.0.bn1.running_mean, ..., layer2.0.downsample.0.weight, downsample.1.*
"""

from pydtnn.errors import ConfigError
from pydtnn.layers import AdditionBlock, BatchNorm, Conv2D, Dense, GlobalAvgPool2D, MaxPool2D, ReLU, Sequential


def _residual(main, out_channels, stride, project):
    """main(x) + shortcut(x), then ReLU. The shortcut is a 1x1 convolution + BatchNorm when the
    shape changes (`project`), otherwise the identity."""
    if project:
        shortcut = [Conv2D(out_channels, 1, stride=stride, use_bias=False), BatchNorm()]
        block = AdditionBlock(main, shortcut, names=("", "downsample"))
    else:
        block = AdditionBlock(main, [], names=("", "identity"))
    return Sequential([("", block), ("relu", ReLU())])


def basic_block(planes, stride=1, project=False, zero_init=True):
    """Two 3x3 convolutions (ResNet-18/34 and the CIFAR ResNets); output `planes` channels.
    zero_init: the last BatchNorm's weight starts at 0, so the block starts as its shortcut."""
    main = {
        "conv1": Conv2D(planes, 3, stride=stride, padding=1, use_bias=False), "bn1": BatchNorm(), "relu1": ReLU(),
        "conv2": Conv2D(planes, 3, padding=1, use_bias=False), "bn2": BatchNorm(weight_init=0.0 if zero_init else 1.0),
    }
    return _residual(main, planes, stride, project)


def bottleneck(planes, stride=1, project=False, zero_init=True):
    """1x1 (planes) - 3x3 (planes, carries the stride: "ResNet v1.5", as torchvision) - 1x1
    (4 * planes) (ResNet-50/101/152). zero_init: as basic_block's."""
    main = {
        "conv1": Conv2D(planes, 1, use_bias=False), "bn1": BatchNorm(), "relu1": ReLU(),
        "conv2": Conv2D(planes, 3, stride=stride, padding=1, use_bias=False), "bn2": BatchNorm(), "relu2": ReLU(),
        "conv3": Conv2D(4 * planes, 1, use_bias=False), "bn3": BatchNorm(weight_init=0.0 if zero_init else 1.0),
    }
    return _residual(main, 4 * planes, stride, project)


BLOCKS = {"basic": (basic_block, 1), "bottleneck": (bottleneck, 4)}


def _stages(block, layers, widths, in_channels, zero_init=True):
    """{"layer1": Sequential(blocks), ...}; every stage after the first halves H and W."""
    make, expansion = BLOCKS[block]
    stages, channels = {}, in_channels
    for i, (planes, n) in enumerate(zip(widths, layers)):
        blocks = []
        for b in range(n):
            stride = 2 if i > 0 and b == 0 else 1
            blocks.append(make(planes, stride, project=stride != 1 or channels != planes * expansion,
                               zero_init=zero_init))
            channels = planes * expansion
        stages[f"layer{i + 1}"] = Sequential(blocks)
    return stages


def resnet(block, layers, num_classes, zero_init_residual=True):
    """torchvision's ResNet: 7x7/2 stem + 3x3/2 max pool, four stages (64, 128, 256, 512 planes),
    global average pooling and fc. block: "basic" or "bottleneck"; layers: blocks per stage.

    zero_init_residual: each block's last BatchNorm weight starts at 0 (torchvision's option of that
    name, Goyal et al. 2017), so that the network starts shallow: without it, the deep ResNets start
    at a loss far above ln(classes) and diverge at the usual learning rate of 0.1 (docs/models.md).
    """
    stem = {
        "conv1": Conv2D(64, 7, stride=2, padding=3, use_bias=False), "bn1": BatchNorm(), "relu": ReLU(),
        "maxpool": MaxPool2D(3, stride=2, padding=1),
    }
    return Sequential({
        **stem, **_stages(block, layers, (64, 128, 256, 512), 64, zero_init_residual),
        "avgpool": GlobalAvgPool2D(), "fc": Dense(num_classes, weight_init="glorot_uniform"),
    })


def resnet_cifar(depth, num_classes, zero_init_residual=True):
    """He et al. 2016, section 4.2: 3x3 conv (16), three stages of n = (depth - 2) / 6 basic
    blocks with 16, 32 and 64 channels, global average pooling and fc.

    Shortcuts are option B: identity, except a 1x1 convolution + BatchNorm projection where the
    shape changes (the first block of stages 2 and 3). ResNet-20 has 272,474 parameters (option A,
    zero-padding shortcuts, would have 269,722: the paper's "0.27M"). zero_init_residual: as resnet's.
    """
    if depth < 8 or (depth - 2) % 6:
        raise ConfigError(f"CIFAR ResNet depth must be 6n + 2 (20, 32, 44, 56, 110, ...), got {depth}")
    n = (depth - 2) // 6
    stem = {"conv1": Conv2D(16, 3, padding=1, use_bias=False), "bn1": BatchNorm(), "relu": ReLU()}
    return Sequential({
        **stem, **_stages("basic", (n, n, n), (16, 32, 64), 16, zero_init_residual),
        "avgpool": GlobalAvgPool2D(), "fc": Dense(num_classes, weight_init="glorot_uniform"),
    })


def resnet18_imagenet(input_shape=(3, 224, 224), num_classes=1000, zero_init_residual=True):
    return resnet("basic", (2, 2, 2, 2), num_classes, zero_init_residual)


def resnet34_imagenet(input_shape=(3, 224, 224), num_classes=1000, zero_init_residual=True):
    return resnet("basic", (3, 4, 6, 3), num_classes, zero_init_residual)


def resnet50_imagenet(input_shape=(3, 224, 224), num_classes=1000, zero_init_residual=True):
    return resnet("bottleneck", (3, 4, 6, 3), num_classes, zero_init_residual)


def resnet101_imagenet(input_shape=(3, 224, 224), num_classes=1000, zero_init_residual=True):
    return resnet("bottleneck", (3, 4, 23, 3), num_classes, zero_init_residual)


def resnet152_imagenet(input_shape=(3, 224, 224), num_classes=1000, zero_init_residual=True):
    return resnet("bottleneck", (3, 8, 36, 3), num_classes, zero_init_residual)


def resnet20_cifar10(input_shape=(3, 32, 32), num_classes=10, zero_init_residual=True):
    return resnet_cifar(20, num_classes, zero_init_residual)


def resnet32_cifar10(input_shape=(3, 32, 32), num_classes=10, zero_init_residual=True):
    return resnet_cifar(32, num_classes, zero_init_residual)


def resnet44_cifar10(input_shape=(3, 32, 32), num_classes=10, zero_init_residual=True):
    return resnet_cifar(44, num_classes, zero_init_residual)


def resnet56_cifar10(input_shape=(3, 32, 32), num_classes=10, zero_init_residual=True):
    return resnet_cifar(56, num_classes, zero_init_residual)


def resnet110_cifar10(input_shape=(3, 32, 32), num_classes=10, zero_init_residual=True):
    return resnet_cifar(110, num_classes, zero_init_residual)
