"""The model zoo: parameter counts, a training step of every model, and torchvision equivalence.

torchvision is not installed, so its architectures are transcribed below as small torch.nn classes
(same attribute names, same registration order, same forward) from torchvision/models/{resnet,
densenet,googlenet,inception,vgg}.py. They serve twice: built on the "meta" device (no memory, no
time) they give torchvision's full state-dict keys and shapes, which ours must equal in order; and
in float64 with weights copied by name they must compute what our blocks compute.
"""

from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from pydtnn import models
from pydtnn.backends import CPUBackend
from pydtnn.errors import ConfigError
from pydtnn.model import Model
from pydtnn.models import densenet, inception, resnet
from pydtnn.models.convert import torchvision_state_dict
from pydtnn.testing import check_against_torch

# -- parameter counts --------------------------------------------------------------------------
# ImageNet: torchvision's published counts (inception_v3 and googlenet without the auxiliary
# heads: 27,161,264 and 13,004,888 with them); MobileNet v1: Keras MobileNet(alpha=1, 224), trainable.
TORCHVISION = {
    "alexnet_imagenet": 61_100_840,
    "vgg11_imagenet": 132_863_336, "vgg13_imagenet": 133_047_848,
    "vgg16_imagenet": 138_357_544, "vgg19_imagenet": 143_667_240,
    "vgg11bn_imagenet": 132_868_840, "vgg13bn_imagenet": 133_053_736,
    "vgg16bn_imagenet": 138_365_992, "vgg19bn_imagenet": 143_678_248,
    "resnet18_imagenet": 11_689_512, "resnet34_imagenet": 21_797_672, "resnet50_imagenet": 25_557_032,
    "resnet101_imagenet": 44_549_160, "resnet152_imagenet": 60_192_808,
    "densenet121_imagenet": 7_978_856, "densenet169_imagenet": 14_149_480, "densenet201_imagenet": 20_013_928,
    "googlenet_imagenet": 6_624_904,
    "inceptionv3_imagenet": 23_834_568,
    "mobilenetv1_imagenet": 4_231_976,
}


def resnet_cifar_params(depth, classes=10):
    """He et al.'s CIFAR ResNet with option-B shortcuts, counted by hand: stem 3x3 conv + BN; per
    basic block two 3x3 convs + two BNs; 1x1 conv + BN projections into stages 2 and 3; fc."""
    n = (depth - 2) // 6
    total = 9 * 3 * 16 + 2 * 16
    for w_in, w in ((16, 16), (16, 32), (32, 64)):
        total += 9 * w_in * w + 9 * w * w + 4 * w + (n - 1) * (2 * 9 * w * w + 4 * w)
        total += (w_in * w + 2 * w) if w_in != w else 0
    return total + 64 * classes + classes


