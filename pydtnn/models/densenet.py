"""DenseNet-BC (Huang et al. 2017): torchvision's ImageNet DenseNets and the paper's CIFAR model.

A dense layer is ConcatenationBlock(identity, layer): its output is [x, layer(x)] on the channel
axis, x first, as torchvision's torch.cat([features, new_features]). The block itself has an
empty name, so the layer's parameters read features.denseblock1.denselayer1.norm1.weight, ...
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


def dense_layer(growth_rate, bn_size=4, drop_rate=0.0):
    """BN-ReLU-1x1 conv (bn_size * growth_rate) - BN-ReLU-3x3 conv (growth_rate) [- dropout]."""
    layer = {
        "norm1": BatchNorm(), "relu1": ReLU(), "conv1": Conv2D(bn_size * growth_rate, 1, use_bias=False),
        "norm2": BatchNorm(), "relu2": ReLU(), "conv2": Conv2D(growth_rate, 3, padding=1, use_bias=False),
    }
    if drop_rate:
        layer["dropout"] = Dropout(drop_rate)
    return layer


def dense_block(num_layers, growth_rate, bn_size=4, drop_rate=0.0):
    """num_layers dense layers; adds num_layers * growth_rate channels."""
    layers = [
        ConcatenationBlock([], dense_layer(growth_rate, bn_size, drop_rate), names=("identity", f"denselayer{i + 1}"))
        for i in range(num_layers)
    ]
    return Sequential([("", layer) for layer in layers])


def transition(out_channels):
    """BN-ReLU-1x1 conv-2x2 average pool: compresses the channels and halves H and W."""
    return Sequential({
        "norm": BatchNorm(), "relu": ReLU(), "conv": Conv2D(out_channels, 1, use_bias=False), "pool": AvgPool2D(2),
    })


def densenet(growth_rate, block_config, num_init_features, num_classes, bn_size=4, drop_rate=0.0, stem="imagenet"):
    """features (stem, dense blocks with transitions compressing by 2, norm5), ReLU, global
    average pooling, classifier. stem: "imagenet" (7x7/2 conv + 3x3/2 max pool, torchvision) or
    "cifar" (one 3x3 conv, the paper's CIFAR networks)."""
    if stem == "imagenet":
        features = {
            "conv0": Conv2D(num_init_features, 7, stride=2, padding=3, use_bias=False), "norm0": BatchNorm(),
            "relu0": ReLU(), "pool0": MaxPool2D(3, stride=2, padding=1),
        }
    else:
        features = {"conv0": Conv2D(num_init_features, 3, padding=1, use_bias=False)}
    channels = num_init_features
    for i, num_layers in enumerate(block_config):
        features[f"denseblock{i + 1}"] = dense_block(num_layers, growth_rate, bn_size, drop_rate)
        channels += num_layers * growth_rate
        if i != len(block_config) - 1:
            channels //= 2
            features[f"transition{i + 1}"] = transition(channels)
    features["norm5"] = BatchNorm()
    return Sequential({
        "features": Sequential(features), "relu": ReLU(), "avgpool": GlobalAvgPool2D(),
        "classifier": Dense(num_classes, weight_init="glorot_uniform"),
    })


def densenet121_imagenet(input_shape=(3, 224, 224), num_classes=1000, drop_rate=0.0):
    return densenet(32, (6, 12, 24, 16), 64, num_classes, drop_rate=drop_rate)


def densenet169_imagenet(input_shape=(3, 224, 224), num_classes=1000, drop_rate=0.0):
    return densenet(32, (6, 12, 32, 32), 64, num_classes, drop_rate=drop_rate)


def densenet201_imagenet(input_shape=(3, 224, 224), num_classes=1000, drop_rate=0.0):
    return densenet(32, (6, 12, 48, 32), 64, num_classes, drop_rate=drop_rate)


def densenet_cifar10(input_shape=(3, 32, 32), num_classes=10, growth_rate=12, block_config=(16, 16, 16), drop_rate=0.0):
    """DenseNet-BC-100 with k = 12 (the paper's CIFAR model, 769,162 parameters): a 3x3 stem of
    2k channels, three dense blocks of 16 bottleneck layers, compression 0.5.

    block_config=(6, 12, 24, 16) gives PyDTNN's densenet_cifar10 (the DenseNet-121 layout, k = 12).
    """
    return densenet(growth_rate, tuple(block_config), 2 * growth_rate, num_classes, drop_rate=drop_rate, stem="cifar")
