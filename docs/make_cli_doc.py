"""Write docs/cli.md from the parser itself, so the reference never drifts from the code.

    python docs/make_cli_doc.py            # --out FILE to write elsewhere, --help for this
"""

import os

from pydtnn.cli import build_parser

# flag -> how PyDTNN named or treated it, where that differs
PYDTNN = {
    "num_epochs": "default 1 in PyDTNN; 10 here so the default command reaches its accuracy",
    "learning_rate": "one default (0.01) in PyDTNN; per optimizer and model family here",
    "beta1": "default 0.99 in PyDTNN",
    "epsilon": "default 1e-7 in PyDTNN",
    "rho": "default 0.9 in PyDTNN",
    "decay": "PyDTNN: coupled L2 for every optimizer; here AdamW decouples it",
    "lr_schedulers": "default early_stopping,reduce_lr_on_plateau,model_checkpoint in PyDTNN; none here; adds cosine",
    "warm_up_start_factor": "new; PyDTNN always started at lr/P",
    "reduce_lr_on_plateau_metric": "PyDTNN default val_cce (= our val_loss); an unknown metric is an error here, "
                                   "PyDTNN silently used the first one",
    "early_stopping_metric": "PyDTNN default val_cce; the best weights are restored from memory, not a file",
    "model_checkpoint_save_freq": "PyDTNN default 2 and weights only; here full resumable checkpoints",
    "weights_and_bias_filename": "PyDTNN: .npz keyed by layer id; here .safetensors with PyTorch names (npz refused)",
    "history_file": "PyDTNN: a text file; here CSV",
    "steps_per_epoch": "PyDTNN also tiled the data when larger than an epoch; here only a cap",
    "crop_images_padding": "PyDTNN: --crop_images_size (crop size); here zero padding before a same-size crop",
    "use_synthetic_data": "PyDTNN produced zeros; here random, learnable images",
    "tracer_output": "PyDTNN: Extrae or a CSV; here a Chrome-trace JSON",
    "dtype": "PyDTNN accepted any NumPy dtype name",
    "metrics_file": "new", "checkpoint_dir": "new", "resume": "new", "overwrite": "new", "config": "new", "seed": "new (PyDTNN fixed 0)",
    "list_models": "new", "summary": "new", "progress": "new", "cosine_min_factor": "new", "download": "new",
    "simulate": "new; PyDTNN's performance model had no command", "machine": "new", "np": "new",
}


GUARANTEES = [
    "## What a run guarantees",
    "",
    "**Checked before anything is written.** Flag values and their combinations, every file the run reads",
    "(configuration, checkpoint, weights, datasets: regular files only, so a FIFO or `/dev/zero` is refused at",
    "once instead of blocking; a configuration file of at most 1 MB whose values are single values), the",
    "datasets themselves (not empty, train and test of one shape, pixels as the format promises), the metrics",
    "that schedules and callbacks monitor, and every output path (`--metrics_file`, `--history_file`,",
    "`--tracer_output`, `--checkpoint_dir`) are checked before training starts. A failure is one line",
    "`pydtnn: error: ...` and exit code 2, and the run leaves no file behind.",
    "",
    "**No output overwrites an input.** Every output is compared, after resolving links (hard links too),",
    "with every file the run reads (`--config`, `--model_file`, `--weights_and_bias_filename`, the",
    "checkpoint being resumed, the dataset's files, an ImageNet image folder), with every other output and",
    "the temporary names they are written under, and with the checkpoint's own",
    "files (`model.safetensors`, `optimizer.safetensors`, `meta.json`, `config.json` and their `.tmp`",
    "names). An existing device, FIFO, socket or folder named as an output is refused, never replaced by a",
    "file; so is a folder standing where a checkpoint file or an output's temporary name (`NAME.tmp`) goes,",
    "and a file or folder name too long for its temporary name. An output's folder must exist; the run",
    "creates only the checkpoint directory and folders inside it. `pydtnn-export`, `pydtnn-plot` and",
    "`pydtnn-perfmodel` follow the same rule.",
    "",
    "**When and where checkpoints are written.** With `--checkpoint_dir DIR`, rank 0 writes a checkpoint at the",
    "end of every `--model_checkpoint_save_freq`-th epoch and of the last one, each file to a temporary name",
    "first, so a crash or `kill -9` at any moment leaves the previous checkpoint or the new one whole.",
    "`config.json` comes with the first checkpoint. `--resume DIR` continues the run in `DIR`, wherever the",
    "checkpoint was first written and wherever it has been moved since: new checkpoints go to `DIR`, and a",
    "metrics, history or trace file that was inside the checkpoint directory moves with it. A path from a",
    "checkpoint is never trusted as a place to write: an output the saved run wrote outside its checkpoint",
    "directory, or that a link in it leads out of it, is not written again (the run says so); give the flag",
    "to write it. A checkpoint never names code to run: `--model_file` is given again. `--checkpoint_dir OTHER`",
    "with `--resume` forks the run into `OTHER`, outputs that were",
    "inside the checkpoint directory included. `--resume DIR --evaluate_only` writes only the files named on",
    "its own command line, never the run's metrics or history.",
    "",
    "**Never overwritten.** A new run refuses a `--checkpoint_dir` that already holds a checkpoint unless",
    "`--overwrite` is given (or it is the `--resume` directory). A checkpoint is never read into a model of",
    "another architecture, name or dtype kind, nor with NaN or non-float tensors.",
    "",
    "**What ends a job, and how fast** (several processes; see docs/distributed.md). A user error, an",
    "internal error or Ctrl-C/SIGINT on any rank, before or after MPI is up, ends every rank within about a",
    "second: the rank that knows why prints one line and calls MPI_Abort (exit code 2, 1 or 130). A rank",
    "killed by a signal ends the job through the launcher. A rank that exits in mid-run without an error",
    "is named by the ranks still waiting for it, which abort at once. Ranks started with different flags",
    "stop at the first collective of the run, before the communicator is split for a layout or a reducer;",
    "ranks with different data, model or checkpoint epoch stop before training; each with one line naming",
    "the first difference and each rank's value. Anything else that stops progress is reported after",
    "`--stall_timeout` seconds.",
    "A user error is one line per job: from rank 0 when every rank finds it, else from the rank that did.",
    "",
    "## What a run prints",
    "",
    "Results go to **stdout**: `--evaluate`'s line before training, one line per epoch (`epoch 3: loss ...,",
    "accuracy ..., val_loss ...`) and the `final:` line (test metrics, wall time, samples per second, and",
    "the layout by name: `processes 4, replicas 2, model_parallel_size 2`). Everything else goes to",
    "**stderr**, from rank 0 only: the header, notes and warnings, progress, and errors. So",
    "`pydtnn-train ... > results.txt` keeps the numbers and shows the rest.",
    "",
    "The header: the model (and, for a family name, the variant it chose and each adaptation to the data:",
    "input channels, classes, padding), the data, the processes and gradient reduction, and the optimizer",
    "with the values in use: the learning rate after linear scaling, stated when it happens (`learning",
    "rate 0.1 = 0.05 x 2 processes`; `x 2 model replicas` with hybrid parallelism, where it scales by",
    "replicas), momentum, weight decay, epochs and schedules; what to expect where a model's first epoch",
    "looks unusual (VGG without BatchNorm); and warnings where the sizes defeat the settings (a global",
    "batch larger than the training set, a warm-up longer than the run). The first run with an empty Numba",
    "cache says that it compiles the CPU kernels; timing convolution algorithms (`--conv_autotune`) says",
    "how many shapes it times, how far it is every 10 seconds, and when it is done.",
    "",
    "Progress: a bar when stderr is a terminal; otherwise (a log file, `mpirun`'s pipes) a line every 10",
    "seconds: `epoch 1/7: step 120/250, 35.2 samples/s, loss 1.2345, 3 min 40 s left in the epoch`.",
    "`--progress false` turns off both and keeps the epoch lines.",
    "",
    "With `--checkpoint_dir`, `config.json` holds the flags as given (null: the default for this model",
    "and optimizer) and, under `effective`, every value the run used: the model variant and input shape,",
    "processes, reduction, batch sizes, epochs, every optimizer hyperparameter, the warm-up. It is a valid",
    "`--config` file (the `effective` part is skipped).",
    "",
]