def densenet_bc_cifar_params(k=12, blocks=(16, 16, 16), classes=10):
    """DenseNet-BC on CIFAR by hand: 3x3 stem (2k); per layer BN(c) 1x1(c->4k) BN(4k) 3x3(4k->k);
    per transition BN(c) 1x1(c->c/2); final BN and fc."""
    c = 2 * k
    total = 9 * 3 * c
    for i, n in enumerate(blocks):
        for _ in range(n):
            total += 2 * c + c * 4 * k + 2 * 4 * k + 9 * 4 * k * k
            c += k
        if i < len(blocks) - 1:
            total += 2 * c + c * (c // 2)
            c //= 2
    return total + 2 * c + c * classes + classes


def head_swap(count, features, classes=10, old=1000):
    """A count with the final Dense(features -> old) replaced by Dense(features -> classes)."""
    return count - (features + 1) * (old - classes)


def vit_params(dim, depth, mlp, tokens=64, channels=3, patch=4, classes=10):
    """A ViT by hand: the patch convolution, the class token, positions of tokens + 1, per block two LayerNorms,
    the attention's input (3 x dim x dim + 3 x dim) and output projections, the MLP's two Dense; the final
    LayerNorm and the head."""
    block = 4 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (dim * mlp + mlp) + (mlp * dim + dim)
    return (channels * patch * patch * dim + dim) + dim + (tokens + 1) * dim + depth * block + 2 * dim + dim * classes + classes


def gpt_params(dim, depth, mlp, context, vocab=256):
    """A GPT by hand: token and position embeddings, per block two LayerNorms, the attention's projections and
    the MLP's two Dense; the final LayerNorm and the head over the vocabulary."""
    block = 4 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (dim * mlp + mlp) + (mlp * dim + dim)
    return vocab * dim + context * dim + depth * block + 2 * dim + dim * vocab + vocab


EXPECTED_PARAMS = {
    **TORCHVISION,
    # simplecnn: 3x3 convs 1->16, 16->32, Dense 32*7*7->64, 64->10; simplemlp: 784-256-128-10
    "simplecnn": (9 * 16 + 16) + (9 * 16 * 32 + 32) + (32 * 49 * 64 + 64) + (64 * 10 + 10),
    "simplemlp": (784 * 256 + 256) + (256 * 128 + 128) + (128 * 10 + 10),
    # LeNet-5: 5x5 convs 1->6, 6->16, 16->120, Dense 120->84->10
    "lenet5": (25 * 6 + 6) + (25 * 6 * 16 + 16) + (25 * 16 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10),
    # 3x3 convs 3->64 (stride 2), 64->192, 192->384, 384->256, 256->256; Dense 1024-4096-4096-10
    "alexnet_cifar10": (27 * 64 + 64) + (9 * 64 * 192 + 192) + (9 * 192 * 384 + 384) + (9 * 384 * 256 + 256)
    + (9 * 256 * 256 + 256) + (1024 * 4096 + 4096) + (4096 * 4096 + 4096) + (4096 * 10 + 10),
    # VGG on CIFAR: torchvision's features, first Dense takes 512 features instead of 512*7*7, 10 classes
    **{
        f"vgg{d}{bn}_cifar10": head_swap(TORCHVISION[f"vgg{d}{bn}_imagenet"] - (25088 - 512) * 4096, 4096)
        for d in (11, 13, 16, 19) for bn in ("", "bn")
    },
    **{f"resnet{d}_cifar10": resnet_cifar_params(d) for d in (20, 32, 44, 56, 110)},
    "densenet_cifar10": densenet_bc_cifar_params(),
    # GoogLeNet's stem (conv1 7x7 3->64, conv2 1x1 64->64, conv3 3x3 64->192, each + BN: 124,736)
    # becomes one 3x3 conv 3->192 + BN (5,568); fc 1024 -> 10
    "googlenet_cifar10": head_swap(6_624_904 - (9408 + 128 + 4096 + 128 + 110592 + 384) + (27 * 192 + 384), 1024),
    "mobilenetv1_cifar10": head_swap(4_231_976, 1024),
    "vit_tiny_cifar10": vit_params(64, 6, 128),
    "vit_small_cifar10": vit_params(128, 6, 256),
    "gpt_nano": gpt_params(64, 4, 256, 128),
    "gpt_mini": gpt_params(128, 6, 512, 256),
}

# the numbers the docstrings and the report quote, as literals, so a formula slip shows
assert EXPECTED_PARAMS["resnet20_cifar10"] == 272_474
assert EXPECTED_PARAMS["resnet110_cifar10"] == 1_730_714
assert EXPECTED_PARAMS["densenet_cifar10"] == 769_162
assert EXPECTED_PARAMS["googlenet_cifar10"] == 5_490_986
assert EXPECTED_PARAMS["mobilenetv1_cifar10"] == 3_217_226
assert EXPECTED_PARAMS["vgg16_cifar10"] == 33_638_218
assert EXPECTED_PARAMS["alexnet_cifar10"] == 23_272_266
assert EXPECTED_PARAMS["lenet5"] == 61_706
assert EXPECTED_PARAMS["vit_tiny_cifar10"] == 208_970
assert EXPECTED_PARAMS["gpt_nano"] == 241_280


def test_registry_lists_every_model():
    assert models.names() == sorted(EXPECTED_PARAMS)


def test_unknown_model_and_option_are_config_errors():
    with pytest.raises(ConfigError) as e:
        models.create("nosuch")
    assert "'nosuch'" in str(e.value) and "resnet50" in str(e.value) and "lenet5" in str(e.value)
    assert "pydtnn.models.names()" in str(e.value)
    with pytest.raises(ConfigError, match="nosuch_option"):
        models.create("resnet20_cifar10", nosuch_option=1)
    with pytest.raises(ConfigError, match="6n \\+ 2"):
        resnet.resnet_cifar(21, 10)


class ZerosGenerator:
    """Stands in for the backend's Generator where only shapes matter: "draws" zeros, which is
    several times faster than random numbers for the 100M-parameter VGG and AlexNet classifiers."""

    def uniform(self, low=0.0, high=1.0, size=None):
        return np.zeros(size)

    normal = uniform


def shapes_only_backend():
    backend = CPUBackend(np.float32)
    backend.rng = ZerosGenerator()
    return backend


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_builds_at_default_shape_with_expected_params(name):
    model = models.create(name, backend=shapes_only_backend())
    shape, classes = models.defaults(name)
    per_token = shape[:1] if len(shape) == 1 else ()  # a token model scores every position
    assert model.input_shape == shape and model.output_shape == (*per_token, classes)
    assert model.count_params() == EXPECTED_PARAMS[name]


# -- a training step of every model ----------------------------------------------------------
# ImageNet models run at a smaller input where their global or adaptive pooling allows it
# (Inception v3 needs at least 75x75); CIFAR and MNIST models at their own size.
SMALL_INPUT = {name: (3, 64, 64) for name in TORCHVISION}
SMALL_INPUT.update({name: (3, 32, 32) for name in TORCHVISION if name.startswith("vgg")})
SMALL_INPUT["inceptionv3_imagenet"] = (3, 75, 75)


# ~0.5 GB of parameters and gradients each (the 25088 x 4096 and 9216 x 4096 Dense layers): a few
# seconds apiece, mostly spent allocating memory
BIG = {name for name in TORCHVISION if name.startswith(("vgg", "alexnet"))}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in BIG else n for n in sorted(EXPECTED_PARAMS)]
)
def test_forward_backward_of_every_model(name):
    shape = SMALL_INPUT.get(name, models.defaults(name)[0])
    classes = models.defaults(name)[1]
    model = models.create(name, input_shape=shape, backend=CPUBackend(np.float32, seed=1))
    rng = np.random.default_rng(0)
    y = model.forward(model.random_input(2, rng, np.float32), training=True)  # token ids for a GPT
    per_token = shape[:1] if len(shape) == 1 else ()
    assert y.shape == (2, *per_token, classes) and y.dtype == np.float32
    assert np.isfinite(y).all()
    model.backward(rng.standard_normal(y.shape).astype(np.float32))
    for pname, _, g in model.parameters():
        assert np.isfinite(g).all(), pname
    assert any(np.abs(g).max() > 0 for _, _, g in model.parameters()[:3]), "no gradient reached the first layers"


