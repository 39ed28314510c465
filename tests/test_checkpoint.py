"""Checkpoints: bit-identical resume, crash safety (failed writes, SIGKILL), clear errors, weight loading."""

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from pydtnn import checkpoint, optim, runtime
from pydtnn.backends import CPUBackend
from pydtnn.errors import ConfigError, DataError, ShapeError
from pydtnn.layers import BatchNorm, Conv2D, Dense, Dropout, Flatten, MaxPool2D, ReLU
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.model import Model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(seed=0, units=5, dtype=np.float32):
    """Conv + BatchNorm + Dropout: parameters, buffers and RNG draws all matter for a resume."""
    layers = [Conv2D(4, 3, padding=1), BatchNorm(), ReLU(), MaxPool2D(2), Flatten(), Dropout(0.3), Dense(units)]
    return Model(layers, (2, 8, 8), backend=CPUBackend(dtype, seed=seed), name="tiny")


def batches(seed, n, size=8):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, 2, 8, 8)).astype(np.float32), rng.integers(0, 5, size)) for _ in range(n)]


def train(model, opt, data):
    loss = SoftmaxCrossEntropy()
    for x, y in data:
        loss.forward(model.forward(x, training=True), y)
        model.backward(loss.backward())
        opt.step()


def assert_same(model_a, opt_a, model_b, opt_b):
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert np.array_equal(sa[k], sb[k]), k
    oa, ob = opt_a.state_dict(), opt_b.state_dict()
    assert oa["scalars"] == ob["scalars"]
    for k in oa["arrays"]:
        assert np.array_equal(oa["arrays"][k], ob["arrays"][k]), k


def files_in(directory):
    return sorted(os.listdir(directory))


OPTIMIZERS = [("sgd", dict(lr=0.05, momentum=0.9, nesterov=True)), ("adam", dict(lr=0.01)), ("nadam", dict(lr=0.01))]


# -- round trip ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,hyper", OPTIMIZERS)
def test_resume_continues_bit_identically(tmp_path, name, hyper):
    a = tiny(seed=0)
    opt_a = optim.create(name, a.parameters(), **hyper)
    train(a, opt_a, batches(0, 3))
    checkpoint.save(tmp_path / "ck", a, opt_a, meta={"step": 3, "rng": checkpoint.rng_state(a.backend.rng)})
    assert files_in(tmp_path / "ck") == ["meta.json", "model.safetensors", "optimizer.safetensors"]

    b = tiny(seed=1)  # another initialization and RNG stream
    opt_b = optim.create(name, b.parameters(), **hyper)
    assert not np.array_equal(a.state_dict()["0.weight"], b.state_dict()["0.weight"])
    meta = checkpoint.load(tmp_path / "ck", b, opt_b)
    checkpoint.set_rng_state(b.backend.rng, meta["rng"])
    assert meta["step"] == 3
    assert_same(a, opt_a, b, opt_b)
    assert np.any(b.state_dict()["1.running_mean"] != 0)  # BatchNorm buffers came along

    c = tiny(seed=1)  # restored without the RNG: dropout masks differ, so must the results
    opt_c = optim.create(name, c.parameters(), **hyper)
    checkpoint.load(tmp_path / "ck", c, opt_c)
    for model, opt in ((a, opt_a), (b, opt_b), (c, opt_c)):
        train(model, opt, batches(1, 3))
    assert_same(a, opt_a, b, opt_b)
    assert a.params_sha256() == b.params_sha256()
    assert not np.array_equal(a.state_dict()["6.weight"], c.state_dict()["6.weight"])


def test_manifest_and_files_are_readable_by_other_tools(tmp_path):
    m = tiny()
    opt = optim.create("sgd", m.parameters(), lr=0.1, momentum=0.9)
    train(m, opt, batches(0, 1))
    meta = {"epoch": np.int64(2), "history": [{"loss": np.float32(0.5), "val_loss": None}], "order": np.arange(3)}
    checkpoint.save(tmp_path, m, opt, meta)
    doc = json.loads((tmp_path / "meta.json").read_text())
    assert doc["format"] == "pydtnn-checkpoint" and doc["format_version"] == 1
    assert doc["model"]["state"][:2] == [["0.weight", [4, 2, 3, 3], "float32"], ["0.bias", [4], "float32"]]
    assert doc["model"]["params_sha256"] == m.params_sha256()
    assert doc["optimizer"]["kind"] == "SGD" and doc["optimizer"]["scalars"]["step"] == 1
    assert doc["meta"] == {"epoch": 2, "history": [{"loss": 0.5, "val_loss": None}], "order": [0, 1, 2]}
    assert checkpoint.read_meta(tmp_path) == doc["meta"] and checkpoint.read_manifest(tmp_path) == doc
    weights = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))  # what PyTorch sees
    assert set(weights) == set(m.state_dict())
    for k, v in m.state_dict().items():
        assert np.array_equal(weights[k].numpy(), v), k
    slots = safetensors.numpy.load_file(str(tmp_path / "optimizer.safetensors"))
    assert set(slots) == {f"{k}.momentum_buffer" for k, _, _ in m.parameters()}


