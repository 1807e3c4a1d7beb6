"""The command line generated from a config dataclass: flat kebab-case flags, a YAML ``--config`` file under
them, ``--print-config``, and the one place where an input error becomes ``prog: error: --flag ...``.

Precedence: the dataclass's defaults, then ``--config FILE.yaml``, then the flags on the command line.
``--print-config`` prints the resolved config as YAML that ``--config`` reads back to the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, get_args, get_origin

from typing_extensions import override

from ddp_recipes.config.choices import literal_choices
from ddp_recipes.config.trainer_settings import split_setting
from ddp_recipes.errors import ConfigError, flag, lit
from ddp_recipes.storage import Url
from ddp_recipes.storage.store import make_writable

C = TypeVar("C")


def opt(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - mirrors argparse's word
    """A dataclass field with a one-line help text for its CLI flag."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as ``int | None`` or ``Literal[...] | None``;
    ``dict``/``list`` for a mapping or list field (``--trainer KEY=VALUE``, ``--callbacks SPEC``)."""
    if get_origin(annotation) in (dict, list):
        return get_origin(annotation), False
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return type(get_args(annotation)[0]), False
    if args and get_origin(args[0]) is Literal:
        return type(get_args(args[0])[0]), len(args) < len(get_args(annotation))
    if args:
        return args[0], len(args) < len(get_args(annotation))
    return annotation, False


def _cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description's own lines kept (a recipe's docstring: one example command a line), and a flag's
    ``(default: ...)`` added only where it says something: not for None (the help says what unset means) and
    not where the help already names its default in words."""

    @override
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "(default" in text or action.option_strings == []:
            return text
        return f"{text} (default: %(default)s)"


class FlagParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, ``prog: error: ...`` naming the flag, and exit 2; an unknown flag
    says the one it most likely means (``--learning-rate``: ``--lr``). Every command line of the pack (recipes,
    bench, doctor's, a subparser of one) parses with it."""

    names: dict[str, str] = {}
    bad_choice: str | None = None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # A value outside a flag's choices is one line naming the flag and its values, as a config file's is
        # (check_choice's words), not argparse's usage text with the choices lost at its end.
        if action.choices is not None and value not in action.choices:
            name = action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
            self.bad_choice = f"{name} must be one of {', '.join(map(str, action.choices))} (got {value!r})"
        super()._check_value(action, value)

    def error(self, message: str) -> NoReturn:
        if self.bad_choice is not None:
            fail(self.bad_choice, self.prog)
        if message.startswith("unrecognized arguments: "):
            unknown = [a for a in message.removeprefix("unrecognized arguments: ").split() if a.startswith("--")]
            meant = [closest_name(a.split("=", 1)[0].lstrip("-"), self.names) for a in unknown]
            hints = [f"{a.split('=', 1)[0]}: did you mean {flag(m.replace('-', '_'))}?"
                     for a, m in zip(unknown, meant, strict=True) if m]
            if hints:
                message += " (" + "; ".join(hints) + ")"
        fail(message, self.prog)


def build_parser(cls: type, prog: str | None = None, description: str | None = None,
                 config_flags: bool = False) -> argparse.ArgumentParser:
    """An argparse parser with one flat kebab-case flag per field of the config dataclass (plus the field's
    ``aliases``, e.g. torchvision's ``--opt`` for ``--optimizer``; a field with ``positional=True`` is an
    operand instead, such as ``SRC``); ``config_flags`` adds ``--config`` and
    ``--print-config`` (what :func:`parse_config` reads)."""
    parser = FlagParser(prog=prog, description=description, formatter_class=HelpFormatter)
    parser.names = _key_names(cls)
    hints = typing.get_type_hints(cls)
    for f in _cli_fields(cls):
        kind, _ = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        names = [flag(f.name), *f.metadata.get("aliases", ())]
        help_text = f.metadata.get("help", "")
        if f.metadata.get("positional"):  # a required operand (a converter's SRC DEST), not a --flag
            parser.add_argument(f.name, type=kind, help=help_text, metavar=f.metadata.get("metavar", f.name.upper()))
            continue
        if kind in (dict, list):
            # Repeatable; parse_config puts the values on top of the config file's (a dict by key, a list after it).
            parser.add_argument(*names, dest=f.name, action="append", default=None, help=help_text,
                                metavar=f.metadata.get("metavar", "VALUE"))
            continue
        if kind is bool:
            # --sync-batchnorm turns it on, --no-sync-batchnorm off: no value needed.
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text, "type": kind}
        choices = f.metadata.get("choices") or literal_choices(hints[f.name])
        if choices:
            kwargs["choices"] = choices
            kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        parser.add_argument(*names, **kwargs)
    if not config_flags:
        return parser
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="read flags from this YAML file (keys are flag names; flags given here override it)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML (what --config reads back) and exit without running")
    return parser


