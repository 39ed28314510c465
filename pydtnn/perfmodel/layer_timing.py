"""A layer profile measured here (layer_profile.py says what it holds): every leaf layer of some models timed
forward and backward through the model's own per-layer spans, on one process.

    profile = measure(["resnet20_cifar10"], batches=(16, 64), threads=(1,))
"""

import statistics

from pydtnn.perfmodel.layer_profile import LayerProfile


def measure(models, batches, threads=(1,), steps=5, warmup=2, progress=None, into=None):
    """The LayerProfile of every leaf layer of `models` (registered names) at each of `batches` and `threads`;
    into: a LayerProfile whose entries the new ones join (replacing those measured again)."""
    from pydtnn import runtime
    from pydtnn.perfmodel.calibrate import cores, cpu_model
    from pydtnn.perfmodel.simulate import build_model

    progress = progress or (lambda line: None)
    layers = {k: {t: dict(v) for t, v in by_t.items()} for k, by_t in (into.layers if into else {}).items()}
    before = runtime.configured()
    try:
        for name in models:
            built_name, model = build_model(name)
            for t in threads:
                runtime.configure(threads=t)
                for b in batches:
                    for sig, times in _model_times(model, b, steps, warmup).items():
                        layers.setdefault(sig, {}).setdefault(t, {})[b] = times
                    progress(f"{built_name}: batch {b}, {t} thread{'s' if t > 1 else ''}")
    finally:
        if before is not None:
            runtime.configure(threads=before["threads"])
    about = dict(into.about) if into else {}
    about.update(cpu=cpu_model(), cores=cores(), steps=steps, warmup=warmup)
    about["models"] = sorted(set(about.get("models", [])) | set(models))
    return LayerProfile(layers, about)


def _model_times(model, batch, steps, warmup):
    """{signature: (forward_s, backward_s)} of `model`'s leaf layers over `steps` timed forward + backward steps
    of `batch` random samples."""
    import numpy as np

    from pydtnn.perfmodel.costs import layer_costs
    from pydtnn.profiling.tracer import Tracer

    rng = np.random.default_rng(0)
    x = model.random_input(batch, rng, np.float32)
    dy = rng.standard_normal((batch, *model.output_shape)).astype(np.float32) / batch
    spans = {}
    model.train()
    for step in range(warmup + steps):
        tracer = Tracer() if step >= warmup else None
        model.set_tracer(tracer)
        model.forward(x, training=True)
        model.backward(dy)
        for ev in tracer.events if tracer else ():
            spans.setdefault((ev["name"], ev["cat"]), []).append(ev["dur"] / 1e6)
    model.set_tracer(None)
    by_sig = {}
    for c in layer_costs(model, batch):
        fwd, bwd = spans.get((c.name, "forward")), spans.get((c.name, "backward"))
        if fwd and bwd:
            by_sig.setdefault(c.signature, []).append((statistics.median(fwd), statistics.median(bwd)))
    return {sig: tuple(statistics.median(t[k] for t in pairs) for k in (0, 1)) for sig, pairs in by_sig.items()}
