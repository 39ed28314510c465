"""Checkpoints and weights files a user (or a stranger) edited or replaced: every refusal is one clear
PydtnnError line naming the file and the value, never a hang, a traceback or a silently wrong model."""

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import safetensors.numpy

from pydtnn import checkpoint, optim
from pydtnn import resume as run
from pydtnn.backends import CPUBackend
from pydtnn.callbacks import EarlyStopping
from pydtnn.errors import ConfigError, DataError, PydtnnError, ShapeError
from pydtnn.layers import BatchNorm, Conv2D, Dense, Flatten, MaxPool2D, ReLU
from pydtnn.losses import SoftmaxCrossEntropy
from pydtnn.model import Model
from pydtnn.optim import schedules as sch
from pydtnn.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(seed=0, units=5, dtype=np.float32, name="tiny"):
    layers = [Conv2D(4, 3, padding=1), BatchNorm(), ReLU(), MaxPool2D(2), Flatten(), Dense(units)]
    return Model(layers, (2, 8, 8), backend=CPUBackend(dtype, seed=seed), name=name)


def train(model, opt, steps=2):
    rng, loss = np.random.default_rng(0), SoftmaxCrossEntropy()
    for _ in range(steps):
        x, y = rng.standard_normal((8, 2, 8, 8)).astype(np.float32), rng.integers(0, 5, 8)
        loss.forward(model.forward(x, training=True), y)
        model.backward(loss.backward())
        opt.step()


def saved(directory, name="adam"):
    """A trained model and optimizer, saved to `directory`."""
    m = tiny()
    opt = optim.create(name, m.parameters(), lr=0.01)
    train(m, opt)
    checkpoint.save(directory, m, opt, {"step": 2})
    return m, opt


def snapshot(model, opt):
    return model.params_sha256(), json.dumps(opt.state_dict()["scalars"]), \
        {k: v.copy() for k, v in opt.state_dict()["arrays"].items()}


def unchanged(before, model, opt):
    now = snapshot(model, opt)
    return now[:2] == before[:2] and all(np.array_equal(v, now[2][k]) for k, v in before[2].items())


def tamper(directory, model=None, optimizer=None, edit=None):
    """Rewrite tensor files and/or the manifest as a careful editor would: hashes and fingerprint agree."""
    path = os.path.join(directory, "meta.json")
    manifest = json.load(open(path))
    for name, arrays in (("model.safetensors", model), ("optimizer.safetensors", optimizer)):
        if arrays is None:
            continue
        data = safetensors.numpy.save(arrays)
        open(os.path.join(directory, name), "wb").write(data)
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        if name == "model.safetensors":
            manifest["model"]["state"] = [[k, list(v.shape), v.dtype.name] for k, v in arrays.items()]
    if edit is not None:
        edit(manifest)
    open(path, "w").write(json.dumps(manifest))


def tensors(directory, name="model.safetensors"):
    return dict(safetensors.numpy.load_file(os.path.join(directory, name)))


def one_line(error):
    assert "\n" not in str(error.value), str(error.value)
    return str(error.value)


def assert_load_refused(directory, match):
    """checkpoint.load of `directory` into a fresh model and Adam raises DataError matching `match`
    and leaves both as they were; returns the model."""
    m = tiny(seed=3)
    opt = optim.create("adam", m.parameters(), lr=0.01)
    before = snapshot(m, opt)
    with pytest.raises(DataError, match=match):
        checkpoint.load(directory, m, opt)
    assert unchanged(before, m, opt)
    return m


