"""pydtnn-train's flags: one parser (build_parser), its flags in four groups, each with its type, default and
help. pydtnn.cli parses with it (defaults < --config < a checkpoint's < the command line); the performance
model's planner parses the layouts it weighs with it, so a planned layout is one the trainer takes.
"""

import argparse
import os
import sys

from pydtnn.argtypes import (
    Parser,
    fraction,
    non_negative_float,
    non_negative_int,
    number,
    parse_bool,
    positive_float,
    positive_int,
    share,
)

SCHEDULERS = ("warm_up", "reduce_lr_on_plateau", "reduce_lr_every_nepochs", "cosine", "early_stopping",
              "stop_at_loss", "model_checkpoint")


def scheduler_list(text):
    from pydtnn.suggest import did_you_mean

    names = [s.strip() for s in str(text).split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEDULERS]
    if bad:
        hint = did_you_mean(bad[0], SCHEDULERS)
        raise argparse.ArgumentTypeError(f"unknown scheduler {bad[0]!r}{hint or ';'} expected a comma list of "
                                         f"{', '.join(SCHEDULERS)}")
    return ",".join(names)


def program_name(argv0=None):
    """How the user started this program, for --help and usage lines: 'pydtnn-train', 'python -m pydtnn'
    or 'python train.py'."""
    base = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    if base in ("__main__.py", "-m"):
        return "python -m pydtnn"
    if base in ("-c", ""):  # python -c, an embedded interpreter: no command to name
        return "pydtnn"
    return f"python {base}" if base.endswith(".py") else base


def build_parser(suppress_defaults=False):
    """The parser; with suppress_defaults, parse_args returns only the flags actually given."""
    p = Parser(prog=program_name(), description="Train and evaluate a model with pydtnn.", allow_abbrev=False,
               argument_default=argparse.SUPPRESS if suppress_defaults else None)
    for add in (_model_and_data_flags, _optimizer_flags, _parallel_flags, _device_and_output_flags):
        add(p)
    return p


def _model_and_data_flags(p):
    """The model, its batch and epochs, and the data (PyDTNN's names)."""
    from pydtnn import data, recompute

    f = p.flag

    g = p.add_argument_group("model")
    f(g, "model", default="simplecnn", help="architecture (see --list_models); default simplecnn")
    f(g, "model_file", default=None,
      help="a Python file defining create_model(input_shape, num_classes) that returns the model's layers, in place "
           "of --model (docs/layers.md); it runs as Python: give only files you trust")
    f(g, "list_models", type=parse_bool, default=False, help="print the model zoo and exit")
    f(g, "batch_size", type=positive_int, default=None,
      help="samples per step and process (default 64; 16 for VGG without BatchNorm, see docs/models.md)")
    f(g, "global_batch_size", type=positive_int, default=None,
      help="samples per step over all processes; must divide by the process count (sets --batch_size)")
    f(g, "num_epochs", type=positive_int, default=None,
      help="epochs to train (default 10; 7 for VGG without BatchNorm, see docs/models.md)")
    f(g, "recompute", choices=recompute.MODES, default="none",
      help="activation recomputation: keep only the inputs of segments of about sqrt(L) layers (segments) or of "
           "every layer (all) in forward, and run each segment's forward again in backward; same results, less "
           "memory, one more forward (default none)")
    f(g, "accumulation_steps", aliases=("micro_batches",), type=positive_int, default=1,
      help="split each step's batch into this many micro-batches, summing gradients (BatchNorm statistics per "
           "micro-batch): one reduction and one update per step, activation memory of a micro-batch (default 1)")
    f(g, "steps_per_epoch", type=positive_int, default=None, help="cap on steps per epoch (default: whole dataset)")
    f(g, "dtype", choices=("float32", "float64"), default="float32", help="parameters and activations (default float32)")
    f(g, "evaluate", type=parse_bool, default=False, help="evaluate on the test set before and after training")
    f(g, "evaluate_only", type=parse_bool, default=False, help="only evaluate on the test set (inference throughput)")
    f(g, "weights_and_bias_filename", default=None,
      help="initial weights: a .safetensors state dict (ours or PyTorch's, same names) or a checkpoint directory")
    f(g, "summary", type=parse_bool, default=False, help="print the per-layer summary before training")

    g = p.add_argument_group("dataset")
    f(g, "dataset", default="mnist5k", help=f"{', '.join(data.NAMES)} (default mnist5k: 5,000 embedded MNIST digits)")
    f(g, "dataset_train_path", default=None,
      help="directory holding the training files (a text dataset: a UTF-8 file or a folder of them)")
    f(g, "dataset_test_path", default=None, help="directory holding the test files (default: the training one)")
    f(g, "download", type=parse_bool, default=False,
      help="fetch mnist, fashion_mnist, cifar10, cifar100 or tiny_shakespeare into the data directory ($PYDTNN_DATA, "
           "else ~/.cache/pydtnn) when no copy is there; a copy already there is always found")
    f(g, "context_length", type=positive_int, default=None,
      help="a text dataset's window of tokens (default: the model's design context, 128 for a model file)")
    f(g, "tokenizer", choices=("chars", "bytes"), default="chars",
      help="a text dataset's tokens: its characters (the vocabulary saved with the checkpoint) or UTF-8 bytes")
    f(g, "validation_split", type=fraction, default=0.0, help="fraction of the training set held out for validation")
    f(g, "test_as_validation", type=parse_bool, default=False, help="validate on the test set after every epoch")
    _add_dataset_flags(p, g)