# -- torchvision, transcribed ------------------------------------------------------------------
class TVBasicConv2d(nn.Module):
    def __init__(self, cin, cout, **kw):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kw)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class TVBasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class TVBottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class TVResNet(nn.Module):
    def __init__(self, block, layers, num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], 2)
        self.layer3 = self._make_layer(block, 256, layers[2], 2)
        self.layer4 = self._make_layer(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class TVDenseLayer(nn.Module):
    def __init__(self, cin, growth_rate, bn_size):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(cin, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)

    def forward(self, x):
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class TVDenseBlock(nn.ModuleDict):
    def __init__(self, num_layers, cin, bn_size, growth_rate):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1}", TVDenseLayer(cin + i * growth_rate, growth_rate, bn_size))

    def forward(self, x):
        for layer in self.values():
            x = torch.cat([x, layer(x)], 1)
        return x


class TVTransition(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__()
        self.add_module("norm", nn.BatchNorm2d(cin))
        self.add_module("relu", nn.ReLU())
        self.add_module("conv", nn.Conv2d(cin, cout, 1, bias=False))
        self.add_module("pool", nn.AvgPool2d(2, 2))


class TVDenseNet(nn.Module):
    def __init__(self, growth_rate=32, block_config=(6, 12, 24, 16), num_init_features=64, bn_size=4, num_classes=1000):
        super().__init__()
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(3, num_init_features, 7, 2, 3, bias=False)),
            ("norm0", nn.BatchNorm2d(num_init_features)), ("relu0", nn.ReLU()), ("pool0", nn.MaxPool2d(3, 2, 1)),
        ]))
        c = num_init_features
        for i, n in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", TVDenseBlock(n, c, bn_size, growth_rate))
            c += n * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", TVTransition(c, c // 2))
                c //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(c))
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x):
        out = F.adaptive_avg_pool2d(F.relu(self.features(x)), (1, 1))
        return self.classifier(torch.flatten(out, 1))


