"""pydtnn-plot: the output is checked before any work and written atomically; the input is read safely."""

import fcntl
import json
import os
import re

import pytest

pytest.importorskip("matplotlib")

import pydtnn.plot  # noqa: E402  (after the guard)
from pydtnn.plot import main  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def metrics(path, epochs=3):
    path.write_text("".join(json.dumps({"epoch": e, "loss": 1.0 / e, "accuracy": 0.5 + e / 100, "val_loss": None,
                                        "val_accuracy": None}) + "\n" for e in range(1, epochs + 1)))
    return path


def refused(capsys, argv, *words):
    """main(argv) exits 2 with one line `pydtnn-plot: error: ...` holding every word, printing nothing else."""
    assert main([str(a) for a in argv]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pydtnn-plot: error: "), out.err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert out.out == ""
    return lines[0]


def test_writes_the_png_and_no_temporary_file(tmp_path, capsys):
    m = metrics(tmp_path / "m.jsonl")
    assert main([str(m), "-o", str(tmp_path / "curves.png"), "--title", "run 1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG
    assert main([str(m)]) == 0  # default: the metrics file's name with .png
    assert (tmp_path / "m.png").read_bytes()[:8] == PNG
    assert sorted(os.listdir(tmp_path)) == ["curves.png", "m.jsonl", "m.png"]


def test_a_failed_rendering_leaves_the_old_png_as_it_was(tmp_path, monkeypatch):
    """The PNG is rendered in memory and then written atomically: a renderer that fails half-way through
    writing (here: after 4 bytes) never reaches the file."""
    import matplotlib.figure

    def half_then_fail(self, target, *args, **kwargs):
        if hasattr(target, "write"):
            target.write(b"half")
        else:
            with open(target, "wb") as f:
                f.write(b"half")
        raise RuntimeError("renderer failed")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_fail)
    m, out = metrics(tmp_path / "m.jsonl"), tmp_path / "curves.png"
    out.write_bytes(b"previous")
    with pytest.raises(RuntimeError, match="renderer failed"):
        main([str(m), "-o", str(out)])
    assert out.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["curves.png", "m.jsonl"]


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink", "default"])
def test_output_that_is_the_metrics_file_is_refused(tmp_path, capsys, how):
    m = metrics(tmp_path / ("m.png" if how == "default" else "m.jsonl"))
    before = m.read_bytes()
    out = {"same": m, "symlink": tmp_path / "link.png", "hardlink": tmp_path / "hard.png", "default": None}[how]
    if how == "symlink":
        out.symlink_to(m)
    elif how == "hardlink":
        os.link(m, out)
    refused(capsys, [m] + (["-o", out] if out is not None else []), "metrics file", str(m))
    assert m.read_bytes() == before
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


def test_output_that_is_a_fifo_or_a_device_is_refused(tmp_path, capsys):
    m = metrics(tmp_path / "m.jsonl")
    fifo = tmp_path / "out.png"
    os.mkfifo(fifo)
    # a reader with room for a whole PNG: writing into the FIFO could not block, only be refused
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.fcntl(reader, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        refused(capsys, [m, "-o", fifo], "FIFO")
        assert os.read(reader, 1 << 20) == b""  # nothing was written into it
    finally:
        os.close(reader)
    refused(capsys, [m, "-o", os.devnull], os.devnull)
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl", "out.png"]


def test_missing_output_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the metrics file was read and drawn before the output was checked")

    monkeypatch.setattr(pydtnn.plot, "figure", never)
    m = metrics(tmp_path / "m.jsonl")
    refused(capsys, [m, "-o", tmp_path / "no" / "such" / "curves.png"], str(tmp_path / "no" / "such"))
    assert os.listdir(tmp_path) == ["m.jsonl"]


def test_input_that_is_not_a_regular_file_is_refused(tmp_path, capsys):
    fifo = tmp_path / "m.jsonl"
    os.mkfifo(fifo)  # nobody writes into it: reading it would wait forever
    refused(capsys, [fifo, "-o", tmp_path / "a.png"], "FIFO")
    refused(capsys, ["/dev/zero", "-o", tmp_path / "b.png"], "/dev/zero", "character device")
    refused(capsys, [tmp_path, "-o", tmp_path / "c.png"], "directory")
    refused(capsys, [tmp_path / "none.jsonl", "-o", tmp_path / "d.png"], "none.jsonl", "does not exist")
    assert os.listdir(tmp_path) == ["m.jsonl"]


def test_input_over_the_size_bound_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "m.jsonl"
    with open(big, "wb") as f:  # sparse: no disk blocks, and the bound is checked before a byte is read
        f.truncate(pydtnn.plot.METRICS_LIMIT + 1)
    refused(capsys, [big, "-o", tmp_path / "c.png"], "m.jsonl", f"{pydtnn.plot.METRICS_LIMIT:,}")
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for option in ("metrics_file", "-o OUTPUT, --output OUTPUT", "--title TITLE"):
        assert re.search(rf"^  {re.escape(option)}\s+\S", text, re.M), (option, text)


def test_usage_errors_are_one_line(tmp_path, capsys):
    refused(capsys, [], "metrics_file")
    refused(capsys, [metrics(tmp_path / "m.jsonl"), "--colour", "red"], "--colour")
    (tmp_path / "bad.jsonl").write_bytes(b"\xff\xfe not text\n")
    refused(capsys, [tmp_path / "bad.jsonl"], "bad.jsonl", "UTF-8")


@pytest.mark.parametrize("record,words", [
    ({"epoch": 1, "loss": "0.5"}, ["loss '0.5'", "epoch 1", "a number or null"]),
    ({"epoch": "one", "loss": 0.5}, ["epoch 'one'", "expected a number"]),
    ({"epoch": 1, "val_accuracy": [0.9]}, ["val_accuracy '[0.9]'"]),
    ({"final": True, "test_loss": "nan?"}, ["test_loss 'nan?'"]),
])
def test_a_value_that_is_no_number_is_one_line(tmp_path, capsys, record, words):
    m = metrics(tmp_path / "m.jsonl", epochs=1)
    m.write_text(m.read_text() + json.dumps(record) + "\n")
    refused(capsys, [m], "m.jsonl", *words)
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]
