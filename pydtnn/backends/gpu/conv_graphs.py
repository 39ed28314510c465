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
        self.stream = None  # the stream the handle was last given

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
        ws = self._workspace(entry.workspace_size)
        stream = self.backend.cupy.cuda.get_current_stream().ptr
        if stream != self.stream:
            self.cudnn.set_stream(handle=self.handle, stream=stream)
            self.stream = stream
        if entry.uids is not None:  # buffers by position: the frontend caches the rest of the call by value
            try:
                entry.graph.execute([arrays[k] for k in entry.order], ws, handle=self.handle, tensor_uids=entry.uids)
                return
            except Exception:  # noqa: BLE001 (a frontend without positional buffers: the mapping form from now on)
                entry.uids = None
        entry.graph.execute({entry.tensors[k]: v for k, v in arrays.items()}, ws, handle=self.handle)

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
            return graph.tensor(name=name, dim=list(dim), stride=_row_major(dim), data_type=f32, uid=UIDS[name])

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
        out_name = next(k for k, v in t.items() if v is out)
        try:
            out.set_uid(UIDS[out_name])
            order = tuple(t)
            uids = tuple(UIDS[k] for k in order)
        except Exception:  # noqa: BLE001 (no uid for outputs in this frontend: tensors by mapping only)
            order = uids = None
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
        except Exception as e:  # the frontend's own error, with what was being built added to it
            raise with_context(e, f"while building the cuDNN graph of conv {kind} with batch {n}, weight {w_shape}, "
                                  f"{g}") from None
        return _Entry(graph, t, graph.get_workspace_size(), order, uids)


class _Entry:
    """A built graph: its tensors by name, workspace size, and the names and uids of its buffers in order."""

    __slots__ = ("graph", "order", "tensors", "uids", "workspace_size")

    def __init__(self, graph, tensors, workspace_size, order, uids):
        self.graph, self.tensors, self.workspace_size, self.order, self.uids = graph, tensors, workspace_size, order, uids


# each tensor's uid in its graph (a graph has three)
UIDS = {"X": 1, "W": 2, "Y": 3, "DY": 4, "DX": 5, "DW": 6}


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
