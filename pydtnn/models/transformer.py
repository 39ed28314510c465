"""Vision transformers for small images: patches of 4x4 pixels as tokens, a class token, learned positions,
pre-norm transformer blocks and a linear head on the class token (Dosovitskiy et al. 2021, torchvision's
layout: conv_proj, class_token, pos_embedding, encoder blocks, a final LayerNorm, heads).

    vit_tiny_cifar10    dim 64, 6 blocks of 4 heads, MLP 128      (3x32x32: 64 patches + the class token)
    vit_small_cifar10   dim 128, 6 blocks of 4 heads, MLP 256

They are smaller than ImageNet's ViT-Ti/S (dim 192/384, 12 blocks): sized to train on two CPU cores in
minutes. Any image whose sides are multiples of the patch works (28x28 digits: 49 patches).

And GPTs (Radford et al. 2019's layout, as nanoGPT writes it: token and learned position embeddings,
pre-norm causal blocks, a final LayerNorm and a linear head over the vocabulary at every position):

    gpt_nano    dim 64, 4 blocks of 4 heads, MLP 256, context 128     (bytes: 256 tokens by default)
    gpt_mini    dim 128, 6 blocks of 8 heads, MLP 512, context 256

The input is (T,) token ids; the output (T, vocabulary) next-token logits. The vocabulary is the data's
(num_classes: 256 for bytes, a text's characters otherwise) and T any context up to what memory holds.
"""

from pydtnn.layers import (
    ClassToken,
    Dense,
    Embedding,
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


GPT = {"nano": {"dim": 64, "depth": 4, "heads": 4, "mlp_dim": 256},
       "mini": {"dim": 128, "depth": 6, "heads": 8, "mlp_dim": 512}}


def gpt(input_shape, num_classes, dim, depth, heads, mlp_dim, dropout=0.0, attention_dropout=0.0):
    """A GPT over a vocabulary of num_classes tokens: Embedding, PositionalEmbedding, `depth` causal
    TransformerBlocks, LayerNorm and Dense(num_classes) at every position."""
    blocks = [TransformerBlock(dim, heads, mlp_dim, causal=True, dropout=dropout, attention_dropout=attention_dropout)
              for _ in range(depth)]
    return {"tok_embed": Embedding(num_classes, dim), "pos_embed": PositionalEmbedding(), "blocks": Sequential(blocks),
            "norm": LayerNorm(), "head": Dense(num_classes, weight_init="gpt_normal")}


def gpt_nano(input_shape=(128,), num_classes=256, **options):
    return gpt(input_shape, num_classes, **{**GPT["nano"], **options})


def gpt_mini(input_shape=(256,), num_classes=256, **options):
    return gpt(input_shape, num_classes, **{**GPT["mini"], **options})
