"""How a setting is declared, parsed from a flag or the environment, and documented.

The machinery under :mod:`resilienced.settings` (and every other settings group, such as
:class:`resilienced.capacity.policy.CapacityPolicy`): :func:`option` declares a field with its
flag, environment variables, parser and help; :class:`Group` turns a frozen dataclass of such
fields into argparse flags, environment lookups and ``validate()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import ClassVar, TypeVar
from urllib.parse import urlsplit

from resilienced.errors import ConfigError

ENV_PREFIX = "RESILIENCED_"

ACCOUNT_RE = re.compile(r"[0-9]{12}")
REGION_RE = re.compile(r"[a-z]{2}(?:-[a-z]+)+-[0-9]{1,2}")
_AWS_QUEUE_HOST_RE = re.compile(r"sqs\.([a-z]{2}(?:-[a-z]+)+-[0-9]{1,2})\.amazonaws\.com(?:\.cn)?")


# --------------------------------------------------------------------------- declaring options
@dataclass(frozen=True)
class Option:
    """How one setting is given and documented (kept in the dataclass field's metadata)."""

    help: str
    parse: Callable[[str], object]
    flag: str | None = None  # default: --field-name
    env: tuple[str, ...] = ()  # default: (RESILIENCED_FIELD_NAME,)
    fallback_env: tuple[str, ...] = ()  # standard variables read after ours (AWS_REGION ...)
    metavar: str | None = None
    is_switch: bool = False  # a flag without a value (store_true)
    bounds: Range | None = None  # the range a value must be in (Group.check_bounds)
    unit: str = ""  # of a number in the range's error message ("s")


#: The least and the most a setting may be: numbers, or durations (timedelta).
Range = tuple[float, float] | tuple[timedelta, timedelta]


def option(default: T, *, help: str, parse: Callable[[str], T], flag: str | None = None,
           fallback_env: Sequence[str] = (), metavar: str | None = None,
           is_switch: bool = False, bounds: Range | None = None, unit: str = "") -> T:
    """Declare a setting: its default, documentation, and how to parse it from a string (as
    ``dataclasses.field``, it gives the field's value type to the annotation it stands in).

    ``bounds``: the range its value must be in, written once here: :meth:`Group.check_bounds`
    checks it (ConfigError naming the flag) and ``{range}`` in ``help`` shows it (``0-20``, ``1m-7d``).
    """
    if bounds is not None:
        help = help.replace("{range}", f"{show_bound(bounds[0])}-{show_bound(bounds[1])}")
    if "{range}" in help:
        raise TypeError("{range} in the help of a setting without bounds")
    meta = Option(help=help, parse=parse, flag=flag, fallback_env=tuple(fallback_env),
                  metavar=metavar, is_switch=is_switch, bounds=bounds, unit=unit)
    if isinstance(default, (list, dict, set)):
        raise TypeError("use an immutable default (a tuple)")
    return field(default=default, metadata={"option": meta})


def flag_of(f: dataclasses.Field) -> str:
    meta: Option = f.metadata["option"]
    return meta.flag or "--" + f.name.replace("_", "-")


def env_of(f: dataclasses.Field) -> tuple[str, ...]:
    meta: Option = f.metadata["option"]
    return (meta.env or (ENV_PREFIX + f.name.upper(),)) + meta.fallback_env


# --------------------------------------------------------------------------- parsers (str -> value)
def text(value: str) -> str | None:
    value = value.strip()
    return value or None


def integer(value: str) -> int:
    try:
        return int(value.strip(), 10)
    except ValueError:
        raise ValueError(f"expected a whole number, got {value!r}") from None


def seconds(value: str) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite number of seconds, got {value!r}")
    return number


def boolean(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def csv(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        value = value.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
        return value
    return parse


def choice_of(kind: type[E]) -> Callable[[str], E]:
    """The member of the string enum ``kind`` whose value is given (as :func:`choice`: any case,
    ``expected one of ...`` otherwise): the setting holds the enum, parsed once here."""
    by_value = choice(*(member.value for member in kind))

    def parse(value: str) -> E:
        return kind(by_value(value))
    return parse


# --------------------------------------------------------------------------- the group machinery
G = TypeVar("G", bound="Group")
T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


class Group:
    """Mixin for a settings group: argparse flags, env lookup, and ``validate()``."""

    TITLE: ClassVar[str] = "settings"

    def __post_init__(self) -> None:
        """An enum setting given its text in code (``ModeSettings(mode="ray")``: the drill, tests)
        holds the member, parsed as its flag's text is (any case; a ConfigError naming the flag)."""
        for f in self.options():
            value = getattr(self, f.name)
            if not isinstance(f.default, enum.Enum) or isinstance(value, type(f.default)):
                continue
            try:
                member = f.metadata["option"].parse(value) if isinstance(value, str) else type(f.default)(value)
            except ValueError as e:
                raise ConfigError(flag_of(f), str(e)) from None
            object.__setattr__(self, f.name, member)

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if "option" in f.metadata]  # type: ignore[arg-type]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, only: Sequence[str] | None = None) -> None:
        """Add this group's flags (all, or the named fields) to ``parser``.

        Every flag defaults to ``None`` so that :meth:`from_args` can tell "not given" from a
        value and fall back to the environment.
        """
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None
        group = parser.add_argument_group(cls.TITLE, doc)
        for f in cls.options():
            if only is not None and f.name not in only:
                continue
            meta: Option = f.metadata["option"]
            envs = " / ".join(env_of(f))
            default = _show_default(f.default)
            help_text = f"{meta.help.split('. ')[0].rstrip('.')}. [env {envs}; default {default}]"
            if meta.is_switch:
                group.add_argument(flag_of(f), dest=f.name, action="store_const", const="true",
                                   default=None, help=help_text)
            else:
                group.add_argument(flag_of(f), dest=f.name, default=None, metavar=meta.metavar,
                                   help=help_text)

    @classmethod
    def from_args(cls: type[G], args: argparse.Namespace | None, environ: Mapping[str, str]) -> G:
        """Build the group from parsed flags (strings) and the environment; parse errors raise ConfigError."""
        values: dict[str, object] = {}
        for f in cls.options():
            meta: Option = f.metadata["option"]
            raw = getattr(args, f.name, None) if args is not None else None
            origin = flag_of(f)
            if raw is None:
                for name in env_of(f):
                    if environ.get(name) not in (None, ""):
                        raw, origin = environ[name], f"env {name}"
                        break
            if raw is None:
                continue
            try:
                values[f.name] = meta.parse(raw)
            except ValueError as e:
                raise ConfigError(flag_of(f), f"{e} (from {origin})") from None
        return cls(**values)

    def check_bounds(self) -> None:
        """Every setting declared with ``bounds`` is in its range, else ConfigError
        naming its flag; a setting whose value is not one number or duration checks its own."""
        for f in self.options():
            meta: Option = f.metadata["option"]
            if meta.bounds is not None:
                value = getattr(self, f.name)
                if not isinstance(value, tuple):
                    require_within(flag_of(f), value, meta.bounds, meta.unit)

    @classmethod
    def bounds_of(cls, name: str) -> Range:
        """The ``bounds`` the setting ``name`` is declared with."""
        meta: Option = next(f for f in cls.options() if f.name == name).metadata["option"]
        assert meta.bounds is not None, name
        return meta.bounds

    def validate(self) -> None:  # pragma: no cover - every group overrides
        """Raise ConfigError for a value that cannot work."""


def _show_default(value: object) -> str:
    if value is None or value == ():
        return "unset"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def show_bound(value: float | timedelta) -> str:
    """A bound as the help writes it: ``0.05``, ``43200``; a duration in its largest whole unit, ``30m``, ``7d``."""
    if not isinstance(value, timedelta):
        return _show_default(float(value))
    total = value.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if total and total % size == 0:
            return f"{int(total // size)}{unit}"
    return _show_default(total)


def require_within(flag: str, value: object, bounds: Range, unit: str = "") -> None:
    """``value`` within ``bounds`` (numbers, or durations), else ConfigError naming ``flag``."""
    low, high = bounds
    if isinstance(low, timedelta) and isinstance(high, timedelta):
        if not isinstance(value, timedelta):
            raise ConfigError(flag, f"expected a duration, got {value!r}")
        if not low <= value <= high:
            raise ConfigError(flag, f"must be between {low} and {high}, got {value}")
        return
    assert not isinstance(low, timedelta) and not isinstance(high, timedelta), bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(flag, f"expected a number, got {value!r}")
    if not (low <= value <= high):
        suffix = f" {unit}" if unit else ""
        raise ConfigError(flag, f"must be between {_show_default(float(low))} and "
                                f"{_show_default(float(high))}{suffix}, got {_show_default(value)}")


def _require_url(flag: str, value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(flag, f"expected an http(s) URL, got {value!r}")