class TVInception(nn.Module):  # GoogLeNet's
    def __init__(self, cin, ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj):
        super().__init__()
        self.branch1 = TVBasicConv2d(cin, ch1x1, kernel_size=1)
        self.branch2 = nn.Sequential(TVBasicConv2d(cin, ch3x3red, kernel_size=1),
                                     TVBasicConv2d(ch3x3red, ch3x3, kernel_size=3, padding=1))
        self.branch3 = nn.Sequential(TVBasicConv2d(cin, ch5x5red, kernel_size=1),
                                     TVBasicConv2d(ch5x5red, ch5x5, kernel_size=3, padding=1))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, 1, 1, ceil_mode=True),
                                     TVBasicConv2d(cin, pool_proj, kernel_size=1))

    def forward(self, x):
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class TVGoogLeNet(nn.Module):  # aux_logits=False
    def __init__(self, num_classes=1000):
        super().__init__()
        self.conv1 = TVBasicConv2d(3, 64, kernel_size=7, stride=2, padding=3)
        self.maxpool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2 = TVBasicConv2d(64, 64, kernel_size=1)
        self.conv3 = TVBasicConv2d(64, 192, kernel_size=3, padding=1)
        self.maxpool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.inception3a = TVInception(192, 64, 96, 128, 16, 32, 32)
        self.inception3b = TVInception(256, 128, 128, 192, 32, 96, 64)
        self.maxpool3 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.inception4a = TVInception(480, 192, 96, 208, 16, 48, 64)
        self.inception4b = TVInception(512, 160, 112, 224, 24, 64, 64)
        self.inception4c = TVInception(512, 128, 128, 256, 24, 64, 64)
        self.inception4d = TVInception(512, 112, 144, 288, 32, 64, 64)
        self.inception4e = TVInception(528, 256, 160, 320, 32, 128, 128)
        self.maxpool4 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.inception5a = TVInception(832, 256, 160, 320, 32, 128, 128)
        self.inception5b = TVInception(832, 384, 192, 384, 48, 128, 128)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(0.0)  # torchvision: 0.2; the comparison below runs without dropout
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x):
        for m in list(self.children())[:-3]:
            x = m(x)
        return self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))


class TVInceptionA(nn.Module):
    def __init__(self, cin, pool_features):
        super().__init__()
        self.branch1x1 = TVBasicConv2d(cin, 64, kernel_size=1)
        self.branch5x5_1 = TVBasicConv2d(cin, 48, kernel_size=1)
        self.branch5x5_2 = TVBasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = TVBasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = TVBasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = TVBasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = TVBasicConv2d(cin, pool_features, kernel_size=1)

    def forward(self, x):
        return torch.cat([
            self.branch1x1(x), self.branch5x5_2(self.branch5x5_1(x)),
            self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
            self.branch_pool(F.avg_pool2d(x, 3, 1, 1)),
        ], 1)


class TVInceptionB(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch3x3 = TVBasicConv2d(cin, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = TVBasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = TVBasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = TVBasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x):
        b = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b, F.max_pool2d(x, 3, 2)], 1)


