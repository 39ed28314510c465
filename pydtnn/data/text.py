"""Next-token text datasets: a text file (or a folder of them) cut into windows of T tokens.

    train, test = load_text("book.txt", context_length=128)            # characters of the text as tokens
    x, y = train.get_batch(np.arange(4))                               # x (4, 128) ids, y (4, 128) next ids
    train.tokenizer.decode(x[0])                                       # the window's text back

Tokens are bytes (vocabulary 256, nothing to save) or the text's characters (`tokenizer="chars"`, the
default: the vocabulary is the sorted set of characters of the training and test text, saved with a
checkpoint so that a generation or a resumed run reads ids the same way). Sample i is the window that
starts at i*T; a training batch (one given per-sample random streams) shifts each window by a random
0..T-1 tokens, so the model sees every offset over the epochs, drawn from (seed, epoch, sample) alone.
Without a test file the last TEST_FRACTION of the text is the test set.

The text of `--dataset text` without --dataset_train_path is the Debian package `fortunes` (BSD licence;
`apt-get install fortunes`): 2.6 MB of English quotations, one corpus that installs offline.
`tiny_shakespeare` is Karpathy's 1.1 MB of Shakespeare (char-rnn), fetched with --download.
"""

import os
import re

import numpy as np

from pydtnn.errors import ConfigError, DataError

TEST_FRACTION = 0.1
DEFAULT_CONTEXT = 128
TOKENIZERS = ("chars", "bytes")
FORTUNES = "/usr/share/games/fortunes"  # Debian's fortunes package: each cookie file X beside its index X.dat
MAX_TEXT = 1 << 31  # bytes of text read into memory (tokens are indexed with int64, but 2 GB is a book shelf)
_BINARY = frozenset(range(32)) - {9, 10, 12, 13}  # control bytes besides tab, newline, form feed, return
MAX_CONTROL = 0.01  # of them, the share of a text's bytes (a terminal's overstrikes: "_\bx"); a NUL never


class Tokenizer:
    """Text <-> token ids: kind "bytes" (ids are the UTF-8 bytes) or "chars" (ids index `vocabulary`)."""

    def __init__(self, kind="chars", vocabulary=None):
        if kind not in TOKENIZERS:
            raise ConfigError(f"tokenizer {kind!r}; expected one of {', '.join(TOKENIZERS)}")
        self.kind = kind
        if kind == "chars":
            if not isinstance(vocabulary, str) or not vocabulary:
                raise DataError(f"a character tokenizer needs its vocabulary (a non-empty string), got "
                                f"{vocabulary!r:.60}")
            if len(set(vocabulary)) != len(vocabulary):
                raise DataError("a character vocabulary lists a character twice; expected each once")
            self.vocabulary = vocabulary
            self._ids = {c: i for i, c in enumerate(vocabulary)}
            self._table = np.array([ord(c) for c in vocabulary], np.uint32)
        else:
            self.vocabulary = None

    @classmethod
    def fit(cls, kind, texts):
        """The tokenizer of `kind` for these strings (chars: their sorted characters)."""
        if kind != "chars":
            return cls(kind)
        return cls(kind, "".join(sorted(set().union(*map(set, texts)))))

    @property
    def vocab_size(self):
        return 256 if self.kind == "bytes" else len(self.vocabulary)

    def encode(self, text):
        """Token ids (uint8 for bytes, uint16 or uint32 for characters) of a string."""
        try:
            if self.kind == "bytes":
                return np.frombuffer(text.encode("utf-8"), np.uint8).copy()
            codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        except UnicodeEncodeError as e:  # a lone surrogate (bytes that were not UTF-8, decoded by Python's escape)
            raise ConfigError(f"character {text[e.start]!r} at position {e.start} is not a Unicode character; "
                              f"expected UTF-8 text") from None
        order = np.argsort(self._table)
        pos = np.searchsorted(self._table[order], codes)
        pos = np.minimum(pos, len(order) - 1)
        found = self._table[order][pos] == codes
        if not found.all():
            bad = chr(int(codes[~found][0]))
            raise ConfigError(f"character {bad!r} is not in the vocabulary of {self.vocab_size} characters the "
                              f"model was trained on; expected text made of {self.vocabulary[:80]!r}")
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return order[pos].astype(dtype)

    def decode(self, ids):
        """The string of token ids (bytes that are not whole UTF-8 characters become U+FFFD)."""
        ids = np.asarray(ids).astype(np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id {int(ids.max() if ids.max() >= self.vocab_size else ids.min())} outside "
                             f"the vocabulary; expected 0 to {self.vocab_size - 1}")
        if self.kind == "bytes":
            return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return "".join(self.vocabulary[i] for i in ids)

    def to_dict(self):
        """JSON-able: what a checkpoint keeps ({"kind", "vocabulary"})."""
        return {"kind": self.kind, "vocabulary": self.vocabulary}

    @classmethod
    def from_dict(cls, d, where="tokenizer"):
        """The tokenizer to_dict() wrote; DataError naming `where` for anything else."""
        if not isinstance(d, dict) or d.get("kind") not in TOKENIZERS:
            raise DataError(f"{where} is {d!r:.80}; expected {{\"kind\": \"chars\" or \"bytes\", \"vocabulary\": ...}}")
        try:
            return cls(d["kind"], d.get("vocabulary"))
        except (ConfigError, DataError) as e:
            raise DataError(f"{where}: {e}") from None

    def __eq__(self, other):
        return isinstance(other, Tokenizer) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"Tokenizer({self.kind!r}, {self.vocab_size} tokens)"