def _optimizer_flags(p):
    """The optimizer, its loss and metrics, and the learning-rate schedules and callbacks."""
    from pydtnn import losses, metrics, optim
    from pydtnn.models.families import DEFAULT_LR

    f = p.flag

    g = p.add_argument_group("optimizer")
    f(g, "optimizer", default=None, choices=optim.NAMES,
      help="default: the model family's (adamw for ViT, see docs/models.md), else sgd")
    f(g, "learning_rate", type=non_negative_float, default=None,
      help="per process, before --learning_rate_scaling; default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_LR.items())
           + " (sgd: 0.005 for VGG without BatchNorm, see docs/models.md)")
    f(g, "momentum", type=fraction, default=None, help="SGD/RMSProp momentum (default: sgd 0.9, rmsprop 0)")
    f(g, "nesterov", type=parse_bool, default=False, help="Nesterov momentum for SGD")
    f(g, "decay", type=non_negative_float, default=None,
      help="weight decay: L2 added to the gradient, decoupled for adamw (default 0, adamw 0.01)")
    f(g, "beta1", type=fraction, default=0.9, help="Adam/AdamW/Nadam beta1 (default 0.9)")
    f(g, "beta2", type=fraction, default=0.999, help="Adam/AdamW/Nadam beta2 (default 0.999)")
    f(g, "epsilon", type=positive_float, default=1e-8, help="denominator epsilon (default 1e-8)")
    f(g, "rho", type=fraction, default=0.99, help="RMSProp decay of the squared average (default 0.99)")
    f(g, "loss_func", default="categorical_cross_entropy", choices=losses.NAMES, help="default categorical_cross_entropy")
    f(g, "metrics", default="accuracy", help=f"comma list of {', '.join(metrics.NAMES)}, topK_accuracy")

    g = p.add_argument_group("schedules and callbacks")
    f(g, "lr_schedulers", type=scheduler_list, default=None,
      help=f"comma list of {', '.join(SCHEDULERS)} (default none; cosine for VGG without BatchNorm, see docs/models.md)")
    f(g, "warm_up_epochs", type=non_negative_int, default=5, help="warm_up: epochs of linear ramp (default 5)")
    f(g, "warm_up_start_factor", type=number(float, 0.0, lo_open=True, hi=1.0000001), default=None,
      help="warm_up: starting fraction of the learning rate (default 1/processes, or 0.1 with one process)")
    f(g, "cosine_min_factor", type=number(float, 0.0, hi=1.0000001), default=0.0,
      help="cosine: final fraction of the learning rate (default 0)")
    f(g, "reduce_lr_on_plateau_metric", default="val_loss", help="default val_loss")
    f(g, "reduce_lr_on_plateau_factor", type=number(float, 0.0, lo_open=True, hi=1.0), default=0.1, help="default 0.1")
    f(g, "reduce_lr_on_plateau_patience", type=non_negative_int, default=5, help="default 5")
    f(g, "reduce_lr_on_plateau_min_lr", type=non_negative_float, default=0.0, help="default 0")
    f(g, "reduce_lr_every_nepochs_factor", type=number(float, 0.0, lo_open=True, hi=1.0000001), default=0.1, help="default 0.1")
    f(g, "reduce_lr_every_nepochs_nepochs", type=positive_int, default=5, help="default 5")
    f(g, "reduce_lr_every_nepochs_min_lr", type=non_negative_float, default=0.0, help="default 0")
    f(g, "early_stopping_metric", default="val_loss", help="default val_loss")
    f(g, "early_stopping_patience", type=non_negative_int, default=10, help="default 10")
    f(g, "stop_at_loss_metric", default="val_accuracy", help="default val_accuracy")
    f(g, "stop_at_loss_threshold", type=float, default=0.0, help="default 0")
    f(g, "model_checkpoint_save_freq", type=positive_int, default=1, help="epochs between checkpoints (default 1)")



