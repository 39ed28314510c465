"""Every check a run makes before it computes or writes anything: flags that contradict each other, outputs
against inputs and each other, the metrics that schedules watch, and the ranks' agreement on flags, data,
model and epoch."""

import os

from pydtnn import checkpoint, data
from pydtnn.errors import ConfigError
from pydtnn.files import same_file
from pydtnn.optim import schedules as sch
from pydtnn.plan import check_memory_limit, chosen_schedulers
from pydtnn.resume import check_checkpoint_dir

# flags that describe how to run rather than what to compute: not saved as the run's configuration
NOT_SAVED = ("config", "resume", "list_models", "profile", "explicit", "notes", "overwrite", "download")
# flags naming files and folders: saved as absolute paths, so a resumed run finds them from any directory
PATH_FLAGS = ("dataset_train_path", "dataset_test_path", "weights_and_bias_filename", "checkpoint_dir",
              "metrics_file", "history_file", "tracer_output", "model_file")
# what may differ between the ranks of one job: paths (each node has its own disks) and what rank 0 alone does
PER_RANK = PATH_FLAGS + ("summary", "tracing", "threads_per_process", "progress")


def check_combinations(args):
    """Flags that contradict each other: found before anything is loaded, on every rank alike."""
    if args.model_file and "model" in args.explicit:
        raise ConfigError(f"--model {args.model} and --model_file {args.model_file} both name the model; give one")
    if args.enable_nccl and not args.enable_gpu:
        raise ConfigError("--enable_nccl reduces GPU gradients; expected it together with --enable_gpu")
    if args.evaluate_only and "checkpoint_dir" in args.explicit:  # from a file or a checkpoint it is moot
        raise ConfigError(f"--evaluate_only trains nothing and writes no checkpoint, but --checkpoint_dir "
                          f"{args.checkpoint_dir} was given; drop it (to evaluate a checkpoint: --resume DIR "
                          f"--evaluate_only, or --weights_and_bias_filename DIR)")
    if "model_checkpoint" in chosen_schedulers(args) and not args.checkpoint_dir:
        raise ConfigError("model_checkpoint needs --checkpoint_dir DIR")
    check_memory_limit(args)
    check_text_flags(args)
    pipelined = args.parallel == "pipeline" or args.pipeline_stages is not None
    if not pipelined and (args.stage_boundaries is not None or "pipeline_schedule" in args.explicit):
        flag = "--stage_boundaries" if args.stage_boundaries is not None else "--pipeline_schedule"
        raise ConfigError(f"{flag} applies to --parallel pipeline (or hybrid with --pipeline_stages); got --parallel "
                          f"{args.parallel or 'data'}")


def check_text_flags(args):
    """--context_length and --tokenizer apply to text datasets only; a text dataset reports bits per token (and
    perplexity) beside accuracy unless --metrics says otherwise."""
    from pydtnn.data import TEXT

    synthetic = args.use_synthetic_data or args.dataset == "synthetic"
    text = args.dataset in TEXT and not synthetic
    for flag in ("context_length", "tokenizer"):
        if flag in args.explicit and not text and not (flag == "context_length" and synthetic):
            raise ConfigError(f"--{flag} applies to a text dataset ({', '.join(TEXT)}); got --dataset {args.dataset}"
                              f"{' with --use_synthetic_data' if args.use_synthetic_data else ''}: leave --{flag} out")
    if not text:
        return
    for flag, given in (("flip_images", args.flip_images), ("crop_images", args.crop_images),
                        ("validation_split", args.validation_split)):
        if given:
            instead = ("; --test_as_validation validates on the held-out end of the text" if flag == "validation_split"
                       else "")
            raise ConfigError(f"--{flag} {given} does not apply to text (--dataset {args.dataset}): its windows "
                              f"overlap the training ones, or it is for images; leave it out{instead}")
    if "metrics" not in args.explicit:
        args.metrics = "accuracy,bits_per_token"


def profile_path(rank=0, size=1):
    """--profile's output, in the working directory: pydtnn.prof, or pydtnn.rankR.prof per process of a job."""
    return os.path.abspath("pydtnn.prof" if size == 1 else f"pydtnn.rank{rank}.prof")