def main(path=os.path.join(os.path.dirname(__file__), "cli.md")):
    p = build_parser()
    lines = [
        "# Command line",
        "",
        "`pydtnn-train`, `python -m pydtnn` and `python examples/train.py` are the same program. Every flag is",
        "spelled as in PyDTNN (underscores) and also accepted with dashes (`--batch-size`). Boolean flags take an",
        "optional value, as PyDTNN scripts pass them: `--evaluate`, `--evaluate true`, `--evaluate False`",
        "(true/false/1/0/yes/no, any case).",
        "",
        "Values come from, in increasing priority: the defaults, `--config FILE` (YAML or JSON whose keys are flag",
        "names), the configuration saved in a checkpoint (`--resume DIR`), and the command line. The effective",
        "configuration is printed at start and saved, with the first checkpoint, as `config.json` in",
        "`--checkpoint_dir`; paths in it are absolute.",
        "",
        "Exit codes: 0 success; 2 user error, printed as one line `pydtnn: error: ...`; 1 internal error.",
        "",
        "This file is generated by `python docs/make_cli_doc.py` from the parser.",
        "",
    ]
    for group in p._action_groups[2:]:
        lines += [f"## {group.title[0].upper()}{group.title[1:]}", "", "| flag | default | meaning | PyDTNN |",
                  "| --- | --- | --- | --- |"]
        for a in group._group_actions:
            default = "" if a.default in (None, "") else f"`{a.default}`"
            choices = f" ({', '.join(map(str, a.choices))})" if a.choices else ""
            help_ = (a.help or "").replace("|", "\\|") + choices
            # PyDTNN's spelling of the flag and of any alias (each also takes dashes)
            names = [o for o in a.option_strings[1:] if o.startswith("--") and "-" not in o[2:]]
            flag = " or ".join(f"`{o}`" for o in [a.option_strings[0], *names])
            lines.append(f"| {flag} | {default} | {help_} | {PYDTNN.get(a.dest, '')} |")
        lines.append("")
    lines += [
        "## Schedules",
        "",
        "`--lr_schedulers` composes learning-rate factors: the rate of each step is the base rate times the",
        "product of every chosen schedule's factor (`warm_up`: linear ramp per batch; `cosine`: cosine decay per",
        "batch over `--num_epochs`; `reduce_lr_every_nepochs`: step decay; `reduce_lr_on_plateau`: decay when the",
        "monitored metric stalls), floored at the largest `min_lr`. `early_stopping`, `stop_at_loss` and",
        "`model_checkpoint` are callbacks at epoch ends. Metrics to monitor are the keys of the metrics file:",
        "`loss`, `accuracy`, `val_loss`, `val_accuracy`, ...; higher is better for accuracies, lower otherwise.",
        "",
    ] + GUARANTEES
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(description="Write docs/cli.md from pydtnn's own argument parser.")
    cli.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "cli.md"),
                     help="file to write (default docs/cli.md)")
    print(main(cli.parse_args().out))