class TVInceptionC(nn.Module):
    def __init__(self, cin, c7):
        super().__init__()
        self.branch1x1 = TVBasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7_1 = TVBasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7_2 = TVBasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = TVBasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = TVBasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7dbl_2 = TVBasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = TVBasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = TVBasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = TVBasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = TVBasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        b2 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        b3 = self.branch7x7dbl_1(x)
        for m in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            b3 = m(b3)
        return torch.cat([self.branch1x1(x), b2, b3, self.branch_pool(F.avg_pool2d(x, 3, 1, 1))], 1)


class TVInceptionD(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch3x3_1 = TVBasicConv2d(cin, 192, kernel_size=1)
        self.branch3x3_2 = TVBasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = TVBasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7x3_2 = TVBasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = TVBasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = TVBasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x):
        b2 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([self.branch3x3_2(self.branch3x3_1(x)), b2, F.max_pool2d(x, 3, 2)], 1)


class TVInceptionE(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch1x1 = TVBasicConv2d(cin, 320, kernel_size=1)
        self.branch3x3_1 = TVBasicConv2d(cin, 384, kernel_size=1)
        self.branch3x3_2a = TVBasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = TVBasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = TVBasicConv2d(cin, 448, kernel_size=1)
        self.branch3x3dbl_2 = TVBasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = TVBasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = TVBasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = TVBasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        b2 = self.branch3x3_1(x)
        b2 = torch.cat([self.branch3x3_2a(b2), self.branch3x3_2b(b2)], 1)
        b3 = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        b3 = torch.cat([self.branch3x3dbl_3a(b3), self.branch3x3dbl_3b(b3)], 1)
        return torch.cat([self.branch1x1(x), b2, b3, self.branch_pool(F.avg_pool2d(x, 3, 1, 1))], 1)


class TVInception3(nn.Module):  # aux_logits=False; forward not needed (keys only)
    def __init__(self, num_classes=1000):
        super().__init__()
        self.Conv2d_1a_3x3 = TVBasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = TVBasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = TVBasicConv2d(32, 64, kernel_size=3, padding=1)
        self.maxpool1 = nn.MaxPool2d(3, 2)
        self.Conv2d_3b_1x1 = TVBasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = TVBasicConv2d(80, 192, kernel_size=3)
        self.maxpool2 = nn.MaxPool2d(3, 2)
        self.Mixed_5b = TVInceptionA(192, 32)
        self.Mixed_5c = TVInceptionA(256, 64)
        self.Mixed_5d = TVInceptionA(288, 64)
        self.Mixed_6a = TVInceptionB(288)
        self.Mixed_6b = TVInceptionC(768, 128)
        self.Mixed_6c = TVInceptionC(768, 160)
        self.Mixed_6d = TVInceptionC(768, 160)
        self.Mixed_6e = TVInceptionC(768, 192)
        self.Mixed_7a = TVInceptionD(768)
        self.Mixed_7b = TVInceptionE(1280)
        self.Mixed_7c = TVInceptionE(2048)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(2048, num_classes)


def tv_vgg(cfg, batch_norm, num_classes=1000):
    layers, c = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1)] + ([nn.BatchNorm2d(v)] if batch_norm else []) + [nn.ReLU()]
            c = v
    m = nn.Module()
    m.features = nn.Sequential(*layers)
    m.avgpool = nn.AdaptiveAvgPool2d((7, 7))
    m.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, 4096),
                                 nn.ReLU(), nn.Dropout(), nn.Linear(4096, num_classes))
    return m


def torchvision_model(name):
    """torchvision's model `name`, built on the meta device (shapes only)."""
    from pydtnn.models.vgg import CONFIGS

    builders = {
        "resnet18_imagenet": lambda: TVResNet(TVBasicBlock, [2, 2, 2, 2]),
        "resnet50_imagenet": lambda: TVResNet(TVBottleneck, [3, 4, 6, 3]),
        "vgg16_imagenet": lambda: tv_vgg(CONFIGS[16], False),
        "vgg16bn_imagenet": lambda: tv_vgg(CONFIGS[16], True),
        "densenet121_imagenet": lambda: TVDenseNet(),
        "googlenet_imagenet": lambda: TVGoogLeNet(),
        "inceptionv3_imagenet": lambda: TVInception3(),
    }
    with torch.device("meta"):
        return builders[name]()