def check_outputs(args, comm):
    """Every file and folder the run will write can be written, no output is a file the run reads or
    another output, and no other run's checkpoint is in the way: checked before training starts, on
    each rank for what that rank writes."""
    from pydtnn.files import check_distinct, check_writable

    made = None if args.evaluate_only else args.checkpoint_dir
    if args.tracing:  # every rank writes its own trace
        check_writable(trace_path(args.tracer_output, comm), "trace file", made)
    if comm.rank:
        return
    outputs = [(what, getattr(args, key)) for key, what in (("metrics_file", "metrics file"),
                                                            ("history_file", "history file"))]
    if args.profile:
        outputs += [("profile", profile_path(r, comm.size)) for r in range(comm.size)]
    for what, path in outputs:
        if path:
            check_writable(path, what, made)
    if args.tracing:
        from pydtnn.profiling import trace_paths

        outputs += [("trace file", p) for p in trace_paths(args.tracer_output, comm.size)]
    # written through write_atomic: their temporary names are written (and first removed) too
    outputs += [(f"{what}'s temporary name", p + checkpoint.TMP) for what, p in outputs if p and what != "metrics file"]
    own = []  # the checkpoint's own files: replaced by each save, read back by --resume of the same directory
    if args.checkpoint_dir and not args.evaluate_only:
        check_checkpoint_dir(args.checkpoint_dir, args.resume, args.overwrite)
        own = [("checkpoint file", os.path.join(args.checkpoint_dir, n + tmp)) for n in checkpoint.ALL_FILES
               for tmp in ("", checkpoint.TMP)]
    inputs, folders = run_inputs(args)
    resumed = [(w, p) for w, p in inputs if w == "checkpoint file being resumed"]
    check_distinct(own, [(w, p) for w, p in inputs if (w, p) not in resumed and not
                         (w == "config file" and any(same_file(p, q) for _, q in own))], folders)
    check_distinct(outputs, inputs + own, folders)


def run_inputs(args):
    """([(what, path)] files the run reads, [(what, folder)] folders it reads files from)."""
    files = [("config file", args.config), ("model file", args.model_file)]
    read, trees = data.source_files(args.dataset, args.dataset_train_path, args.dataset_test_path)
    files += [("data file", f) for f in read]
    folders = [("image folder", f) for f in trees]
    for what, path in (("dataset train path", args.dataset_train_path), ("dataset test path", args.dataset_test_path)):
        if path and not os.path.isdir(path):  # a file where a folder belongs: load says so, but it is read
            files.append((what, path))
    weights = args.weights_and_bias_filename
    if weights and os.path.isdir(weights):  # a checkpoint directory: its files
        files += [("weights checkpoint file", os.path.join(weights, n + tmp)) for n in checkpoint.ALL_FILES
                  for tmp in ("", checkpoint.TMP)]
    elif weights:
        files.append(("weights file", weights))
    if args.resume:
        files += [("checkpoint file being resumed", os.path.join(args.resume, n + tmp)) for n in checkpoint.ALL_FILES
                  for tmp in ("", checkpoint.TMP)]
    return [(w, p) for w, p in files if p], folders


def trace_path(path, comm):
    """The trace file of this rank: `path` itself with one process, else path's stem + .rankR.json."""
    from pydtnn.profiling import trace_paths

    return trace_paths(path, comm.size)[comm.rank]


def check_monitored(args, val):
    """The metrics that schedules and callbacks watch are ones the run reports (before an epoch is spent)."""
    from pydtnn.metrics import canonical

    names = {canonical(m) for m in metric_names(args)} | {"accuracy"}
    keys = {"loss", "lr", "time_s", "samples_per_second", *names}
    if val is not None:
        keys |= {f"val_{k}" for k in ("loss", *names)}
    record = dict.fromkeys(keys, 0.0)
    chosen = chosen_schedulers(args)
    for who, metric in (("reduce_lr_on_plateau", args.reduce_lr_on_plateau_metric),
                        ("early_stopping", args.early_stopping_metric), ("stop_at_loss", args.stop_at_loss_metric)):
        if who in chosen:
            sch.monitored(record, metric, who)


def agree_on_flags(comm, args):
    """Every rank was started with the same flags (all but paths and what rank 0 alone does); else one
    line names the first flag that differs and the ranks. The first collective of a run: a rank that
    split the communicator for another layout would otherwise wait forever for the others."""
    if comm.size == 1:
        return
    from pydtnn.distributed.consistency import check_agreement as agree

    agree(comm, {k: v for k, v in sorted(vars(args).items()) if k not in NOT_SAVED + PER_RANK})


def check_agreement(comm, model, datasets, start_epoch):
    """Every rank runs the same computation: the data (sizes, shapes, a hash of a few samples), the
    model and the epoch to start from agree (the flags did, at the start); else one line names the
    first difference and the ranks, before a collective can hang on it."""
    if comm.size == 1:
        return
    from pydtnn.distributed.consistency import check_agreement as agree, sample_digest

    facts = {}
    for name, ds in zip(("train", "validation", "test"), datasets):
        facts[f"{name} set"] = None if ds is None else sample_digest(ds)
    facts["model"] = (f"{model.whole_name}, {model.count_params():,} parameters, state "
                      f"{checkpoint.fingerprint(model)}")
    facts["epoch to start from"] = start_epoch
    agree(comm, facts)


def metric_names(args):
    """The names in --metrics, in order."""
    return tuple(m.strip() for m in args.metrics.split(",") if m.strip())