class TextDataset:
    """Windows of `context_length` token ids x and their next tokens y (the window shifted by one).

    tokens: 1-D ids; window i starts at starts[i] (default i*T, every whole window). Batches: x (n, T) in the
    requested float dtype (the ids as numbers, which an Embedding takes), y (n, T) int64."""

    def __init__(self, tokens, context_length, tokenizer, name="text", starts=None):
        self.tokens, self.tokenizer, self.name = tokens, tokenizer, name
        self.context_length = t = int(context_length)
        if t < 1:
            raise ConfigError(f"context_length {context_length!r}; expected a positive number of tokens")
        if len(tokens) < t + 1:
            raise DataError(f"{name}: {len(tokens):,} tokens, fewer than a window of context_length {t} and its next "
                            f"token; expected at least {t + 1} tokens, or a shorter --context_length")
        self.starts = np.arange(0, len(tokens) - t, t, dtype=np.int64) if starts is None else np.asarray(starts)
        self.num_classes = tokenizer.vocab_size

    def __len__(self):
        return len(self.starts)

    @property
    def input_shape(self):
        return (self.context_length,)

    @property
    def y(self):
        """The first target of every window: what a stratified split would look at (not used by one)."""
        return self.tokens[self.starts + 1]

    def get_batch(self, idx, dtype=np.float32, rng=None, out=None):
        """(x, y) of windows idx; rng (training batches): per-sample streams that shift each window by 0..T-1."""
        t = self.context_length
        starts = self.starts[np.asarray(idx, np.int64)]
        if rng is not None:
            starts = np.minimum(starts + rng.integers(0, t, len(starts)), len(self.tokens) - t - 1)
        rows = starts[:, None] + np.arange(t + 1)
        window = self.tokens[rows]
        x = np.empty((len(starts), t), dtype) if out is None else out
        x[...] = window[:, :-1]
        return x, window[:, 1:].astype(np.int64)

    def subset(self, idx, name=None):
        return TextDataset(self.tokens, self.context_length, self.tokenizer, name or self.name, self.starts[idx])


def random_text(context_length, vocab_size, seed=0, train_windows=1000, test_windows=200):
    """(train, test) TextDatasets of uniformly random byte tokens (--use_synthetic_data for a token model)."""
    rng = np.random.default_rng([seed, 0x7E47])
    tok = Tokenizer("bytes") if vocab_size == 256 else Tokenizer("chars", "".join(map(chr, range(32, 32 + vocab_size))))
    t = int(context_length)
    return tuple(TextDataset(rng.integers(0, vocab_size, n * t + 1).astype(np.uint16), t, tok, f"synthetic text/{s}")
                 for n, s in ((train_windows, "train"), (test_windows, "test")))


