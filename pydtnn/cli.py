"""`pydtnn-train`, `python -m pydtnn` and `python examples/train.py`: one program.

Flag names follow PyDTNN (underscores); each is also accepted with dashes. Values come from, in
increasing priority: the defaults below, `--config FILE` (YAML or JSON, keys are flag names), a
checkpoint's saved configuration (`--resume DIR`), and the command line. Exit codes: 0 success,
2 user error (one line `pydtnn: error: ...`, no traceback), 1 internal error.
"""

import argparse
import json
import re
import sys

from pydtnn.errors import ConfigError, PydtnnError
from pydtnn.flags import SCHEDULERS, build_parser, program_name, scheduler_list  # noqa: F401 (importable from here)

# Library errors name the Python parameter (data.load's train_path=DIR); the command line names the flag
# that sets it. Each pair: how a library message writes the parameter, what the user types instead.
FLAG_TERMS = ((r"\bdownload=True\b", "--download"), (r"\btrain_path=", "--dataset_train_path "),
              (r"\btest_as_validation=True\b", "--test_as_validation"), (r"\bvalidation_split=", "--validation_split "),
              (r"\bcrop_padding=", "--crop_images_padding "), (r"\bpydtnn\.models\.names\(\)", "--list_models"))


def in_flag_terms(message):
    """A library error's `message` with each Python parameter it names (FLAG_TERMS) given as its flag."""
    for pattern, flag in FLAG_TERMS:
        message = re.sub(pattern, flag, message)
    return message


CONFIG_LIMIT = 1 << 20  # bytes: a file of flag values is a few kilobytes


def load_config_file(path, parser):
    """{flag: value} from a YAML or JSON file, each value checked as if given on the command line.

    The file must be a regular file of at most CONFIG_LIMIT bytes, and every value a scalar.
    """
    import yaml

    from pydtnn.files import read_bytes

    try:
        raw = read_bytes(path, "config file", CONFIG_LIMIT)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; expected a YAML or JSON file of flag values") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); expected YAML or JSON") from None
    kind = "JSON" if path.endswith(".json") else "YAML"
    try:
        values = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {path} is not valid {kind}: {' '.join(str(e).split())[:300]}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply; expected a flat map of flag names to values") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must map flag names to values, got a {type(values).__name__}")
    if isinstance(values.get("effective"), dict):  # a run's config.json: values computed from the flags
        values = {k: v for k, v in values.items() if k != "effective"}
    values = check_values(values, parser, f"config file {path}")
    if values.get("model_file") is not None:  # a file of values (one a checkpoint holds too) never names code to run
        raise ConfigError(f"config file {path}: model_file {str(values['model_file'])[:200]!r} runs Python; give "
                          f"--model_file on the command line, not in a file of values")
    return values


def check_values(values, parser, origin):
    """Validate {flag: value} (from a file or a checkpoint) with the parser's own types and choices."""
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help",)}
    out = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"{origin}: flag names must be strings, got a {type(key).__name__}")
        name = key.lstrip("-").replace("-", "_")
        if name not in actions or name in ("config", "resume"):
            raise ConfigError(f"{origin}: unknown flag {key[:100]!r}")
        action = actions[name]
        # the type first: str() of a structure (a YAML alias bomb expands to billions of items) never ends
        if not (value is None or isinstance(value, (str, int, float, bool))):
            raise ConfigError(f"{origin}: {name}: expected a single value (text, number or boolean), "
                              f"got a {type(value).__name__}")
        if isinstance(value, str) and "\0" in value:  # no path or name holds one; os calls would raise
            raise ConfigError(f"{origin}: {name}: {value[:100]!r} contains a NUL character")
        if value is not None:
            try:
                value = action.type(str(value)) if action.type else str(value)
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"{origin}: {name}: {e}") from None
            if action.choices and value not in action.choices:
                raise ConfigError(f"{origin}: {name}: {value!r} is not one of {', '.join(map(str, action.choices))}")
        out[name] = value
    return out


def parse_args(argv=None):
    """Namespace of the effective configuration: defaults < --config < --resume's saved one < command line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    given = vars(build_parser(suppress_defaults=True).parse_args(argv))
    args = parser.parse_args(argv)
    layered, notes = {}, []
    if args.config:
        layered.update(load_config_file(args.config, parser))
    if args.resume:
        from pydtnn.resume import resumed_config

        layered.update(check_values(resumed_config(args.resume, given, notes), parser, f"checkpoint {args.resume}"))
    for k, v in layered.items():
        if k not in given:
            setattr(args, k, v)
    if args.optimizer is None:  # the model family's (ViT: AdamW), else SGD; a model file's: SGD
        from pydtnn.models.families import default_optimizer

        args.optimizer = default_optimizer(None if args.model_file else args.model)
    args.explicit = set(given)  # flags given on the command line (they win over a resumed run's)
    args.notes = notes  # lines for the run to print (rank 0) before it starts
    return args


def main(argv=None):
    """Entry point; returns the exit code (the console script exits with it).

    Under a multi-process launcher every way out but success ends the whole job (MPI_Abort): a user
    error (2), an interrupt (130) or an internal error (1) on any rank, whichever rank finds it.
    """
    from pydtnn.distributed import launch

    try:
        launch.start()  # MPI up before anything can fail, so that a failure can end every rank
        args = parse_args(argv)
        if args.simulate:
            from pydtnn.perfmodel.auto import for_simulate
            from pydtnn.perfmodel.simulate import simulate

            for_simulate(args)
            simulate(args, vars(build_parser().parse_args([])))
            return 0
        from pydtnn.run import run

        if args.profile:
            return _profiled(run, args)
        run(args)
    except PydtnnError as e:
        return _fail(in_flag_terms(" ".join(str(e).split())), 2)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    return 0


def _fail(message, code):
    """Print `pydtnn: error: [rank R: ]message` once per job; in a multi-process run end every rank with
    `code` (see distributed.launch.fail)."""
    from pydtnn.distributed.launch import abort_others, fail

    if code == 130 and abort_others() is not None:
        message += "; ending the job"
    return fail(message, code)


def _profiled(fn, args):
    import cProfile
    import marshal
    import pstats

    from pydtnn.distributed.launch import launched_rank, launched_size
    from pydtnn.files import write_atomic
    from pydtnn.preflight import profile_path

    prof = cProfile.Profile()
    prof.runcall(fn, args)  # a run that fails writes no profile: it checked its outputs, and wrote none
    out = profile_path(launched_rank(), launched_size())
    prof.create_stats()  # what Profile.dump_stats writes, written atomically instead
    write_atomic(out, marshal.dumps(prof.stats))
    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    print(f"pydtnn: profile written to {out} (open with python -m pstats or snakeviz)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