def _parallel_flags(p):
    """Data, model and hybrid parallelism, and how gradients are reduced."""
    from pydtnn.distributed import reducers
    from pydtnn.distributed.pipeline import SCHEDULES
    from pydtnn.plan import PARALLEL

    f = p.flag

    g = p.add_argument_group("parallel")
    f(g, "parallel", choices=(*PARALLEL, "auto"), default=None,
      help="over MPI when launched with several processes: data (each process a model replica, the default), "
           "model (every Conv2D and Dense split by output channels over all processes), hybrid (groups of "
           "--model_parallel_size processes split the model, or --pipeline_stages processes hold a pipeline, data "
           "parallel across groups) or pipeline (the layers cut into --pipeline_stages stages, one per process); "
           "auto: the performance model's fastest layout that fits in --memory_per_process, data where none is "
           "predicted more than 5 percent faster (pydtnn-perfmodel plan); docs/parallelism.md")
    f(g, "memory_per_process", type=positive_float, default=None,
      help="--parallel auto: GB (10^9 bytes) a process may hold for training, beside the interpreter and "
           "libraries (default: no limit)")
    f(g, "model_parallel_size", type=positive_int, default=None,
      help="--parallel hybrid: processes per model replica (a divisor of the process count); with "
           "--pipeline_stages, processes per stage")
    f(g, "pipeline_stages", type=positive_int, default=None,
      help="--parallel pipeline: the consecutive stages the model is cut into, one per process (S = the process "
           "count); --parallel hybrid: stages per pipeline, np / (S x M) pipelines data parallel (M: "
           "--model_parallel_size, default 1); each step runs --micro_batches micro-batches through them")
    f(g, "pipeline_schedule", choices=SCHEDULES, default="1f1b",
      help="--parallel pipeline: all forwards then all backwards (gpipe), or one forward and one backward in turn "
           "once the pipe is full (1f1b, the default: fewer micro-batches' activations held); same results")
    f(g, "stage_boundaries", default=None,
      help="--parallel pipeline: the layers (dotted paths, comma-separated) where stages 2.. begin, in place of "
           "the cut that balances the stages' predicted time")
    f(g, "zero", type=int, choices=(0, 1, 2, 3), default=0,
      help="sharded data parallelism (ZeRO) over the model replicas: 1 keeps each replica's optimizer state for "
           "its 1/R shard of the parameters only, updates that shard and allgathers the shards; 2 also "
           "reduce-scatters the gradients (each replica receives its shard's average); 3 also keeps only the "
           "shard of the parameters, each layer's gathered just before it runs; 0 (default) does none of this; "
           "docs/parallelism.md")
    f(g, "non_blocking_mpi", type=parse_bool, default=False, help="overlap gradient allreduces with backward")
    f(g, "reduction", choices=reducers.NAMES, default=None,
      help="gradient reduction: one allreduce after backward, one per gradient as layers finish "
           "(= --non_blocking_mpi), buckets started as they fill (default), buckets reduced within each "
           "node then between nodes (hierarchical), or each rank's largest entries with error feedback "
           "(topk, --density), the same summed region by region with O(k) bytes per process (oktopk, --density), "
           "or a low-rank approximation of each matrix with error feedback (powersgd, --rank); docs/distributed.md")
    f(g, "reduction_staleness", type=int, choices=(0, 1), default=0,
      help="1: each step's update applies the previous step's gradients, reduced in one allreduce during this "
           "step's forward and backward (hidden; changes the algorithm: one step stale); replaces --reduction; "
           "0: the default, no delay; docs/distributed.md")
    f(g, "gradient_compression", choices=reducers.COMPRESSIONS, default="none",
      help="wire format of gradient reductions: fp16 halves the bytes, rounds every gradient to fp16 "
           "(each scaled by a power of two into its range)")
    f(g, "bucket_size_mb", type=positive_float, default=25.0,
      help="bucketed, hierarchical: bucket size in MB (default 25)")
    f(g, "ranks_per_node", type=positive_int, default=None,
      help="hierarchical, powersgd with --powersgd_hierarchical: processes per node, consecutive ranks (default: "
           "those sharing memory)")
    _lossy_reduction_flags(f, g)
    f(g, "reduction_progress", choices=reducers.PROGRESS, default="test",
      help="per_layer, bucketed: how outstanding gradient allreduces advance during backward: test (MPI entered "
           "between layers, the default) or thread (a helper thread enters MPI every 0.2 ms; needs "
           "MPI_THREAD_MULTIPLE). MPICH's own progress thread: MPIR_CVAR_ASYNC_PROGRESS=1; docs/distributed.md")
    f(g, "learning_rate_scaling", type=parse_bool, default=True,
      help="multiply the learning rate by the process count when --batch_size is per process "
           "(Goyal et al.; not with --global_batch_size, whose global batch does not grow)")
    f(g, "sync_batchnorm", type=parse_bool, default=False,
      help="BatchNorm statistics over the global batch (two small allreduces per layer and step)")
    f(g, "drop_last", type=parse_bool, default=False, help="skip each epoch's last, smaller global batch")
    f(g, "stall_timeout", type=non_negative_float, default=300.0,
      help="seconds a collective may wait before the job reports which ranks have not arrived and aborts (0: off)")
    f(g, "debug_collectives", type=parse_bool, default=False,
      help="check before every collective that all ranks issue the same one (op, dtype, size, number)")
    f(g, "threads_per_process", type=non_negative_int, default=1,
      help="BLAS threads per process when several are launched (default 1; 0 leaves the library's choice; at most "
           "4 per core this process may use and at least 64, at any process count)")