def writable_dir(path: str, param: str) -> Path | Url:
    """Create ``path`` if needed (rank-safe) and prove it is writable, or raise naming ``param`` (a config
    field such as ``output_dir``; ``{output_dir}`` and ``--output-dir`` spellings are accepted too). A URL
    (``s3://bucket/prefix``) is checked on its store (:func:`~ddp_recipes.storage.store.check_bucket`: the
    bucket exists, an object can be written) and returned as a :class:`~ddp_recipes.storage.Url`."""
    return make_writable(path, param.strip("{}").lstrip("-").replace("-", "_"))


def fail(message: str | ConfigError, prog: str) -> typing.NoReturn:
    """Print a one-line error naming the flag and exit 2, argparse's convention for bad usage. An error every
    rank raised alike from rank 0's decision (``agreed``) is printed by rank 0 only."""
    if isinstance(message, ConfigError):
        if getattr(message, "agreed", False) and _rank() != 0:
            raise SystemExit(2)
        message = message.cli()
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _rank() -> int:
    """This process's global rank as Lightning knows it (0 before Lightning is imported)."""
    module = sys.modules.get("lightning_utilities.core.rank_zero")
    rank = getattr(getattr(module, "rank_zero_only", None), "rank", 0)
    return rank if isinstance(rank, int) else 0


# ---- YAML config files -----------------------------------------------------------------------------------


def _key_names(cls: type) -> dict[str, str]:
    """Every spelling a config file may use for a field: its name, its flag without dashes, its aliases."""
    names: dict[str, str] = {}
    for f in _cli_fields(cls):
        for spelling in (f.name, *f.metadata.get("aliases", ())):
            bare = spelling.lstrip("-")
            names[bare] = names[bare.replace("-", "_")] = f.name
    return names


def _coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """A YAML value as the field's type (YAML 1.1 reads ``1e-3`` as a string: numbers in strings are accepted)."""
    kind, optional = _base_type(annotation)
    if kind in (dict, list):
        if value is None:
            return kind()
        if not isinstance(value, kind):
            wanted = "a mapping (key: value lines under it)" if kind is dict else "a list (- item lines under it)"
            raise ConfigError(f"{{config}} {lit(source)}: {lit(key)} must be {wanted} (got {lit(repr(value))})",
                              "config")
        return kind(value)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{{config}} {lit(source)}: {lit(key)} cannot be null; give a value", "config")
    if kind is str and isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no as booleans
        raise ConfigError(f"{{config}} {lit(source)}: {lit(key)} must be a string (got {value}: quote it, "
                          f"e.g. {lit(key)}: 'off')", "config")
    try:
        if kind is bool:
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise TypeError
            number = float(value)
            if math.isnan(number) and not (isinstance(value, str) and value.strip().lower() == "nan"):
                raise TypeError
            return number
        if isinstance(value, dict | list):
            raise TypeError

        return str(value)
    except (TypeError, ValueError):
        wanted = {bool: "true or false", int: "an integer", float: "a number"}.get(kind, "a string")
        raise ConfigError(f"{{config}} {lit(source)}: {lit(key)} must be {wanted} (got {lit(repr(value))})",
                          "config") from None


class _UniqueKeyLoader:
    """Built on first use (yaml is imported lazily): a SafeLoader that refuses a key given twice."""

    def __new__(cls, stream: str):  # type: ignore[misc]
        import yaml

        class Loader(yaml.SafeLoader):
            def construct_mapping(self, node, deep=False):  # type: ignore[override]
                keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
                repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
                if repeated:
                    raise yaml.constructor.ConstructorError(None, None, f"key {repeated[0]!r} given twice",
                                                            node.start_mark)
                return super().construct_mapping(node, deep=deep)

        return Loader(stream)


