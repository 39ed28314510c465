"""Text datasets, their tokenizers, bits per token and perplexity, the GPT family, and pydtnn-generate."""

import json
import math
import os

import numpy as np
import pytest

from pydtnn import data, metrics, models
from pydtnn.cli import main
from pydtnn.data.text import FORTUNES, TextDataset, Tokenizer, load_text, read_fortunes
from pydtnn.errors import ConfigError, DataError
from pydtnn.randomness import SampleStreams

PROSE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
         "foolishness, it was the epoch of belief, it was the epoch of incredulity.\n") * 8


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("kind", ["chars", "bytes"])
def test_tokenizer_round_trips_any_text_it_was_fitted_on(kind):
    text = "Naïve café, 東京 and ascii\ttabs\n"
    tok = Tokenizer.fit(kind, [text, "more"])
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.max() < tok.vocab_size
    if kind == "chars":
        assert tok.vocab_size == len(set(text + "more")) and len(ids) == len(text)
        assert list(tok.vocabulary) == sorted(tok.vocabulary)
    else:
        assert tok.vocab_size == 256 and len(ids) == len(text.encode("utf-8"))
    again = Tokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again == tok and again.decode(again.encode(text)) == text


def test_tokenizer_refuses_a_character_outside_its_vocabulary_and_a_bad_saved_form():
    tok = Tokenizer.fit("chars", ["abc"])
    with pytest.raises(ConfigError, match="'z' is not in the vocabulary of 3"):
        tok.encode("abz")
    with pytest.raises(DataError, match="expected"):
        Tokenizer.from_dict({"kind": "words"})
    with pytest.raises(DataError, match="twice"):
        Tokenizer.from_dict({"kind": "chars", "vocabulary": "aa"})
    with pytest.raises(ValueError, match="token id 3 outside"):
        tok.decode([0, 3])


def test_windows_are_the_text_and_its_next_tokens_shifted_by_per_sample_streams():
    tok = Tokenizer("bytes")
    tokens = np.arange(1000) % 251
    ds = TextDataset(tokens.astype(np.uint8), 16, tok)
    assert len(ds) == (1000 - 1) // 16 and ds.input_shape == (16,) and ds.num_classes == 256
    idx = np.array([0, 5, 61])
    x, y = ds.get_batch(idx, np.float64)
    np.testing.assert_array_equal(x, tokens[idx[:, None] * 16 + np.arange(16)])
    np.testing.assert_array_equal(y, tokens[idx[:, None] * 16 + np.arange(1, 17)])
    xa, ya = ds.get_batch(idx, np.float32, rng=SampleStreams(3, 1, idx))
    xb, _ = ds.get_batch(idx, np.float32, rng=SampleStreams(3, 1, idx))
    xc, _ = ds.get_batch(idx, np.float32, rng=SampleStreams(3, 2, idx))
    np.testing.assert_array_equal(xa, xb)  # a function of (seed, epoch, sample)
    assert not np.array_equal(xa, xc)
    np.testing.assert_array_equal(xa[:, 1:], ya[:, :-1])
    starts = (xa[:, 0]).astype(int)  # tokens are 0..250 in order, so a window's first token names its start mod 251
    assert all(0 <= (s - 16 * i) % 251 < 16 for s, i in zip(starts, idx))
    part = ds.subset(np.array([2, 3]))
    np.testing.assert_array_equal(part.get_batch([1])[0], ds.get_batch([3])[0])


def test_load_text_reads_a_file_or_folder_and_holds_out_the_end_as_the_test_set(tmp_path):
    path = write(tmp_path / "book.txt", PROSE)
    train, test = load_text(path, context_length=8)
    whole = train.tokenizer.decode(train.tokens) + test.tokenizer.decode(test.tokens)
    assert whole == PROSE
    assert len(test.tokens) == len(PROSE) - int(len(PROSE) * 0.9)
    folder = tmp_path / "books"
    folder.mkdir()
    write(folder / "a.txt", "first part " * 10)
    write(folder / "b.txt", "second part " * 10)
    write(folder / ".hidden", "\0\0\0")  # dot files are not read
    tr, te = load_text(str(folder), write(tmp_path / "test.txt", "a test part " * 5), context_length=4,
                       tokenizer="bytes")
    assert tr.tokenizer.decode(tr.tokens) == "first part " * 10 + "\n\n" + "second part " * 10
    assert te.tokenizer.decode(te.tokens) == "a test part " * 5


