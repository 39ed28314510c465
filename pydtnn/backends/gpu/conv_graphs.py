"""The cuDNN frontend graphs of a GPU backend's convolutions."""

import collections
import contextlib

from pydtnn.backends.gpu.device import require_cudnn


class ConvGraphs:
    """cuDNN frontend graphs for one backend, built once per (operation, batch, geometry, weight shape).

    fprop: Y = conv(X, W); dgrad: DX = conv_dgrad(DY, W); wgrad: DW = conv_wgrad(X, DY). NCHW tensors,
    grouped convolutions through the weight's channel count (C / groups), float32 compute.

    At most `max_graphs` are kept, the least recently used dropped first (a run sees a few batch sizes:
    training, its last smaller batch, evaluation; a program that feeds many sizes does not grow without
    bound). All graphs share one workspace, grown to the largest asked: they run on one stream, one
    after the other.
    """

    def __init__(self, backend, max_graphs=1024):
        self.backend = backend
        self.cudnn = require_cudnn()
        self.handle = self.cudnn.create_handle()
        self.cache = collections.OrderedDict()
        self.max_graphs = max_graphs
        self.workspace = None

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the library may be gone already
            self.cudnn.destroy_handle(self.handle)

    def run(self, kind, n, g, w_shape, arrays):
        key = (kind, n, g, tuple(w_shape))
        entry = self.cache.get(key)
        if entry is None:
            entry = self.cache[key] = self._build(kind, n, g, tuple(w_shape))
            while len(self.cache) > self.max_graphs:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        graph, tensors, ws_size = entry
        ws = self._workspace(ws_size)
        cp = self.backend.cupy
        self.cudnn.set_stream(handle=self.handle, stream=cp.cuda.get_current_stream().ptr)
        graph.execute({tensors[k]: v for k, v in arrays.items()}, ws, handle=self.handle)

    def _workspace(self, size):
        cp = self.backend.cupy
        if self.workspace is None or self.workspace.size < size:
            self.workspace = cp.empty(max(size, 1), cp.uint8)
        return self.workspace

    def _build(self, kind, n, g, w_shape):
        cudnn = self.cudnn
        f32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32,
                              handle=self.handle)
        x_dim = [n, g.c, g.h, g.w]
        y_dim = [n, w_shape[0], g.ho, g.wo]
        conv = {"pre_padding": [g.pt, g.pl], "post_padding": [g.pb, g.pr], "stride": [g.sh, g.sw],
                "dilation": [g.dh, g.dw], "compute_data_type": f32}

        def tensor(name, dim):
            return graph.tensor(name=name, dim=list(dim), stride=_row_major(dim), data_type=f32)

        if kind == "fprop":
            t = {"X": tensor("X", x_dim), "W": tensor("W", w_shape)}
            t["Y"] = graph.conv_fprop(image=t["X"], weight=t["W"], **conv)
            out, dim = t["Y"], y_dim
        elif kind == "dgrad":
            t = {"DY": tensor("DY", y_dim), "W": tensor("W", w_shape)}
            t["DX"] = graph.conv_dgrad(loss=t["DY"], filter=t["W"], **conv)
            out, dim = t["DX"], x_dim
        else:
            t = {"X": tensor("X", x_dim), "DY": tensor("DY", y_dim)}
            t["DW"] = graph.conv_wgrad(image=t["X"], loss=t["DY"], **conv)
            out, dim = t["DW"], w_shape
        out.set_output(True).set_dim(list(dim)).set_stride(_row_major(dim)).set_data_type(f32)
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
        except Exception as e:  # the frontend's own error, with what was being built added to it
            raise with_context(e, f"while building the cuDNN graph of conv {kind} with batch {n}, weight {w_shape}, "
                                  f"{g}") from None
        return graph, t, graph.get_workspace_size()


def with_context(error, context):
    """`error` itself, its message kept whole, with `context` added: a note (Python 3.11+), else a line in
    its arguments. The caller raises what this returns, so the type the library chose is kept."""
    if hasattr(error, "add_note"):
        error.add_note(context)
    else:
        error.args = (f"{error.args[0] if error.args else ''} ({context})",) + tuple(error.args[1:])
    return error


def _row_major(dim):
    strides, acc = [], 1
    for d in reversed(list(dim)):
        strides.append(acc)
        acc *= d
    return strides[::-1]