def torch_state(module):
    """A torch module's state dict without num_batches_tracked (pydtnn's BatchNorm has none)."""
    return {k: v for k, v in module.state_dict().items() if not k.endswith("num_batches_tracked")}


# -- state-dict names are torchvision's ------------------------------------------------------
# (model, number of keys without num_batches_tracked, keys that must be there with their shapes)
TORCHVISION_KEYS = [
    ("resnet18_imagenet", 102, {
        "conv1.weight": (64, 3, 7, 7), "bn1.running_var": (64,), "layer1.0.conv1.weight": (64, 64, 3, 3),
        "layer2.0.downsample.0.weight": (128, 64, 1, 1), "layer2.0.downsample.1.running_mean": (128,),
        "layer4.1.bn2.bias": (512,), "fc.weight": (1000, 512), "fc.bias": (1000,),
    }),
    ("resnet50_imagenet", 267, {
        "conv1.weight": (64, 3, 7, 7), "layer1.0.downsample.0.weight": (256, 64, 1, 1),
        "layer3.5.conv2.weight": (256, 256, 3, 3), "layer4.2.bn3.running_var": (2048,), "fc.weight": (1000, 2048),
    }),
    ("vgg16_imagenet", 32, {
        "features.0.weight": (64, 3, 3, 3), "features.28.bias": (512,), "classifier.0.weight": (4096, 25088),
        "classifier.3.weight": (4096, 4096), "classifier.6.bias": (1000,),
    }),
    ("vgg16bn_imagenet", 84, {
        "features.0.weight": (64, 3, 3, 3), "features.1.running_mean": (64,), "features.40.weight": (512, 512, 3, 3),
        "features.41.running_var": (512,), "classifier.6.weight": (1000, 4096),
    }),
    ("densenet121_imagenet", 606, {
        "features.conv0.weight": (64, 3, 7, 7), "features.norm0.running_mean": (64,),
        "features.denseblock1.denselayer1.norm1.weight": (64,),
        "features.denseblock1.denselayer1.conv1.weight": (128, 64, 1, 1),
        "features.denseblock1.denselayer6.conv2.weight": (32, 128, 3, 3),
        "features.transition1.conv.weight": (128, 256, 1, 1),
        "features.denseblock4.denselayer16.norm1.running_var": (992,),
        "features.norm5.weight": (1024,), "classifier.weight": (1000, 1024),
    }),
    ("googlenet_imagenet", 287, {
        "conv1.conv.weight": (64, 3, 7, 7), "conv1.bn.running_var": (64,), "conv3.conv.weight": (192, 64, 3, 3),
        "inception3a.branch1.conv.weight": (64, 192, 1, 1), "inception3a.branch2.1.conv.weight": (128, 96, 3, 3),
        "inception3a.branch3.1.conv.weight": (32, 16, 3, 3), "inception5b.branch4.1.bn.bias": (128,),
        "fc.weight": (1000, 1024),
    }),
    ("inceptionv3_imagenet", 472, {
        "Conv2d_1a_3x3.conv.weight": (32, 3, 3, 3), "Mixed_5b.branch5x5_2.conv.weight": (64, 48, 5, 5),
        "Mixed_6b.branch7x7_2.conv.weight": (128, 128, 1, 7), "Mixed_7b.branch3x3_2b.conv.weight": (384, 384, 3, 1),
        "Mixed_7c.branch_pool.bn.running_var": (192,), "fc.weight": (1000, 2048),
    }),
]


@pytest.mark.parametrize("name,count,spot", TORCHVISION_KEYS, ids=[t[0] for t in TORCHVISION_KEYS])
def test_state_dict_names_are_torchvisions(name, count, spot):
    ours = {k: tuple(v.shape) for k, v in models.create(name, backend=shapes_only_backend()).state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in torch_state(torchvision_model(name)).items()}
    assert len(ours) == count
    for k, shape in spot.items():
        assert ours.get(k) == shape, k
    assert list(ours) == list(theirs)  # same names in the same order
    assert ours == theirs  # and the same shapes