def test_save_without_optimizer_then_loading_one_is_an_error(tmp_path):
    checkpoint.save(tmp_path, tiny())
    m = tiny(seed=3)
    assert checkpoint.load(tmp_path, m) == {}
    with pytest.raises(ConfigError, match="saved without an optimizer"):
        checkpoint.load(tmp_path, tiny(), optim.create("sgd", m.parameters()))


# -- crash safety -------------------------------------------------------------------------------
def saved_pair(directory, steps):
    """A model+optimizer trained `steps` batches, saved with meta {"step": steps}."""
    m = tiny()
    opt = optim.create("adam", m.parameters(), lr=0.01)
    train(m, opt, batches(0, steps))
    checkpoint.save(directory, m, opt, {"step": steps})
    return m, opt


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failed_write_keeps_previous_checkpoint_and_leaves_no_temp_files(tmp_path, monkeypatch, error):
    old, _ = saved_pair(tmp_path, 1)
    m = tiny()
    opt = optim.create("adam", m.parameters(), lr=0.01)
    train(m, opt, batches(0, 2))
    real_fsync, calls = os.fsync, []

    def failing_fsync(fd):  # the model's temp file is written; the optimizer's fails
        calls.append(fd)
        if len(calls) == 2:
            raise error
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(ConfigError if isinstance(error, OSError) else KeyboardInterrupt) as info:
        checkpoint.save(tmp_path, m, opt, {"step": 2})
    monkeypatch.undo()
    if isinstance(error, OSError):
        assert str(tmp_path) in str(info.value) and "No space left" in str(info.value)
    assert len(calls) == 2
    assert files_in(tmp_path) == ["meta.json", "model.safetensors", "optimizer.safetensors"]
    fresh = tiny(seed=5)
    assert checkpoint.load(tmp_path, fresh, optim.create("adam", fresh.parameters(), lr=0.01)) == {"step": 1}
    assert fresh.params_sha256() == old.params_sha256()


def test_crash_between_renames_leaves_the_new_checkpoint_complete(tmp_path, monkeypatch):
    saved_pair(tmp_path, 1)
    m = tiny()
    opt = optim.create("adam", m.parameters(), lr=0.01)
    train(m, opt, batches(0, 2))
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):  # model.safetensors is renamed, then the process "dies"
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(ConfigError):
        checkpoint.save(tmp_path, m, opt, {"step": 2})
    monkeypatch.undo()
    # new model.safetensors, old meta.json: only the pending manifest describes a complete set
    assert "meta.json.tmp" in files_in(tmp_path) and "optimizer.safetensors.tmp" in files_in(tmp_path)
    fresh = tiny(seed=5)
    fresh_opt = optim.create("adam", fresh.parameters(), lr=0.01)
    assert checkpoint.load(tmp_path, fresh, fresh_opt) == {"step": 2}
    assert_same(m, opt, fresh, fresh_opt)
    real_fsync = os.fsync  # the next save finishes the interrupted renames before it fails itself

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(ConfigError):
        checkpoint.save(tmp_path, fresh, fresh_opt, {"step": 3})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert files_in(tmp_path) == ["meta.json", "model.safetensors", "optimizer.safetensors"]
    assert checkpoint.read_meta(tmp_path) == {"step": 2}
    checkpoint.save(tmp_path, fresh, fresh_opt, {"step": 3})
    assert files_in(tmp_path) == ["meta.json", "model.safetensors", "optimizer.safetensors"]
    assert checkpoint.read_meta(tmp_path) == {"step": 3}