@pytest.mark.parametrize("content, match", [
    (b"", "empty"),
    (b"   \n\n", "empty"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(200), "binary file"),
    (b"plain text " * 10000 + b"\x00", "a NUL among them"),  # past the first 64 KiB
    (b"caf\xe9 au lait " * 20, "not UTF-8"),
])
def test_bad_text_files_are_refused_naming_the_file(tmp_path, content, match):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as e:
        load_text(str(path), context_length=4)
    assert str(path) in str(e.value)


def test_a_context_longer_than_the_text_is_refused_with_what_fits(tmp_path):
    path = write(tmp_path / "short.txt", "a short text of forty characters, no more")
    with pytest.raises(DataError, match="fewer than --context_length 64"):
        load_text(path, context_length=64)


def test_the_command_line_refuses_bad_text_in_one_line_with_exit_2(tmp_path, capsys):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 4)
    for extra, match in ((["--dataset_train_path", str(junk)], "binary file"),
                         (["--dataset_train_path", write(tmp_path / "e.txt", "")], "empty"),
                         (["--dataset_train_path", write(tmp_path / "s.txt", PROSE[:100]), "--context_length", "512"],
                          "fewer than --context_length 512")):
        assert main(["--model", "gpt_nano", "--dataset", "text", *extra, "--progress", "false"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0], err
    assert main(["--dataset", "mnist5k", "--context_length", "5"]) == 2
    assert "--context_length applies to a text dataset" in capsys.readouterr().err
    text = write(tmp_path / "t.txt", PROSE)
    for flag, value in (("--validation_split", "0.1"), ("--flip_images", "true"), ("--crop_images", "true")):
        assert main(["--model", "gpt_nano", "--dataset", "text", "--dataset_train_path", text, flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag} " in err[0] and "does not apply to text" in err[0], err


def test_the_default_text_is_the_fortunes_package_without_overstrikes():
    if not os.path.isdir(FORTUNES):
        reason = f"{FORTUNES} is absent; install it with: apt-get install fortunes"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    text = read_fortunes()
    assert len(text) > 2_000_000 and "\x08" not in text and "\n%\n" not in text
    train, _ = data.load("text", context_length=128)
    assert train.tokenizer.kind == "chars" and train.num_classes < 128 and len(train) > 10_000


def test_tiny_shakespeare_is_downloadable_and_read_from_its_folder(tmp_path):
    (spec,) = data.REMOTE["tiny_shakespeare"]
    assert spec[1] == "input.txt" and spec[2] == 1115394 and len(spec[3]) == 64
    with pytest.raises(data.DatasetNotFound, match="download=True"):
        data.load("tiny_shakespeare")
    write(tmp_path / "input.txt", "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20)
    train, _ = data.load("tiny_shakespeare", str(tmp_path), context_length=16)
    assert train.tokenizer.decode(train.tokens).startswith("First Citizen:")


def test_bits_per_token_is_the_cross_entropy_in_bits_and_perplexity_its_power_of_two():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    y, t = rng.standard_normal((3, 5, 7)) * 4, rng.integers(0, 7, (3, 5))
    want = torch.nn.functional.cross_entropy(torch.tensor(y).reshape(-1, 7), torch.tensor(t).reshape(-1)).item()
    assert metrics.get("bits_per_token")(y, t) == pytest.approx(want / math.log(2), rel=1e-12)
    assert metrics.canonical("bpc") == "bits_per_token"
    record = metrics.with_perplexity({"test_bits_per_token": 2.5}, "test_")
    assert record["test_perplexity"] == pytest.approx(2 ** 2.5)


def test_gpt_family_takes_token_windows_and_refuses_images():
    from pydtnn.models.families import resolve

    choice, model = resolve("gpt", (32,), 40)
    assert choice.name == "gpt_nano" and model.input_shape == (32,) and model.output_shape == (32, 40)
    assert models.create("gpt_mini").output_shape == (256, 256)
    with pytest.raises(ConfigError, match="takes windows of token ids"):
        resolve("gpt", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match="expected a token model"):
        resolve("vit", (128,), 10)


def test_generation_reads_only_the_prompt_s_positions_and_is_drawn_by_the_seed():
    from pydtnn.generate import next_token_probabilities, sample

    model = models.create("gpt_nano", input_shape=(12,), num_classes=30)
    model.eval()
    rng = np.random.default_rng(1)
    x = rng.integers(0, 30, (1, 12)).astype(np.float32)
    other = x.copy()
    other[0, 7:] = rng.integers(0, 30, 5)
    # causal attention: the logits up to position 6 do not depend on the tokens after it (the padding)
    np.testing.assert_allclose(model.forward(x)[0, :7], model.forward(other)[0, :7], rtol=1e-5, atol=1e-6)
    p = next_token_probabilities(np.array([[1.0, 3.0, 2.0, -1.0]]), temperature=0.5, top_k=2)
    assert p[0, 0] == p[0, 3] == 0 and p[0, 1] == pytest.approx(1 / (1 + math.exp(-2)))
    np.testing.assert_array_equal(next_token_probabilities(np.array([[0.0, 5.0, 1.0]]), 0), [[0, 1, 0]])
    tok = Tokenizer("chars", "".join(chr(97 + i) for i in range(26)) + " .,\n")
    greedy = sample(model, tok, "hello", 3, temperature=0)[0]
    ids = list(tok.encode("hello"))
    for _ in range(3):  # the logits at the last real position, whatever fills the rest of the window
        x = rng.integers(0, 30, (1, 12)).astype(np.float32)
        x[0, :len(ids)] = ids
        ids.append(int(model.forward(x)[0, len(ids) - 1].argmax()))
    assert greedy == tok.decode(ids)
    a = sample(model, tok, "hello", 20, 1.0, 0, np.random.default_rng(5), samples=2)
    b = sample(model, tok, "hello", 20, 1.0, 0, np.random.default_rng(5), samples=2)
    assert a == b and all(s.startswith("hello") and len(s) == 25 for s in a) and a[0] != a[1]


def test_the_vocabulary_is_saved_with_the_checkpoint_and_generation_export_and_resume_use_it(tmp_path, capsys):
    from pydtnn import generate

    text = write(tmp_path / "book.txt", PROSE)
    ckpt = tmp_path / "ckpt"
    common = ["--model", "gpt_nano", "--dataset", "text", "--context_length", "16", "--batch_size", "8",
              "--steps_per_epoch", "2", "--progress", "false"]
    assert main([*common, "--dataset_train_path", text, "--num_epochs", "1", "--checkpoint_dir", str(ckpt)]) == 0
    model, tok = generate.load(str(ckpt))
    assert tok == load_text(text, context_length=16)[0].tokenizer and model.input_shape == (16,)
    capsys.readouterr()
    assert generate.main(["--checkpoint", str(ckpt), "--prompt", "it was", "--tokens", "10", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("it was") and len(out.rstrip("\n")) >= len("it was") + 1
    assert generate.main(["--checkpoint", str(ckpt), "--prompt", "ZZZ"]) == 2
    assert "'Z' is not in the vocabulary" in capsys.readouterr().err
    pytest.importorskip("onnxruntime")
    from pydtnn.export import main as export

    assert export([str(tmp_path / "gpt.onnx"), "--checkpoint", str(ckpt)]) == 0
    assert "token ids (N, 16)" in capsys.readouterr().out
    assert export([str(tmp_path / "no.onnx"), "--checkpoint", str(ckpt), "--with_preprocessing"]) == 2
    assert "takes token ids, not images" in capsys.readouterr().err
    import onnxruntime

    x = model.random_input(3, np.random.default_rng(0), np.float32)
    session = onnxruntime.InferenceSession(str(tmp_path / "gpt.onnx"))
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(got, model.forward(x, training=False), atol=1e-4)
    other = write(tmp_path / "other.txt", PROSE.upper())
    assert main([*common, "--dataset_train_path", other, "--num_epochs", "2", "--resume", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'T' is not in the vocabulary" in err[0], err
    # another text made of the trained characters is read with the checkpoint's ids (here: fewer characters)
    subset = write(tmp_path / "subset.txt", "it was the age of wisdom, it was the age of folly. " * 20)
    assert main([*common, "--dataset_train_path", subset, "--evaluate_only", "true",
                 "--weights_and_bias_filename", str(ckpt)]) == 0
    assert main([*common, "--dataset_train_path", subset, "--evaluate_only", "true", "--tokenizer", "bytes",
                 "--weights_and_bias_filename", str(ckpt)]) == 2
    assert "reads text as chars; leave --tokenizer out" in capsys.readouterr().err
