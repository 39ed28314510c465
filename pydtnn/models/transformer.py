"""Vision transformers for small images: patches of 4x4 pixels as tokens, a class token, learned positions,
pre-norm transformer blocks and a linear head on the class token (Dosovitskiy et al. 2021, torchvision's
layout: conv_proj, class_token, pos_embedding, encoder blocks, a final LayerNorm, heads).

    vit_tiny_cifar10    dim 64, 6 blocks of 4 heads, MLP 128      (3x32x32: 64 patches + the class token)
    vit_small_cifar10   dim 128, 6 blocks of 4 heads, MLP 256

They are smaller than ImageNet's ViT-Ti/S (dim 192/384, 12 blocks): sized to train on two CPU cores in
minutes. Any image whose sides are multiples of the patch works (28x28 digits: 49 patches).
"""

from pydtnn.layers import (
    ClassToken,
    Dense,
    LayerNorm,
    PatchEmbedding,
    PositionalEmbedding,
    SequencePool,
    Sequential,
    TransformerBlock,
)

VIT = {"tiny": {"dim": 64, "depth": 6, "heads": 4, "mlp_dim": 128},
       "small": {"dim": 128, "depth": 6, "heads": 4, "mlp_dim": 256}}


def vit(input_shape, num_classes, dim, depth, heads, mlp_dim, patch=4, dropout=0.0, attention_dropout=0.0,
        pool="cls"):
    """A ViT: PatchEmbedding(dim, patch), ClassToken (pool "cls"; "mean" averages the patches instead),
    PositionalEmbedding, `depth` TransformerBlocks, LayerNorm, SequencePool and Dense(num_classes)."""
    tree = {"patch_embed": PatchEmbedding(dim, patch)}
    if pool == "cls":
        tree["class_token"] = ClassToken()
    tree["pos_embed"] = PositionalEmbedding()
    tree["blocks"] = Sequential([TransformerBlock(dim, heads, mlp_dim, dropout=dropout,
                                                  attention_dropout=attention_dropout) for _ in range(depth)])
    tree.update({"norm": LayerNorm(), "pool": SequencePool(pool), "head": Dense(num_classes, weight_init="gpt_normal")})
    return tree


def vit_tiny_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vit(input_shape, num_classes, **{**VIT["tiny"], **options})


def vit_small_cifar10(input_shape=(3, 32, 32), num_classes=10, **options):
    return vit(input_shape, num_classes, **{**VIT["small"], **options})