def test_leftovers_of_a_crash_before_the_renames_are_ignored_then_cleaned(tmp_path):
    old, _ = saved_pair(tmp_path, 1)
    (tmp_path / "model.safetensors.tmp").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")  # torn
    (tmp_path / "meta.json.tmp").write_text('{"format": "pydtnn-checkp')
    fresh = tiny(seed=5)
    assert checkpoint.load(tmp_path, fresh) == {"step": 1}
    assert fresh.params_sha256() == old.params_sha256()
    checkpoint.save(tmp_path, fresh, meta={"step": 2})
    assert files_in(tmp_path) == ["meta.json", "model.safetensors", "optimizer.safetensors"]


_CHILD = textwrap.dedent('''
    import os, sys
    import numpy as np
    from pydtnn import checkpoint, optim
    from pydtnn.backends import CPUBackend
    from pydtnn.layers import Dense, Dropout, Flatten, ReLU
    from pydtnn.losses import SoftmaxCrossEntropy
    from pydtnn.model import Model


    def build():
        m = Model([Flatten(), Dense(256), ReLU(), Dropout(0.2), Dense(10)], (1, 16, 16), CPUBackend(seed=0), name="k")
        return m, optim.create("adam", m.parameters(), lr=1e-3)


    def step(model, opt, i):
        rng = np.random.default_rng(i)
        x, y = rng.standard_normal((16, 1, 16, 16)).astype(np.float32), rng.integers(0, 10, 16)
        loss = SoftmaxCrossEntropy()
        loss.forward(model.forward(x, training=True), y)
        model.backward(loss.backward())
        opt.step()


    if __name__ == "__main__":  # train forever, resuming from and saving to argv[1] after every step
        from pydtnn import runtime

        runtime.configure(threads=1)  # as the test replays it: the same thread split, the same rounding
        directory = sys.argv[1]
        model, opt = build()
        i = 0
        if os.path.exists(os.path.join(directory, "meta.json")):
            meta = checkpoint.load(directory, model, opt)
            checkpoint.set_rng_state(model.backend.rng, meta["rng"])
            i = meta["step"]
        print("start", i, flush=True)
        while True:
            step(model, opt, i)
            i += 1
            print("saving", i, flush=True)
            checkpoint.save(directory, model, opt, {"step": i, "rng": checkpoint.rng_state(model.backend.rng)})
            print("saved", i, flush=True)
''')


