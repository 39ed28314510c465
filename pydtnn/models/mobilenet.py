"""MobileNet v1 (Howard et al. 2017) as Keras builds it (keras.applications.MobileNet).

Depthwise-separable blocks: a 3x3 depthwise convolution (Conv2D with groups = channels), then a
1x1 pointwise one, each followed by BatchNorm and ReLU. Names are Keras's (conv1, conv1_bn,
conv_dw_1, conv_dw_1_bn, conv_pw_1, ..., conv_preds), tensors PyTorch's layout.

Differences from Keras: BatchNorm with PyTorch's defaults
(momentum 0.1, eps 1e-5) instead of Keras's (0.99, 1e-3). Padding is "same", which with stride 2
pads one row/column at the bottom/right, as Keras does on even sizes.
"""

from pydtnn.layers import AdaptiveAvgPool2D, BatchNorm, Conv2D, Dropout, Flatten, ReLU6, Sequential

# (pointwise output channels, depthwise stride) of the 13 depthwise-separable blocks
BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)] + [(512, 1)] * 5 + [(1024, 2), (1024, 1)]


def mobilenetv1(num_classes, alpha=1.0, first_stride=2, dropout=1e-3):
    """32-channel 3x3 stem, 13 depthwise-separable blocks, global average pooling, dropout, and a
    1x1 convolution classifier (conv_preds), flattened to (N, num_classes).

    alpha: width multiplier (every channel count times alpha). first_stride: stride of the stem
    (2 for 224x224 inputs, 1 for 32x32).
    """
    def width(c):
        return max(1, int(c * alpha))

    net = {
        "conv1": Conv2D(width(32), 3, stride=first_stride, padding="same", use_bias=False),
        "conv1_bn": BatchNorm(), "conv1_relu": ReLU6(),
    }
    channels = width(32)
    for i, (out, stride) in enumerate(BLOCKS, start=1):
        net[f"conv_dw_{i}"] = Conv2D(channels, 3, stride=stride, padding="same", groups=channels, use_bias=False)
        net[f"conv_dw_{i}_bn"], net[f"conv_dw_{i}_relu"] = BatchNorm(), ReLU6()
        channels = width(out)
        net[f"conv_pw_{i}"] = Conv2D(channels, 1, use_bias=False)
        net[f"conv_pw_{i}_bn"], net[f"conv_pw_{i}_relu"] = BatchNorm(), ReLU6()
    net.update({
        "avgpool": AdaptiveAvgPool2D(1), "dropout": Dropout(dropout),
        "conv_preds": Conv2D(num_classes, 1, weight_init="glorot_uniform"), "flatten": Flatten(),
    })
    return Sequential(net)


def mobilenetv1_imagenet(input_shape=(3, 224, 224), num_classes=1000, alpha=1.0, dropout=1e-3):
    """Keras MobileNet(alpha=1.0, 224): 4,231,976 trainable parameters (plus 21,888 BatchNorm
    running statistics, which Keras counts as non-trainable parameters)."""
    return mobilenetv1(num_classes, alpha, first_stride=2, dropout=dropout)


def mobilenetv1_cifar10(input_shape=(3, 32, 32), num_classes=10, alpha=1.0, dropout=1e-3):
    """The same network with a stride-1 stem (as kuangliu/pytorch-cifar's MobileNet): 32x32 ->
    2x2 before the pooling; 3,217,226 parameters for 10 classes at alpha = 1."""
    return mobilenetv1(num_classes, alpha, first_stride=1, dropout=dropout)