def test_other_models_state_dict_names():
    """Names of the models with no torchvision counterpart: Keras's for MobileNet, torchvision-style
    for the CIFAR models."""
    cases = {
        "mobilenetv1_imagenet": {
            "conv1.weight": (32, 3, 3, 3), "conv1_bn.running_var": (32,), "conv_dw_1.weight": (32, 1, 3, 3),
            "conv_pw_1.weight": (64, 32, 1, 1), "conv_dw_13.weight": (1024, 1, 3, 3),
            "conv_pw_13_bn.bias": (1024,), "conv_preds.weight": (1000, 1024, 1, 1), "conv_preds.bias": (1000,),
        },
        "resnet20_cifar10": {
            "conv1.weight": (16, 3, 3, 3), "layer2.0.downsample.0.weight": (32, 16, 1, 1),
            "layer3.2.bn2.running_var": (64,), "fc.weight": (10, 64),
        },
        "densenet_cifar10": {
            "features.conv0.weight": (24, 3, 3, 3), "features.denseblock1.denselayer16.conv2.weight": (12, 48, 3, 3),
            "features.transition2.conv.weight": (150, 300, 1, 1), "features.norm5.weight": (342,),
            "classifier.weight": (10, 342),
        },
        "vgg16bn_cifar10": {"features.40.weight": (512, 512, 3, 3), "classifier.0.weight": (4096, 512)},
        "alexnet_cifar10": {"features.0.weight": (64, 3, 3, 3), "classifier.1.weight": (4096, 1024)},
        "lenet5": {"conv3.weight": (120, 16, 5, 5), "fc2.weight": (10, 84)},
    }
    for name, spot in cases.items():
        state = models.create(name, backend=shapes_only_backend()).state_dict()
        for k, shape in spot.items():
            assert k in state and state[k].shape == shape, (name, k)


# -- the same numbers as torch, weights copied by name (float64) ----------------------------------
def params_fn(module):
    """torch_fn for check_against_torch: run `module` with our parameters, matched by name."""
    names = {k for k, _ in module.named_parameters()}

    def fn(x, p):
        assert set(p) == names, sorted(set(p) ^ names)
        return functional_call(module, p, (x,))

    return fn


@pytest.mark.parametrize("stride,project", [(2, True), (1, False)])
def test_bottleneck_block_matches_torch(stride, project):
    torch.manual_seed(0)
    down = nn.Sequential(nn.Conv2d(32, 32, 1, stride, bias=False), nn.BatchNorm2d(32)) if project else None
    tv = TVBottleneck(32, 8, stride, down).double()
    check_against_torch(resnet.bottleneck(8, stride, project), (2, 32, 7, 7), params_fn(tv))


def test_basic_block_matches_torch():
    tv = TVBasicBlock(8, 16, 2, nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))).double()
    check_against_torch(resnet.basic_block(16, 2, True), (2, 8, 6, 6), params_fn(tv))


def test_dense_block_matches_torch():
    tv = TVDenseBlock(3, 6, 2, 4).double()
    check_against_torch(densenet.dense_block(3, 4, bn_size=2), (2, 6, 5, 5), params_fn(tv))


def test_googlenet_module_matches_torch():
    tv = TVInception(6, 4, 3, 5, 2, 3, 4).double()
    check_against_torch(inception.googlenet_module(4, 3, 5, 2, 3, 4), (2, 6, 5, 5), params_fn(tv))


@pytest.mark.parametrize(
    "ours,theirs,x_shape",
    [
        (lambda: inception.inception_a(8), lambda: TVInceptionA(6, 8), (2, 6, 5, 5)),
        (lambda: inception.inception_b(), lambda: TVInceptionB(6), (2, 6, 7, 7)),
        (lambda: inception.inception_c(4), lambda: TVInceptionC(6, 4), (2, 6, 7, 7)),
        (lambda: inception.inception_d(), lambda: TVInceptionD(6), (2, 6, 7, 7)),
        (lambda: inception.inception_e(), lambda: TVInceptionE(6), (1, 6, 3, 3)),
    ],
    ids=["A", "B", "C", "D", "E"],
)
def test_inceptionv3_modules_match_torch(ours, theirs, x_shape):
    check_against_torch(ours(), x_shape, params_fn(theirs().double()))