def test_sigkill_while_training_and_saving_leaves_a_loadable_checkpoint(tmp_path):
    lib = {"__name__": "child_lib"}
    exec(_CHILD, lib)  # the child's model and steps, to recompute what each checkpoint must hold
    script, directory = tmp_path / "child.py", tmp_path / "ck"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for delay in (0.0, 0.004, 0.008, 0.012):  # spread over a save (about 10 ms here)
        proc = subprocess.Popen([sys.executable, str(script), str(directory)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
        watchdog = threading.Timer(30, proc.kill)  # bounded even if the child hangs
        watchdog.start()
        try:
            start = int(proc.stdout.readline().split()[1])
            target = start + 3  # at least two saves of this run completed before the kill
            while True:
                line = proc.stdout.readline()
                assert line, f"child died: {proc.stderr.read()}"
                if line.split() == ["saving", str(target)]:
                    break
            threading.Event().wait(delay)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            watchdog.cancel()
            proc.kill()
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL

        model, opt = lib["build"]()
        meta = checkpoint.load(directory, model, opt)  # the previous or the new checkpoint, complete
        before = runtime.configured()  # an earlier test module's Trainer may have configured this process
        runtime.configure(threads=1)
        # the previous or the new checkpoint; on a quick machine the child may finish another save
        # before the signal lands, which is as good: what matters is that it is complete and right
        assert target - 1 <= meta["step"] <= target + 2
        ref, ref_opt = lib["build"]()
        try:
            for i in range(meta["step"]):
                lib["step"](ref, ref_opt, i)
        finally:
            if before is not None:
                runtime.configure(threads=before["threads"], blas_threads=before.get("blas_threads"))
        assert_same(ref, ref_opt, model, opt)
        assert checkpoint.rng_state(ref.backend.rng) == meta["rng"]


# -- errors -------------------------------------------------------------------------------------
def test_corrupt_or_truncated_model_file_is_a_data_error(tmp_path):
    saved_pair(tmp_path, 1)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    m = tiny(seed=4)
    before = {k: v.copy() for k, v in m.state_dict().items()}
    path.write_bytes(data[:-10])
    with pytest.raises(DataError, match="model.safetensors is corrupt or truncated"):
        checkpoint.load(tmp_path, m)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(DataError, match="SHA-256"):
        checkpoint.load(tmp_path, m)
    path.unlink()
    with pytest.raises(DataError, match="model.safetensors is missing"):
        checkpoint.load(tmp_path, m)
    for k, v in m.state_dict().items():
        assert np.array_equal(v, before[k]), k


def test_another_architecture_is_a_shape_error_naming_the_entry(tmp_path):
    saved_pair(tmp_path, 1)
    m = tiny(units=6)
    opt = optim.create("adam", m.parameters(), lr=0.01)
    before, opt_before = m.params_sha256(), opt.state_dict()["scalars"]
    with pytest.raises(ShapeError, match=r"'6\.weight' has shape \(5, 64\), model 'tiny' has \(6, 64\)"):
        checkpoint.load(tmp_path, m, opt)
    assert m.params_sha256() == before and opt.state_dict()["scalars"] == opt_before
    other = Model([Conv2D(4, 3, padding=1), ReLU(), Flatten(), Dense(5)], (2, 8, 8), name="other")
    with pytest.raises(ShapeError, match=r"it has no '3\.weight'.*\(5, 256\)"):  # its Dense is layer 3
        checkpoint.load(tmp_path, other)


@pytest.mark.parametrize("setup,why", [
    (lambda d: None, "does not exist"),
    (lambda d: d.mkdir(), "is empty"),
    (lambda d: (d.mkdir(), (d / "notes.txt").write_text("hi"), (d / "model.safetensors").write_text("x")),
     "no meta.json"),
    (lambda d: (d.mkdir(), (d / "meta.json").write_text('{"epoch": 3}')), "not a pydtnn manifest"),
    (lambda d: (d.mkdir(), (d / "meta.json").write_bytes(b"\x00\xff")), "not a pydtnn manifest"),
    (lambda d: d.write_text("a file"), "is a file"),
])
def test_not_a_checkpoint_directory_is_a_config_error(tmp_path, setup, why):
    d = tmp_path / "ck"
    setup(d)
    for call in (lambda: checkpoint.load(d, tiny()), lambda: checkpoint.read_meta(d)):
        with pytest.raises(ConfigError, match="is not a pydtnn checkpoint directory") as info:
            call()
        msg = str(info.value)
        assert str(d) in msg and why in msg and "expected model.safetensors, optimizer.safetensors, meta.json" in msg
        assert "\n" not in msg


def test_other_optimizer_kind_or_configuration_is_a_config_error(tmp_path):
    saved_pair(tmp_path, 2)  # Adam
    m = tiny(seed=4)
    before = m.params_sha256()
    with pytest.raises(ConfigError, match="holds Adam optimizer state, this run uses SGD"):
        checkpoint.load(tmp_path, m, optim.create("sgd", m.parameters(), momentum=0.9))
    d2 = tmp_path / "sgd"
    checkpoint.save(d2, m, optim.create("sgd", m.parameters(), momentum=0.9))
    with pytest.raises(ConfigError, match="momentum_buffer"):  # SGD without momentum has no such slot
        checkpoint.load(d2, m, optim.create("sgd", m.parameters(), momentum=0.0))
    assert m.params_sha256() == before


def test_unwritable_directory_and_unserialisable_meta(tmp_path):
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "ck"
    with pytest.raises(ConfigError, match=f"cannot write checkpoint directory {target}"):
        checkpoint.save(target, tiny())
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        checkpoint.save(tmp_path / "ck", tiny(), meta={"when": object()})
    assert not (tmp_path / "ck").exists()


# -- RNG snapshots ------------------------------------------------------------------------------
@pytest.mark.parametrize("bitgen", [np.random.PCG64, np.random.MT19937, np.random.Philox])
def test_rng_state_round_trips_through_json(bitgen):
    g = np.random.Generator(bitgen(7))
    g.random(5)
    state = json.loads(json.dumps(checkpoint.rng_state(g)))
    h = np.random.Generator(bitgen(99))
    checkpoint.set_rng_state(h, state)
    assert np.array_equal(g.random(10), h.random(10))
    with pytest.raises(ConfigError, match="this generator is"):
        checkpoint.set_rng_state(np.random.Generator(np.random.SFC64(0)), state)


# -- weights from PyTorch -------------------------------------------------------------------------
def torch_net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
        for _ in range(3):  # non-trivial running statistics
            net(torch.randn(8, 2, 6, 6) * 2 + 1)
    return net.eval()


def pydtnn_twin(dtype=np.float32):
    return Model([Conv2D(4, 3, padding=1), BatchNorm(), ReLU(), Flatten(), Dense(5)], (2, 6, 6),
                 backend=CPUBackend(dtype, seed=3), name="twin")


def test_load_weights_from_pytorch_matches_its_outputs(tmp_path):
    net = torch_net()
    path = str(tmp_path / "net.safetensors")
    safetensors.torch.save_file(net.state_dict(), path)
    assert "1.num_batches_tracked" in net.state_dict()
    m = pydtnn_twin()
    names = checkpoint.load_weights(path, m)
    assert names == list(m.state_dict())
    x = np.random.default_rng(0).standard_normal((4, 2, 6, 6)).astype(np.float32)
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(m.forward(x, training=False), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tdtype", [torch.float16, torch.bfloat16, torch.float64])
def test_load_weights_converts_float_dtypes(tmp_path, tdtype):
    net = torch_net().to(tdtype)
    path = str(tmp_path / "net.safetensors")
    safetensors.torch.save_file(net.state_dict(), path)
    m = pydtnn_twin()
    checkpoint.load_weights(path, m)
    for k, v in m.state_dict().items():
        assert v.dtype == np.float32
        assert np.array_equal(v, net.state_dict()[k].to(torch.float32).numpy()), k


def test_load_weights_errors_name_the_entry(tmp_path):
    good = torch_net().state_dict()
    cases = [
        ({k: v for k, v in good.items() if k != "4.weight"}, r"has no '4\.weight'.*parameter of shape \(5, 144\)"),
        ({k: v for k, v in good.items() if k != "1.running_var"}, r"has no '1\.running_var'.*buffer"),
        ({**good, "head.weight": torch.zeros(3)}, r"unexpected 'head\.weight' \(3,\)"),
        ({**good, "4.weight": torch.zeros(6, 144)}, r"'4\.weight' has shape \(6, 144\).*expects \(5, 144\)"),
        ({**good, "module.4.weight": good["4.weight"].clone()}, r"unexpected 'module\.4\.weight'"),
    ]
    for i, (state, pattern) in enumerate(cases):
        path = str(tmp_path / f"bad{i}.safetensors")
        safetensors.torch.save_file(state, path)
        m = pydtnn_twin()
        before = m.params_sha256()
        with pytest.raises(ShapeError, match=pattern):
            checkpoint.load_weights(path, m)
        assert m.params_sha256() == before
    # strict=False tolerates a missing buffer (it keeps its value), never a missing parameter
    m = pydtnn_twin()
    checkpoint.load_weights(str(tmp_path / "bad1.safetensors"), m, strict=False)
    assert np.array_equal(m.state_dict()["1.running_var"], np.ones(4, np.float32))
    assert np.array_equal(m.state_dict()["1.running_mean"], good["1.running_mean"].numpy())


def test_load_weights_from_a_checkpoint_directory(tmp_path):
    a, _ = saved_pair(tmp_path, 2)
    b = tiny(seed=9)
    checkpoint.load_weights(tmp_path, b)
    assert b.params_sha256() == a.params_sha256()
    assert np.array_equal(b.state_dict()["1.running_var"], a.state_dict()["1.running_var"])


class _Trap:
    """Unpickling this creates a file: proof that nothing was unpickled if the file is absent."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_load_weights_refuses_everything_but_safetensors(tmp_path):
    trap = str(tmp_path / "unpickled")
    state = {k: torch.from_numpy(v.copy()) for k, v in pydtnn_twin().state_dict().items()}
    np.savez(tmp_path / "w.npz", **{k: v.numpy() for k, v in state.items()})
    np.save(tmp_path / "w.npy", np.zeros(3))
    torch.save({**state, "trap": _Trap(trap)}, tmp_path / "w.pt")
    (tmp_path / "w.pkl").write_bytes(pickle.dumps(_Trap(trap)))
    (tmp_path / "w.txt").write_text("weights, honestly")
    for name, what in [("w.npz", "zip archive"), ("w.npy", ".npy"), ("w.pt", "zip archive"), ("w.pkl", "pickle"),
                       ("w.txt", "not a safetensors file")]:
        with pytest.raises(ConfigError, match=f"{what}.*only safetensors is supported"):
            checkpoint.load_weights(tmp_path / name, pydtnn_twin())
    assert not os.path.exists(trap)
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint.load_weights(tmp_path / "missing.safetensors", pydtnn_twin())
    path = tmp_path / "cut.safetensors"
    safetensors.torch.save_file(state, str(path))
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(DataError, match="truncated"):
        checkpoint.load_weights(path, pydtnn_twin())