def _lossy_reduction_flags(f, g):
    """The options of the reducers that send less than the gradients (topk, powersgd, local SGD), in group g."""
    f(g, "local_sgd", type=non_negative_int, default=0,
      help="local SGD: each process steps on its own gradients, and every H steps (and at each epoch's end) the "
           "processes average their parameters and optimizer state; replaces --reduction (default 0: off); "
           "docs/distributed.md")
    f(g, "average", choices=("plain", "weighted"), default="plain",
      help="--local_sgd: each process's copy weighted 1/P (plain, the default) or by the mean of its shares of the "
           "global batches since the last average (weighted)")
    f(g, "post_local_sgd", type=non_negative_int, default=0,
      help="--local_sgd: the first K steps are data parallel (gradients summed every step), the local steps "
           "after them (post-local SGD; default 0)")
    f(g, "density", type=share, default=0.01,
      help="topk, oktopk: the share of gradient entries each process selects per step, in (0, 1] (default 0.01)")
    f(g, "topk_selection", choices=("global", "per_layer"), default="global",
      help="topk: the largest entries of all gradients together (global, the default) or of each layer's gradient "
           "separately (per_layer, as Deep Gradient Compression selects)")
    f(g, "density_warmup_epochs", type=non_negative_int, default=0,
      help="topk, oktopk: epochs over which the density falls geometrically from 0.25 to --density (Deep Gradient "
           "Compression's warm-up; default 0: --density from the first step)")
    f(g, "momentum_correction", type=parse_bool, default=False,
      help="topk, oktopk with SGD: each process applies SGD's momentum to its own gradients before selecting, and clears "
           "what it sends (Deep Gradient Compression's momentum correction and factor masking); the optimizer "
           "then runs without momentum (default false)")
    f(g, "oktopk_threshold_every", type=positive_int, default=32,
      help="oktopk: steps between exact estimates of the local and global thresholds, counted from each epoch's "
           "first step (PyDTNN's and Ok-Topk's tau; default 32)")
    f(g, "oktopk_repartition_every", type=positive_int, default=64,
      help="oktopk: steps between new region boundaries of the split and reduce, counted from each epoch's first "
           "step (Ok-Topk's tau'; default 64)")
    f(g, "rank", type=positive_int, default=4,
      help="powersgd: the rank of each gradient matrix's approximation (default 4)")
    f(g, "powersgd_hierarchical", type=parse_bool, default=False,
      help="powersgd: its two allreduces in two levels, as the hierarchical reducer's: summed into each node's "
           "leader, allreduced among the leaders, broadcast back (nodes: --ranks_per_node, else the ranks sharing "
           "memory; default false)")
    f(g, "powersgd_start_step", type=non_negative_int, default=0,
      help="powersgd: steps that send every gradient whole before the low-rank ones start (default 0)")