def randomized(module, seed=0):
    """`module` in float64 with random parameters and running statistics (so eval mode means something)."""
    torch.manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for k, v in module.state_dict().items():
            if k.endswith("running_var"):
                v.uniform_(0.5, 2.0)
            elif v.dim() > 1:
                v.normal_(0, v[0].numel() ** -0.5)
            elif v.is_floating_point():
                v.normal_(0, 0.5)
    return module


@pytest.mark.parametrize(
    "layers,tv,shape",
    [
        (lambda: resnet.resnet("basic", (1, 1, 1, 1), 7), lambda: TVResNet(TVBasicBlock, [1, 1, 1, 1], 7), (3, 32, 32)),
        (lambda: densenet.densenet(4, (2, 3), 8, 5), lambda: TVDenseNet(4, (2, 3), 8, num_classes=5), (3, 24, 24)),
        # 48x48 makes every ceil-mode max pool round up (24 -> 12 -> 6 -> 3 -> 2); no dropout, so
        # training mode is deterministic
        (lambda: inception.googlenet_imagenet(None, 6, dropout=0.0), lambda: TVGoogLeNet(6), (3, 48, 48)),
    ],
    ids=["resnet", "densenet", "googlenet"],
)
def test_torch_state_dict_loads_and_computes_the_same(layers, tv, shape, tmp_path):
    """A torch model's weights, through a safetensors file, into ours: same outputs and gradients."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    tv = randomized(tv())
    save_file({k: v.contiguous() for k, v in tv.state_dict().items()}, str(tmp_path / "m.safetensors"))
    model = Model(layers(), shape, backend=CPUBackend(np.float64))
    model.load_state_dict(torchvision_state_dict(load_file(str(tmp_path / "m.safetensors"))))  # strict

    x = np.random.default_rng(0).standard_normal((2,) + shape)
    tv.eval()
    y_t = tv(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(model.forward(x, training=False), y_t, rtol=1e-10, atol=1e-12)

    tv.train()
    y_t = tv(torch.tensor(x))
    y = model.forward(x, training=True)
    np.testing.assert_allclose(y, y_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    r = np.random.default_rng(1).standard_normal(y.shape)
    (y_t * torch.tensor(r)).sum().backward()
    model.backward(r)
    tgrads = {k: p.grad.numpy() for k, p in tv.named_parameters()}
    assert [n for n, _, _ in model.parameters()] == list(tgrads)
    for name, _, g in model.parameters():
        np.testing.assert_allclose(g, tgrads[name], rtol=1e-9, atol=1e-11, err_msg=name)
    # the running statistics moved the same way
    theirs = torch_state(tv)
    for name, v in model.state_dict().items():
        np.testing.assert_allclose(v, theirs[name].numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_torchvision_state_dict_drops_counters_and_aux_heads():
    state = {
        "bn1.weight": torch.ones(2), "bn1.num_batches_tracked": torch.tensor(3),
        "aux1.fc1.weight": torch.ones(1), "AuxLogits.fc.bias": torch.ones(1), "fc.bias": np.zeros(2),
    }
    out = torchvision_state_dict(state)
    assert list(out) == ["bn1.weight", "fc.bias"]
    assert all(isinstance(v, np.ndarray) for v in out.values())


def test_catalog_for_list_models_is_current():
    """--list_models reads models/catalog.py (docs/make_models_table.py writes it): every model, with
    the facts a build gives."""
    from pydtnn.models.catalog import CATALOG

    assert sorted(CATALOG) == models.names()
    for name, (shape, classes, params, gflops, _, _) in CATALOG.items():
        assert (shape, classes) == models.defaults(name) and params == EXPECTED_PARAMS[name], name
    for name in ("simplecnn", "lenet5", "resnet20_cifar10", "mobilenetv1_cifar10"):
        assert CATALOG[name][3] == round(models.create(name, backend=shapes_only_backend()).flops() / 1e9, 3), name