# -- 1. FIFOs, devices and /dev/zero where a file is expected -------------------------------------
_GUARDED = textwrap.dedent('''
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # reading /dev/zero fails instead of swapping
    import numpy as np
    from pydtnn import checkpoint, files, optim
    from pydtnn.backends import CPUBackend
    from pydtnn.errors import PydtnnError
    from pydtnn.layers import Dense, Flatten
    from pydtnn.model import Model

    m = Model([Flatten(), Dense(3)], (2, 2), backend=CPUBackend(seed=0), name="g")
    try:
        if sys.argv[1] == "load":
            checkpoint.load(sys.argv[2], m, optim.create("sgd", m.parameters(), momentum=0.9))
        elif sys.argv[1] == "weights":
            checkpoint.load_weights(sys.argv[2], m)
        elif sys.argv[1] == "save":
            checkpoint.save(sys.argv[2], m, optim.create("sgd", m.parameters(), momentum=0.9), {"step": 1})
        else:
            files.write_atomic(sys.argv[2], b"{}")
    except PydtnnError as e:
        print(type(e).__name__, e)
    else:
        print("done")
''')


def guarded(tmp_path, how, path):
    """Run a load in a child with a timeout and a memory cap: a regression fails, never hangs the suite."""
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        r = subprocess.run([sys.executable, str(script), how, str(path)], capture_output=True, text=True,
                           timeout=30, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{how} {path} blocked for 30 s")
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def small_checkpoint(directory):
    m = Model([Flatten(), Dense(3)], (2, 2), backend=CPUBackend(seed=0), name="g")
    checkpoint.save(directory, m, optim.create("sgd", m.parameters(), momentum=0.9), {"step": 0})


def fifo(path):
    os.mkfifo(path)


def dev_zero(path):
    os.symlink("/dev/zero", path)


def fifo_via_symlink(path):
    os.mkfifo(str(path) + ".real")
    os.symlink(str(path) + ".real", path)


@pytest.mark.parametrize("make", [fifo, dev_zero, fifo_via_symlink])
@pytest.mark.parametrize("victim", ["meta.json", "model.safetensors", "optimizer.safetensors", "meta.json.tmp"])
def test_special_files_in_a_checkpoint_are_refused_without_blocking(tmp_path, victim, make):
    d = tmp_path / "ck"
    small_checkpoint(d)
    if victim == "meta.json.tmp":  # read only when meta.json is missing (a crash between renames)
        (d / "meta.json").unlink()
    else:
        (d / victim).unlink()
    make(d / victim)
    out = guarded(tmp_path, "load", d)
    assert out.startswith(("DataError", "ConfigError")), out
    assert victim in out and ("FIFO" in out or "character device" in out), out


@pytest.mark.parametrize("make", [fifo, dev_zero, fifo_via_symlink])
def test_special_weights_files_are_refused_without_blocking(tmp_path, make):
    make(tmp_path / "w.safetensors")
    out = guarded(tmp_path, "weights", tmp_path / "w.safetensors")
    assert out.startswith("ConfigError") and "w.safetensors" in out, out
    assert "FIFO" in out or "character device" in out, out


def test_weights_from_a_checkpoint_directory_with_a_fifo_is_refused(tmp_path):
    d = tmp_path / "ck"
    small_checkpoint(d)
    (d / "model.safetensors").unlink()
    fifo(d / "model.safetensors")
    out = guarded(tmp_path, "weights", d)
    assert out.startswith(("DataError", "ConfigError")) and "model.safetensors" in out and "FIFO" in out, out


@pytest.mark.parametrize("victim", ["model.safetensors.tmp", "meta.json.tmp", "meta.json"])
def test_saving_over_a_fifo_left_in_a_checkpoint_directory_does_not_block(tmp_path, victim):
    """A FIFO at a temporary name (the save's own) is replaced; one where a checkpoint file goes is refused in
    one line and left as it is (no output replaces a non-regular file); neither blocks."""
    d = tmp_path / "ck"
    small_checkpoint(d)
    (d / victim).unlink(missing_ok=True)
    fifo(d / victim)
    if victim.endswith(".tmp"):
        assert guarded(tmp_path, "save", d) == "done"
        assert sorted(os.listdir(d)) == ["meta.json", "model.safetensors", "optimizer.safetensors"]
        assert checkpoint.read_meta(d) == {"step": 1}
    else:
        assert guarded(tmp_path, "save", d).startswith(f"ConfigError cannot write checkpoint file {d / victim}: it "
                                                        f"is a FIFO")
        assert stat.S_ISFIFO(os.stat(d / victim).st_mode)


def test_writing_a_file_whose_temporary_name_is_a_fifo_does_not_block(tmp_path):
    fifo(tmp_path / "config.json.tmp")
    assert guarded(tmp_path, "write", tmp_path / "config.json") == "done"
    assert (tmp_path / "config.json").read_text() == "{}" and not (tmp_path / "config.json.tmp").exists()


def test_an_oversized_meta_json_is_refused_before_it_is_read(tmp_path):
    small_checkpoint(tmp_path)
    with open(tmp_path / "meta.json", "r+b") as f:
        f.truncate(65 << 20)  # sparse: costs no disk
    with pytest.raises(PydtnnError, match="meta.json is 68,157,440 bytes; expected at most") as e:
        checkpoint.read_meta(tmp_path)
    one_line(e)


# -- 2. non-finite values -------------------------------------------------------------------------
@pytest.mark.parametrize("entry,value", [("5.weight", np.nan), ("1.running_var", np.inf), ("0.bias", -np.inf)])
def test_non_finite_parameters_or_buffers_in_a_checkpoint_are_refused(tmp_path, entry, value):
    saved(tmp_path)
    state = tensors(tmp_path)
    state[entry].flat[1] = value
    tamper(tmp_path, model=state)
    m = assert_load_refused(tmp_path, rf"model.safetensors.*'{entry}'.*(NaN|Inf)")
    before = {k: v.copy() for k, v in m.state_dict().items()}
    with pytest.raises(DataError, match=rf"'{entry}'.*(NaN|Inf)"):  # the same file as weights only
        checkpoint.load_weights(tmp_path / "model.safetensors", m)
    with pytest.raises(DataError, match=rf"'{entry}'.*(NaN|Inf)"):
        checkpoint.load_weights(tmp_path, m)
    assert all(np.array_equal(v, before[k]) for k, v in m.state_dict().items())


def test_non_finite_optimizer_state_is_refused(tmp_path):
    saved(tmp_path)
    arrays = tensors(tmp_path, "optimizer.safetensors")
    arrays["5.weight.exp_avg_sq"][0, 0] = np.nan
    tamper(tmp_path, optimizer=arrays)
    assert_load_refused(tmp_path, r"optimizer.safetensors.*'5\.weight\.exp_avg_sq'.*NaN")


def test_a_float64_value_beyond_float32_is_refused_for_a_float32_model(tmp_path):
    saved(tmp_path)
    state = {k: v.astype(np.float64) for k, v in tensors(tmp_path).items()}
    state["5.weight"][0, 0] = 1e300
    safetensors.numpy.save_file(state, str(tmp_path / "w.safetensors"))
    m = tiny(seed=3)
    before = m.params_sha256()
    with pytest.raises(DataError, match=r"'5\.weight'.*float32"):
        checkpoint.load_weights(tmp_path / "w.safetensors", m)
    assert m.params_sha256() == before


# -- 3. non-float tensors -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.bool_])
def test_integer_or_bool_model_tensors_in_a_checkpoint_are_refused(tmp_path, dtype):
    saved(tmp_path)
    state = tensors(tmp_path)
    state["5.weight"] = (state["5.weight"] * 1e3).astype(dtype)
    tamper(tmp_path, model=state)
    assert_load_refused(tmp_path, rf"model.safetensors.*'5\.weight' is {np.dtype(dtype).name}; expected")


def test_integer_optimizer_arrays_are_refused(tmp_path):
    saved(tmp_path)
    arrays = tensors(tmp_path, "optimizer.safetensors")
    arrays["0.bias.exp_avg"] = arrays["0.bias.exp_avg"].astype(np.int64)
    tamper(tmp_path, optimizer=arrays)
    assert_load_refused(tmp_path, r"optimizer.safetensors.*'0\.bias\.exp_avg' is int64")


# -- 4. model name and fingerprint ------------------------------------------------------------------
def test_a_checkpoint_of_another_model_name_is_refused_naming_both(tmp_path):
    saved(tmp_path)
    m = tiny(seed=3, name="lenet")  # the same layers under another name
    opt = optim.create("adam", m.parameters(), lr=0.01)
    before = snapshot(m, opt)
    with pytest.raises((ConfigError, ShapeError), match=r"meta.json.*'tiny'.*'lenet'") as e:
        checkpoint.load(tmp_path, m, opt)
    one_line(e)
    assert unchanged(before, m, opt)


def test_the_generic_model_name_loads_into_an_identical_build(tmp_path):
    a = tiny(name="model")  # Model's default name: a user-built model
    opt_a = optim.create("adam", a.parameters(), lr=0.01)
    train(a, opt_a)
    checkpoint.save(tmp_path / "a", a, opt_a)
    b = tiny(seed=3, name="model")
    checkpoint.load(tmp_path / "a", b, optim.create("adam", b.parameters(), lr=0.01))
    assert b.params_sha256() == a.params_sha256()
    c = tiny(seed=3, dtype=np.float64)  # float32 checkpoint into a float64 model, of the same name
    saved(tmp_path / "b")
    checkpoint.load(tmp_path / "b", c, optim.create("adam", c.parameters(), lr=0.01))


@pytest.mark.parametrize("edit,pattern", [
    (lambda s: s.__setitem__(-2, ["5.weight", [6, 64], "float32"]), r"'5\.weight'.*\(6, 64\).*\(5, 64\)"),
    (lambda s: s.pop(), r"'5\.bias'"),
    (lambda s: s.append(["head.weight", [2], "float32"]), r"'head\.weight'"),
])
def test_a_fingerprint_that_disagrees_with_the_tensor_file_is_refused(tmp_path, edit, pattern):
    saved(tmp_path)
    tamper(tmp_path, edit=lambda mf: edit(mf["model"]["state"]))
    m = tiny(seed=3)
    before = m.params_sha256()
    with pytest.raises(DataError, match=rf"meta.json.*{pattern}") as e:
        checkpoint.load(tmp_path, m)
    one_line(e)
    assert m.params_sha256() == before


@pytest.mark.parametrize("bad", ["tiny", [["0.weight"]], [["0.weight", "4x2", "float32"]], [[1, [4], "float32"]],
                                 {"0.weight": [4, 2, 3, 3]}])
def test_a_malformed_fingerprint_or_name_is_a_data_error(tmp_path, bad):
    saved(tmp_path)
    tamper(tmp_path, edit=lambda mf: mf["model"].__setitem__("state", bad))
    with pytest.raises(DataError, match=r"meta.json.*model\.state"):
        checkpoint.load(tmp_path, tiny(seed=3))
    tamper(tmp_path, edit=lambda mf: mf["model"].update(state=checkpoint.fingerprint(tiny()), name=["tiny"]))
    with pytest.raises(DataError, match=r"meta.json.*model\.name"):
        checkpoint.load(tmp_path, tiny(seed=3))


# -- 5. edited meta.json values ---------------------------------------------------------------------
def trainer_of(model, opt, seed=0):
    schedules = [sch.Cosine(10), sch.ReduceOnPlateau("val_loss", 0.5, 2)]
    return Trainer(model, SoftmaxCrossEntropy(), opt, progress=False, log=lambda msg: None, seed=seed,
                   schedules=schedules, callbacks=[EarlyStopping("val_loss", 3)])


def saved_run(directory):
    """A trainer after two epochs, saved as the command line saves it (resume.save_checkpoint)."""
    m = tiny()
    t = trainer_of(m, optim.create("sgd", m.parameters(), lr=0.05, momentum=0.9))
    train(m, t.optimizer)
    t.history = [{"epoch": 1, "loss": 1.5, "val_loss": 1.4, "lr": 0.05}, {"epoch": 2, "loss": 1.2, "val_loss": 1.3,
                                                                          "lr": 0.05}]
    t.schedules[1].best, t.schedules[1].wait = 1.3, 1
    t.callbacks[0].best, t.callbacks[0].wait, t.callbacks[0].best_epoch = 1.3, 0, 2
    t.model.backend.rng.random(3)
    run.save_checkpoint(directory, t, 1, {"model": "tiny", "num_epochs": 10})
    return t


def trainer_state(t):
    return (t.model.params_sha256(), json.dumps(t.optimizer.state_dict()["scalars"]),
            json.dumps(checkpoint.rng_state(t.model.backend.rng)), t.base_lr, json.dumps(t.history),
            json.dumps([s.state_dict() for s in t.schedules]), json.dumps(t.callbacks[0].state_dict()),
            {k: v.copy() for k, v in t.optimizer.state_dict()["arrays"].items()})


def test_resume_restores_what_save_checkpoint_wrote(tmp_path):
    a = saved_run(tmp_path)
    m = tiny(seed=3)
    b = trainer_of(m, optim.create("sgd", m.parameters(), lr=0.05, momentum=0.9))
    assert run.resume(tmp_path, b) == 2
    sa, sb = trainer_state(a), trainer_state(b)
    assert sa[:7] == sb[:7]


def test_resume_reads_a_meta_json_written_before_the_checks(tmp_path):
    """The meta of a checkpoint written by an earlier pydtnn, key for key, still resumes."""
    m = tiny()
    opt = optim.create("sgd", m.parameters(), lr=0.05, momentum=0.9)
    train(m, opt)
    meta = {"epoch": 3, "config": {"model": "tiny", "num_epochs": 10, "dropout": None, "lr_schedulers": ""},
            "step": 2, "world_size": 1, "rng": checkpoint.rng_state(np.random.default_rng(5)), "base_lr": 0.05,
            "schedules": [{}, {"best": None, "wait": 0, "reductions": 0}],
            "callbacks": [{"best": None, "wait": 0, "best_epoch": None}],
            "history": [{"epoch": 1, "loss": 2.0, "accuracy": 0.1, "val_loss": None, "lr": 0.05, "time_s": 0.1,
                         "samples_per_second": None}] * 3}
    checkpoint.save(tmp_path, m, opt, meta)
    m2 = tiny(seed=3)
    t = trainer_of(m2, optim.create("sgd", m2.parameters(), lr=0.05, momentum=0.9))
    assert run.resume(tmp_path, t) == 3
    assert t.history == meta["history"] and t.base_lr == 0.05 and m2.params_sha256() == m.params_sha256()
    del meta["world_size"]  # optional: a resume at another process count assumes one
    checkpoint.save(tmp_path, m, opt, meta)
    assert run.resume(tmp_path, trainer_of(m2, optim.create("sgd", m2.parameters(), lr=0.05, momentum=0.9))) == 3


_PHILOX = {"bit_generator": "Philox", "state": {"counter": [0, 0, 0, 0], "key": [1, 2]}, "buffer": [0, 0, 0, 0],
           "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
_PCG = {"bit_generator": "PCG64", "state": {"state": 1, "inc": 3}, "has_uint32": 0, "uinteger": 0}


@pytest.mark.parametrize("key,value", [
    ("rng", None), ("history", None), ("epoch", None), ("base_lr", None), ("schedules", None), ("callbacks", None),
    ("epoch", "3"), ("epoch", -1), ("epoch", 1.5), ("epoch", True),
    ("base_lr", "0.05"), ("base_lr", float("nan")), ("base_lr", -0.1), ("base_lr", float("inf")), ("base_lr", 10**400),
    ("config", [1, 2]), ("config", "model"),
    ("history", "now"), ("history", [1, 2]), ("history", [{"loss": [1]}]), ("history", {"loss": 1}),
    ("schedules", "cosine"), ("schedules", [1, 2]), ("schedules", [{}, {"best": "x", "wait": 0, "reductions": 0}]),
    ("schedules", [{"decay": 5}, {"best": None, "wait": 0, "reductions": 0}]),
    ("schedules", [{}, {"best": None, "wait": 1.5, "reductions": 0}]),
    ("callbacks", {}), ("callbacks", [[]]), ("callbacks", [{"best": None, "wait": 0}]),
    ("step", "2"), ("step", -2), ("step", 2.5), ("world_size", 0), ("world_size", "1"),
    ("world_size", 10**30), ("epoch", 2**60), ("step", 10**20),
    ("schedules", [{}, {"best": None, "wait": 0, "reductions": 10**6}]),
    ("schedules", [{}, {"best": float("nan"), "wait": 0, "reductions": 0}]),
    ("callbacks", [{"best": float("inf"), "wait": 0, "best_epoch": None}]),
    ("rng", "pcg"), ("rng", []), ("rng", {**_PCG, "state": "x"}), ("rng", {**_PCG, "state": {"state": -1, "inc": 3}}),
    ("rng", {**_PCG, "state": {"state": [1], "inc": 3}}), ("rng", {**_PCG, "bit_generator": "MT19937"}),
    ("rng", {"bit_generator": "PCG64"}),
])
def test_edited_training_meta_is_one_data_error_and_restores_nothing(tmp_path, key, value):
    saved_run(tmp_path)
    tamper(tmp_path, edit=lambda mf: mf["meta"].pop(key) if value is None else mf["meta"].__setitem__(key, value))
    m = tiny(seed=3)
    t = trainer_of(m, optim.create("sgd", m.parameters(), lr=0.05, momentum=0.9), seed=3)
    before = trainer_state(t)
    with pytest.raises(PydtnnError) as e:
        run.resume(tmp_path, t)
    msg = one_line(e)
    assert "meta.json" in msg and key in msg, msg
    assert isinstance(e.value, DataError), msg
    after = trainer_state(t)
    assert after[:7] == before[:7] and all(np.array_equal(v, after[7][k]) for k, v in before[7].items())


def test_deeply_nested_meta_json_is_a_data_error(tmp_path):
    saved_run(tmp_path)
    text = (tmp_path / "meta.json").read_text()
    (tmp_path / "meta.json").write_text(text.replace('"history":', '"deep": ' + "[" * 100_000 + "]" * 100_000
                                                      + ', "history":', 1))
    m = tiny(seed=3)
    with pytest.raises(DataError, match="meta.json.*nest") as e:
        run.resume(tmp_path, trainer_of(m, optim.create("sgd", m.parameters(), lr=0.05, momentum=0.9)))
    one_line(e)
    with pytest.raises(DataError, match="meta.json.*nest"):
        checkpoint.read_meta(tmp_path)


@pytest.mark.parametrize("scalars,pattern", [
    ([], r"optimizer\.scalars"), ("lr", r"optimizer\.scalars"), (None, r"optimizer\.scalars"),
    ({"step": "2"}, r"step"), ({"step": -1}, r"step"), ({"step": 1.5}, r"step"), ({"step": True}, r"step"),
    ({"lr": float("nan")}, r"lr"), ({"lr": "0.1"}, r"lr"), ({"lr": 10**400}, r"lr"), ({"lr": [0.1]}, r"lr"),
    ({"momentum": {"x": 1}}, r"momentum"), ({"nesterov": "yes"}, r"nesterov"), ({"lr": -1.0}, r"lr"),
])
def test_invalid_optimizer_scalars_are_refused_naming_the_key(tmp_path, scalars, pattern):
    m0 = tiny()
    opt0 = optim.create("sgd", m0.parameters(), lr=0.05, momentum=0.9)
    train(m0, opt0)
    checkpoint.save(tmp_path, m0, opt0)

    def edit(mf):
        if isinstance(scalars, dict):
            mf["optimizer"]["scalars"].update(scalars)
        elif scalars is None:
            del mf["optimizer"]["scalars"]
        else:
            mf["optimizer"]["scalars"] = scalars

    tamper(tmp_path, edit=edit)
    m = tiny(seed=3)
    opt = optim.create("sgd", m.parameters(), lr=0.05, momentum=0.9)
    before = snapshot(m, opt)
    with pytest.raises((DataError, ConfigError), match=rf"meta.json.*{pattern}") as e:
        checkpoint.load(tmp_path, m, opt)
    one_line(e)
    assert unchanged(before, m, opt)


@pytest.mark.parametrize("bitgen,state", [
    (np.random.MT19937, {"bit_generator": "MT19937", "state": {"key": ["a"] * 624, "pos": 0}}),
    (np.random.MT19937, {"bit_generator": "MT19937", "state": {"key": [-1] * 624, "pos": 0}}),
    (np.random.MT19937, {"bit_generator": "MT19937", "state": {"key": [1, 2], "pos": 0}}),
    (np.random.MT19937, {"bit_generator": "MT19937", "state": {"key": [[1]] * 624, "pos": "x"}}),
    (np.random.MT19937, {"bit_generator": "MT19937", "state": {"key": [2**40] * 624, "pos": 0}}),
    (np.random.MT19937, {"bit_generator": "MT19937", "state": {"key": [1] * 624, "pos": 10**8}}),  # NumPy: crash
    (np.random.MT19937, {"bit_generator": "MT19937", "state": {"key": [1] * 624, "pos": -5}}),
    (np.random.Philox, {**_PHILOX, "buffer_pos": -10**8}),
    (np.random.Philox, {**_PHILOX, "buffer_pos": 5}),
    (np.random.PCG64, {**_PCG, "state": {"state": "x", "inc": 1}}),
    (np.random.PCG64, {**_PCG, "state": {"state": 2**200, "inc": 1}}),
    (np.random.PCG64, {**_PCG, "state": {"state": -5, "inc": 1}}),
    (np.random.PCG64, {**_PCG, "state": [1, 2]}),
    (np.random.PCG64, {"bit_generator": "PCG64"}),
    (np.random.PCG64, {**_PCG, "has_uint32": "x"}),
    (np.random.Philox, {"bit_generator": "Philox", "state": {"counter": [1], "key": [1, 2]}}),
    (np.random.PCG64, ["PCG64"]),
    (np.random.PCG64, {"bit_generator": ["PCG64"]}),
])
def test_set_rng_state_refuses_malformed_states_and_keeps_the_generator(bitgen, state):
    g = np.random.Generator(bitgen(7))
    before = json.dumps(checkpoint.rng_state(g))
    with pytest.raises((ConfigError, DataError)) as e:
        checkpoint.set_rng_state(g, state)
    one_line(e)
    assert json.dumps(checkpoint.rng_state(g)) == before


@pytest.mark.parametrize("saved,ranks,words", [
    (np.zeros((2, 6), np.int32), 2, "int32"),
    (np.zeros((2, 6), np.float16), 2, "float16"),
    (np.zeros((2, 5), np.float32), 2, "shape (2, 5)"),
    (np.zeros((3, 6), np.float32), 2, "2 rows"),
    (np.zeros(6, np.float32), 1, "shape (6,)"),
])
def test_reducer_state_of_the_wrong_kind_is_refused(saved, ranks, words):
    """A topk residual is floating point, one row per saved process, each of this run's shape; anything else is a
    DataError before anything is restored."""
    from types import SimpleNamespace

    own = {"residual": np.zeros(6, np.float32)}
    model = SimpleNamespace(pipeline=None, parameters=lambda: [("w", None, None)],
                            state_layout=lambda: {"w": ((2, 3), np.dtype(np.float32))})
    trainer = SimpleNamespace(reducer=SimpleNamespace(state_dict=lambda: own), model=model)
    extras = {f"{checkpoint.EXTRA}reducer.residual": saved}
    with pytest.raises(DataError, match="reducer state residual") as e:
        run.check_reducer_state(trainer, extras, "ck/meta.json", ranks)
    assert words in str(e.value), str(e.value)
    run.check_reducer_state(trainer, {f"{checkpoint.EXTRA}reducer.residual": np.zeros((ranks, 6), np.float32)},
                            "ck/meta.json", ranks)