def _device_and_output_flags(p):
    """The CPU and GPU backends, the performance model, tracing, and what a run writes."""
    f = p.flag

    g = p.add_argument_group("CPU")
    f(g, "conv_autotune", type=parse_bool, default=None,
      help="time each convolution shape's eligible algorithms on this machine and use the fastest, cached "
           "per user (~/.cache/pydtnn/conv_autotune.json) so that only the first run times; false: the "
           "built-in thresholds, for reproducible timing (default true, or $PYDTNN_CONV_AUTOTUNE)")

    g = p.add_argument_group("performance model")
    f(g, "simulate", type=parse_bool, default=False,
      help="print the performance model's prediction of this run (per layer, compute, communication) and exit "
           "without training or MPI (docs/perfmodel.md)")
    f(g, "machine", default=None, help="machine description from pydtnn-perfmodel calibrate, which --simulate "
                                       "predicts with and a pipeline's cut balances by (default: built-in 2-core VM "
                                       "values)")
    f(g, "np", type=positive_int, default=1, help="--simulate: processes of the simulated run (default 1)")

    g = p.add_argument_group("GPU")
    f(g, "enable_gpu", type=parse_bool, default=False,
      help="compute on an NVIDIA GPU, one per process (CuPy + cuDNN frontend; pip install -e '.[gpu-cuda13]')")
    f(g, "enable_nccl", type=parse_bool, default=False,
      help="reduce gradients with NCCL on a side stream (with --enable_gpu; otherwise MPI through pinned host memory)")
    f(g, "sync_every", type=positive_int, default=None,
      help="steps between reads of the loss and metrics, each a wait for the device, and the check that the loss "
           "is finite (default 1 on CPU, 32 with --enable_gpu; 1 stops a diverging run before its update)")

    g = p.add_argument_group("tracing")
    f(g, "tracing", type=parse_bool, default=False, help="write a Chrome-trace timeline (see --tracer_output)")
    f(g, "tracer_output", default="pydtnn-trace.json", help="trace file (default pydtnn-trace.json)")
    f(g, "profile", type=parse_bool, default=False, help="run under cProfile and print the top functions")

    g = p.add_argument_group("output")
    f(g, "seed", type=non_negative_int, default=0, help="seed of initialization, dropout, augmentation and data order (default 0)")
    f(g, "metrics_file", default=None, help="JSON Lines file of per-epoch and final metrics")
    f(g, "history_file", default=None, help="CSV file of per-epoch metrics")
    f(g, "checkpoint_dir", default=None, help="save a resumable checkpoint here after every epoch (see model_checkpoint)")
    f(g, "resume", default=None,
      help="continue the run saved in this checkpoint directory, writing on into it (unless --checkpoint_dir); "
           "any layout flag given (--parallel, --pipeline_stages...) replaces the saved layout whole")
    f(g, "overwrite", type=parse_bool, default=False,
      help="let a new run replace the checkpoint already in --checkpoint_dir (refused otherwise)")
    f(g, "config", default=None, help="YAML or JSON file of flag values; command-line flags override it")
    f(g, "progress", type=parse_bool, default=True, help="show progress bars (default true)")


def _add_dataset_flags(p, g):
    """Augmentation flags (PyDTNN's names)."""
    p.flag(g, "flip_images", type=parse_bool, default=False, help="random horizontal flips while training")
    p.flag(g, "flip_images_prob", type=fraction, default=0.5, help="probability of a flip (default 0.5)")
    p.flag(g, "crop_images", type=parse_bool, default=False, help="random crops with zero padding while training")
    p.flag(g, "crop_images_padding", type=non_negative_int, default=4, help="padding before the random crop (default 4)")
    p.flag(g, "use_synthetic_data", type=parse_bool, default=False, help="random images in the model's input shape")
    p.flag(g, "data_workers", type=positive_int, default=1,
           help="threads that read, decode and augment each batch, a share of its images each (default 1); "
                "the batches are the same for any number")


# -- configuration ------------------------------------------------------------------------------