def read_text(path, what="text"):
    """The UTF-8 text of a file, or of every regular file directly in a folder (sorted by name, joined by a blank
    line); DataError for an empty text, a binary file or bytes that are not UTF-8, naming the file."""
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))
                       and not os.path.islink(os.path.join(path, n)) and not n.startswith("."))
        if not names:
            raise DataError(f"{path}: a folder with no files; expected text files (UTF-8)")
        return "\n\n".join(read_text(os.path.join(path, n), what) for n in names)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such {what} file; expected a UTF-8 text file or a folder of them")
    size = os.path.getsize(path)
    if size > MAX_TEXT:
        raise DataError(f"{path}: {size:,} bytes of text; expected at most {MAX_TEXT:,}")
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise DataError(f"{path}: an empty {what} file; expected UTF-8 text")
    junk, nul = len(raw) - len(raw.translate(None, bytes(sorted(_BINARY)))), b"\0" in raw
    if nul or junk > len(raw) * MAX_CONTROL:
        raise DataError(f"{path}: a binary file ({junk:,} control bytes of {len(raw):,}"
                        f"{', a NUL among them' if nul else ''}); expected UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: byte {e.start:,} is not UTF-8 ({raw[e.start:e.start + 1]!r}); expected UTF-8 "
                        f"text") from None


def read_fortunes(folder=FORTUNES):
    """The cookie files of a fortune(6) folder (each X with its index X.dat), the '%' lines between the
    quotations made blank lines, the overstrikes of a terminal's bold and underline ("_\bx") and bells dropped."""
    names = sorted(n[:-4] for n in os.listdir(folder)
                   if n.endswith(".dat") and os.path.isfile(os.path.join(folder, n[:-4])))
    if not names:
        raise DataError(f"{folder} holds no fortune files (X beside its index X.dat); expected the Debian package "
                        f"fortunes' folder")
    texts = [read_text(os.path.join(folder, n)) for n in names]
    text = "\n".join(line if line != "%" else "" for text in texts for line in text.splitlines()) + "\n"
    return re.sub("(?s).\x08", "", text).replace("\x08", "").replace("\x07", "")


def default_text():
    """(text, where) of `--dataset text` without a path: the fortunes package; DataError saying how to get it."""
    if not os.path.isdir(FORTUNES):
        raise DataError(f"dataset text without --dataset_train_path reads the Debian package fortunes ({FORTUNES}), "
                        f"which is not installed; run `apt-get install fortunes`, or pass --dataset_train_path "
                        f"FILE_OR_FOLDER of UTF-8 text")
    return read_fortunes(FORTUNES), FORTUNES


def load_text(train_path=None, test_path=None, context_length=DEFAULT_CONTEXT, tokenizer="chars", name="text"):
    """(train, test) TextDatasets: train_path's text (default: the fortunes package), test_path's, or else the
    last TEST_FRACTION of the training text. tokenizer: a kind (the vocabulary fitted to the texts), or a
    Tokenizer (a trained model's: a character outside its vocabulary is refused)."""
    if not isinstance(tokenizer, Tokenizer) and tokenizer not in TOKENIZERS:
        raise ConfigError(f"--tokenizer {tokenizer!r}; expected one of {', '.join(TOKENIZERS)}")
    if train_path is None:
        text, where = default_text()
    else:
        text, where = read_text(os.fspath(train_path)), os.fspath(train_path)
    if test_path is not None:
        test_text = read_text(os.fspath(test_path), "test text")
    else:
        cut = int(len(text) * (1 - TEST_FRACTION))
        text, test_text = text[:cut], text[cut:]
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.fit(tokenizer, [text, test_text])
    t = int(context_length)
    if t < 1:
        raise ConfigError(f"--context_length {context_length!r}; expected a positive number of tokens")
    train_ids, test_ids = tok.encode(text), tok.encode(test_text)
    for ids, split, path in ((train_ids, "training", where), (test_ids, "test", test_path or f"the last "
                                                             f"{TEST_FRACTION:.0%} of {where}")):
        if len(ids) < t + 1:
            raise DataError(f"{name}: the {split} text ({path}) has {len(ids):,} tokens, fewer than --context_length "
                            f"{t} and the next token; expected a longer text or --context_length at most "
                            f"{max(len(ids) - 1, 1)}")
    return (TextDataset(train_ids, t, tok, f"{name}/train"), TextDataset(test_ids, t, tok, f"{name}/test"))
