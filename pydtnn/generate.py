"""`pydtnn-generate`: sample text from a GPT that pydtnn-train saved (a checkpoint of a text dataset).

    pydtnn-generate --checkpoint ckpt --prompt "The meaning of life" --tokens 300 --temperature 0.8

The checkpoint holds the model, its weights and the tokenizer its ids were read with (the characters'
vocabulary, or bytes). Each new token is drawn from softmax(logits / temperature) over the `top_k` most
likely tokens (0: all), given the last T tokens (T: the model's context): the window is the prompt's end,
zero-padded on the right, and the causal attention makes the logits at its last real position independent
of the padding. The same seed draws the same text.

    sample(model, tokenizer, prompt, tokens, temperature, top_k, rng, samples)   # the library call
"""

import sys

import numpy as np

from pydtnn.errors import ConfigError, command_status


def next_token_probabilities(logits, temperature=1.0, top_k=0):
    """Rows of probabilities (float64) from rows of logits: divided by temperature, all but the top_k largest
    (0: none) left out; temperature 0 puts all the mass on the argmax."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.arange(len(logits)), logits.argmax(axis=1)] = 1.0
        return out
    z = logits / temperature
    if 0 < top_k < z.shape[1]:
        kth = np.partition(z, -top_k, axis=1)[:, -top_k][:, None]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def sample(model, tokenizer, prompt, tokens=200, temperature=0.8, top_k=40, rng=None, samples=1, progress=None):
    """[prompt + `tokens` generated characters] for each of `samples` draws; model: a built token Model (a GPT)
    in evaluation mode; progress(n): called after each token (a bar's update)."""
    rng = np.random.default_rng(0) if rng is None else rng
    ids = tokenizer.encode(prompt).astype(np.int64)
    if len(ids) == 0:
        raise ConfigError("--prompt is empty; expected at least one character to start from (a newline will do)")
    t = model.input_shape[0]
    seqs = np.tile(ids, (samples, 1))
    x = np.zeros((samples, t), model.backend.dtype)
    model.eval()
    for _ in range(tokens):
        window = seqs[:, -t:]
        n = window.shape[1]
        x[:] = 0
        x[:, :n] = window
        logits = model.backend.to_numpy(model.forward(model.backend.asarray(x), training=False))[:, n - 1]
        p = next_token_probabilities(logits, temperature, top_k)
        drawn = np.array([rng.choice(p.shape[1], p=row) for row in p], np.int64)
        seqs = np.concatenate([seqs, drawn[:, None]], axis=1)
        if progress is not None:
            progress(1)
    return [tokenizer.decode(s) for s in seqs]


def load(directory, model_file=None):
    """(model, tokenizer) of a checkpoint pydtnn-train wrote on a text dataset; ConfigError for any other.
    model_file: the Python file a model trained with --model_file was built from (a checkpoint runs no code)."""
    import os

    from pydtnn import checkpoint
    from pydtnn.data.text import Tokenizer
    from pydtnn.export import model_from_checkpoint

    manifest = checkpoint.read_manifest(directory)
    where = os.path.join(directory, checkpoint.META_FILE)
    saved = manifest["meta"].get("tokenizer")
    if saved is None:
        raise ConfigError(f"{where} holds no tokenizer: the checkpoint is not of a model trained on a text dataset; "
                          f"expected one written by pydtnn-train --dataset text (or tiny_shakespeare) --checkpoint_dir")
    tokenizer = Tokenizer.from_dict(saved, f"{where}: meta.tokenizer")
    model = model_from_checkpoint(directory, manifest, model_file)
    if len(model.input_shape) != 1 or model.output_shape[-1] != tokenizer.vocab_size:
        raise ConfigError(f"{where}: model {model.name} takes {model.input_shape} and gives {model.output_shape}; "
                          f"expected a token model over {tokenizer.vocab_size} tokens")
    return model, tokenizer


def build_parser():
    from pydtnn.argtypes import Parser, non_negative_float, non_negative_int, positive_int

    p = Parser(prog="pydtnn-generate", allow_abbrev=False,
               description="Sample text from a GPT trained by pydtnn-train on a text dataset.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory written by pydtnn-train --checkpoint_dir")
    p.add_argument("--model_file", "--model-file", dest="model_file",
                   help="the Python file the model was trained from (pydtnn-train --model_file)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--tokens", type=positive_int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=non_negative_float, default=0.8,
                   help="softmax temperature (default 0.8; 0: always the most likely token)")
    p.add_argument("--top_k", "--top-k", dest="top_k", type=non_negative_int, default=40,
                   help="draw among the k most likely tokens (default 40; 0: all)")
    p.add_argument("--samples", type=positive_int, default=1, help="independent samples (default 1)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    return p


def main(argv=None):
    """0 with the samples on stdout; 2 and one line `pydtnn: error: ...` on a user error."""
    texts = []

    def body():
        from tqdm import tqdm

        from pydtnn.files import is_terminal

        args = build_parser().parse_args(argv)
        model, tokenizer = load(args.checkpoint, args.model_file)
        with tqdm(total=args.tokens, desc="pydtnn-generate", unit="token", disable=not is_terminal(sys.stderr),
                  leave=False) as progress:
            texts.extend(sample(model, tokenizer, args.prompt, args.tokens, args.temperature, args.top_k,
                                np.random.default_rng(args.seed), args.samples, progress.update))

    status = command_status(body)
    if status:
        return status
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1} ---")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