def load_config_file(cls: type, path: str) -> dict[str, Any]:
    """The field values a YAML file sets, checked against ``cls``: an unknown key, a wrong type or an
    unreadable file is a one-line error naming ``--config`` and the key."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{{config}} {lit(path)} is not a text file; pass a YAML file", "config") from None
    except OSError as err:
        raise ConfigError(f"{{config}} {lit(path)}: cannot read it ({err.strerror}); pass a readable YAML file",
                          "config") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        mark = mark or getattr(err, "context_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise ConfigError(f"{{config}} {lit(path)} is not valid YAML ({where}{problem})", "config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{{config}} {lit(path)} must hold a mapping of flag names to values (got a "
                          f"{type(data).__name__})", "config")
    names, hints = _key_names(cls), typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in data.items():
        field = names.get(str(key))
        if field is None:
            close = closest_name(str(key), names)
            hint = f"did you mean {close}?" if close else "see --help for the flags"
            raise ConfigError(f"{{config}} {lit(path)}: unknown key {lit(repr(key))}; {hint}", "config")
        if field in values:
            raise ConfigError(f"{{config}} {lit(path)}: {lit(repr(key))} sets {field} a second time; keep one",
                              "config")
        values[field] = _coerce(value, hints[field], str(key), path)
    return values


#: What other trainers call a setting (PyTorch scripts, Lightning's Trainer, HF TrainingArguments), by the field
#: of ours it means: spelling alone would not find them (``learning_rate`` is far from ``lr`` as text).
OTHER_NAMES = {
    "learning_rate": "lr", "learningrate": "lr", "base_lr": "lr", "epochs": "max_epochs",
    "num_epochs": "max_epochs", "num_train_epochs": "max_epochs", "steps": "max_steps", "max_iters": "max_steps",
    "batch": "batch_size", "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size",
    "gradient_accumulation_steps": "accumulate_grad_batches", "gpus": "devices", "nodes": "num_nodes",
    "workers": "num_workers", "dataloader_num_workers": "num_workers", "output": "output_dir",
    "output_path": "output_dir", "data_path": "data_dir", "data_root": "data_dir", "resume_from_checkpoint": "resume",
}


def closest_name(key: str, names: dict[str, str]) -> str | None:
    """The flag a mistyped or foreign config key most likely means: another trainer's name for one of ours
    (:data:`OTHER_NAMES`), else the closest spelling; None when nothing is close."""
    normal = key.strip().lower().replace("-", "_")
    meant = OTHER_NAMES.get(normal)
    if meant is not None:
        named = [name for name, field in names.items() if field == meant]
        if named:
            return min(named, key=len)
    close = difflib.get_close_matches(key, list(names), n=1)
    return close[0] if close else None


def dump_config(config: Any, prog: str | None = None) -> str:
    """The config as YAML that :func:`load_config_file` reads back to the same values, with what it resolves
    to (world, batch plan, LR) as comments."""
    import yaml

    header = [f"# {prog or 'a recipe'} --config <this file>: the resolved run config"]
    plan = getattr(config, "plan", None)
    if plan is not None and plan.batch is not None:
        batch = plan.batch
        header.append(f"# resolves to: world {plan.world_size} ({plan.accelerator}), batch {batch.per_device} "
                      f"per device x {plan.world_size} x {batch.accumulation} = {batch.global_batch}, lr {plan.lr:g}, "
                      f"precision {plan.precision}")
    asked = config.asked if hasattr(config, "asked") else dataclasses.asdict(config)
    fields = [f.name for f in _cli_fields(type(config))]
    resolved = {name: getattr(config, name) for name in fields if getattr(config, name) != asked[name]}
    if resolved:  # the recipe's defaults as this run fills them in; left out of the file so flags still move them
        header.append("# resolved by the recipe: " + ", ".join(f"{name}={value}" for name, value in resolved.items()))
    body = yaml.safe_dump({name: asked[name] for name in fields}, sort_keys=False, default_flow_style=False)
    return "\n".join(header) + "\n" + body


def _merge_repeatable(cls: type, namespace: dict[str, Any], from_file: dict[str, Any]) -> None:
    """A mapping or list field from the config file with the command line's values on top: ``--trainer
    KEY=VALUE`` replaces that key of the file's ``trainer:``; ``--callbacks`` adds after the file's."""
    hints = typing.get_type_hints(cls)
    for f in _cli_fields(cls):
        kind, _ = _base_type(hints[f.name])
        if kind not in (dict, list):
            continue
        given = namespace.get(f.name) or []
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else kind()  # type: ignore[misc]
        base = from_file.get(f.name, default)
        if kind is dict:
            namespace[f.name] = {**base, **dict(split_setting(text, f.name) for text in given)}
        else:
            namespace[f.name] = [*base, *given]


def parse_config(cls: type[C], argv: list[str] | None = None, prog: str | None = None,
                 description: str | None = None) -> C:
    """Parse ``argv`` into ``cls``; a bad value exits 2 with a one-line message naming the flag.

    ``--config FILE.yaml`` supplies values under the command line's; ``--print-config`` prints the resolved
    config and exits 0.
    """
    parser = build_parser(cls, prog=prog, description=description, config_flags=True)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", action="append", default=[])
    known, _ = first.parse_known_args(argv)
    try:
        if len(known.config) > 1:
            raise ConfigError("{config} was given more than once; merge the files into one", "config")
        known.config = known.config[0] if known.config else None
        from_file = load_config_file(cls, known.config) if known.config else {}
        parser.set_defaults(**{k: v for k, v in from_file.items() if not isinstance(v, dict | list)})
        namespace = vars(parser.parse_args(argv))
        namespace.pop("config")
        show = namespace.pop("print_config")
        _merge_repeatable(cls, namespace, from_file)
        config = cls(**namespace)
    except ConfigError as err:
        fail(err.cli(), parser.prog)
    if show:
        print(dump_config(config, parser.prog), end="", flush=True)
        raise SystemExit(0)
    return config
