"""Reading the files an operator hands pdctl: one place that turns every way a file can be
wrong (missing, a folder, not UTF-8, not YAML/JSON, empty, not a mapping, fields pydantic
refuses) into a message that names the file and the fix. Callers never see an OSError,
a UnicodeDecodeError or a raw pydantic dump."""

from __future__ import annotations

import difflib
import json
import sys
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    """The base of every file pdstack reads: an unknown key is an error (a typo must not be
    ignored silently), values are frozen, and NaN or infinity is never a number (YAML's .inf)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class InputError(ValueError):
    """An option or input file a command cannot use; nothing was changed (exit 2)."""


def _a(what: str) -> str:
    return f"an {what}" if what[:1] in "aeiou" else f"a {what}"


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of `path`; `what` says what the file is for, e.g. "spec"."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what} file. Fix: check the path") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a folder, not {_a(what)} file. Fix: name the file inside it") from None
    except PermissionError:
        raise InputError(f"{path}: cannot read the {what} file (permission denied). Fix: check its mode") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what} file ({exc.strerror or exc}). Fix: check the path") from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise InputError(f"{path}: the {what} file is UTF-16. Fix: save it as UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: the {what} file is not UTF-8 text (byte {exc.start}). Fix: save it as UTF-8, "
                         "or name the right file") from None


class DuplicateKey(Exception):
    """A key that appears twice in one mapping: YAML requires mapping keys to be unique (YAML 1.2,
    3.2.1.1 Nodes), and JSON objects' names SHOULD be (RFC 8259, 4), but PyYAML and Python's json
    keep the last one silently, so a typo'd second `instances:` would win unseen."""

    def __init__(self, key, line: int | None = None, first_line: int | None = None):
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line

    def says(self, path, what: str) -> str:
        where = f" at line {self.line}" if self.line else ""
        first = f" (first at line {self.first_line})" if self.first_line else ""
        return (f"{path}: the key {self.key!r} appears twice in one mapping{where}{first}; the {what} file would "
                "silently mean the last one. Fix: keep one")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key that appears twice in one mapping. A merge (`<<:`)
    may still be overridden by the mapping's own keys: that is what it is for."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base constructor says so
                    continue
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, path, what: str):
    """YAML text as the file `path` (for messages) holds it: safe, duplicate keys refused; every
    way it can fail is an InputError naming the file, where, and the fix."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except DuplicateKey as exc:
        raise InputError(exc.says(path, what)) from None
    except ValueError as exc:  # an integer longer than Python converts (4300 digits)
        raise InputError(f"{path}: holds a number too long to read ({str(exc).split(';')[0]}). Fix: correct it") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to read. Fix: correct the file") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{path}: not valid YAML{at} ({problem}). Fix: correct the syntax") from None


def load_yaml_mapping(path: str | Path, what: str) -> dict:
    """A YAML file that must hold a mapping (a spec, an inventory, a workload)."""
    return _mapping(parse_yaml(read_text(path, what), path, what), path, what)


def load_json(path: str | Path, what: str):
    text = read_text(path, what)
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except DuplicateKey as exc:
        try:  # JSON is YAML: PyYAML's marks say where the second one is
            yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except DuplicateKey as located:
            exc = located
        except Exception:  # noqa: BLE001 - JSON PyYAML cannot read: said without the line
            pass
        raise InputError(exc.says(path, what)) from None
    except ValueError as exc:
        raise InputError(f"{path}: the {what} file is not valid JSON ({exc}). Fix: correct the syntax") from None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    data: dict = {}
    for key, value in pairs:
        if key in data:
            raise DuplicateKey(key)
        data[key] = value
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _mapping(data, path, what: str) -> dict:
    if data is None:
        raise InputError(f"{path}: the {what} file is empty. Fix: {_a(what)} is a YAML mapping of fields")
    if not isinstance(data, dict):
        raise InputError(f"{path}: the {what} file holds a YAML {type(data).__name__}, not a mapping of fields. "
                         f"Fix: {_a(what)} is a mapping (key: value lines)")
    return data


def validation_problems(exc: ValidationError, model: type[BaseModel],
                        hint: typing.Callable[[dict], str | None] = lambda err: None) -> list[str]:
    """One line per field pydantic refused: `path: what is wrong. Fix: ...`, with a
    did-you-mean for an unknown key close to a real one. `hint(err)` may word an error better."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc)
        msg = err["msg"].removeprefix("Value error, ")
        hinted = hint(err)
        if hinted:
            msg = hinted
        elif err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc[-1], fields_at(model, err["loc"][:-1]), n=1, cutoff=0.75)
            msg = (f"unknown key. Fix: did you mean {close[0]}?" if close
                   else f"unknown key. Fix: remove it or correct its spelling (see {_doc_of(model)})")
        elif err["type"] == "missing":
            msg = "required field is missing. Fix: add it"
        elif err["type"] == "model_type":
            msg = f"{msg.split(' or instance')[0]} (got {type(err.get('input')).__name__}). Fix: a mapping of fields"
        elif "Fix:" not in msg:
            msg = f"{msg} (got {err.get('input')!r})" if "input" in err and not isinstance(err["input"], dict) else msg
        if path:
            lines.append(f"{path}: {msg}")
        else:
            lines.extend(msg.splitlines())  # cross-field rules carry their own paths
    return lines


def fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the sub-model at `loc` (list indices and dict keys stepped over)."""
    current: object = model
    for part in loc:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = _model_in(field.annotation)
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def _model_in(annotation):
    """The BaseModel inside Optional[...], list[...], dict[str, ...] or Annotated[...]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _doc_of(model: type[BaseModel]) -> str:
    """Where the model is written: its module's file (a package's is its __init__.py)."""
    path = model.__module__.replace(".", "/")
    package = hasattr(sys.modules.get(model.__module__), "__path__")
    return f"{path}/__init__.py {model.__name__}" if package else f"{path}.py {model.__name__}"


M = typing.TypeVar("M", bound=BaseModel)


def load_model(path: str | Path, model: type[M], what: str) -> M:
    """A YAML file validated as `model`; every problem on its own line, under the file's name."""
    data = load_yaml_mapping(path, what)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = validation_problems(exc, model)
        raise InputError(f"{path}: the {what} file has {len(lines)} problem(s):\n"
                         + "\n".join(f"  - {line}" for line in lines)) from None


def http_url(url: str, what: str, example: str) -> str:
    """An http(s) URL pdctl will connect to, checked before any command reads or changes anything:
    a scheme, a host, a port in range; no credentials (urllib sends none, and a command line is
    visible to every user of the machine), no query or fragment (paths are appended to it), no
    spaces or control characters. `what` names the option, `example` is the fix."""
    import urllib.parse

    fix = f"Fix: e.g. {example}"
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 - raises for a port out of range
    except ValueError as exc:
        raise InputError(f"{what} {url!r} is not a URL ({exc}). {fix}") from None
    if parsed.scheme not in ("http", "https"):
        raise InputError(f"{what} {url!r} has no http:// or https:// scheme. {fix}")
    if not parsed.hostname:
        raise InputError(f"{what} {url!r} names no host. {fix}")
    if parsed.username is not None or parsed.password is not None:
        raise InputError(f"{what} of {parsed.hostname} carries credentials (user:password@), which pdctl does "
                         "not send and a process list shows. Fix: remove them")
    if parsed.query or parsed.fragment or "?" in url or "#" in url:
        raise InputError(f"{what} {url!r} has a query or fragment; pdctl appends its API's path to it. {fix} "
                         "(a path prefix is fine)")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise InputError(f"{what} {url!r} holds spaces or control characters. {fix}")
    return url


def write_output(path: str | Path, text: str) -> None:
    """Write one output file whole: into a temporary file beside it, then renamed over it, so a
    reader (or a run killed half way) sees the old file or the new one, never part of one. A
    target that is not a regular file (a device, a pipe) is written in place. A failure (full
    disk, read-only, no such folder) names the file."""
    import os

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if path.exists() and not path.is_file():
            path.write_text(text)
            return
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
