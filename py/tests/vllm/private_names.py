"""The vLLM names ``kvlease.vllm`` relies on, checked against vLLM's sources.

``private_names.toml`` (next to this file) is the inventory: every private
hook, method, attribute, constant, module path and class of vLLM that the
plugin overrides, calls or reads, with the signature it relies on, pinned for
each supported vLLM version. This module reads vLLM's sources without
importing them (``ast``), either from a release's sdist (a ``.tar.gz``,
nothing extracted) or from an installed ``vllm`` package, and says for one
entry what differs from its pin (``check_entry``). ``test_private_names.py``
runs it for every entry and version, and once more against the installed
vLLM by importing it.

When vLLM moves or changes a name, the test fails naming the entry. To look
at what a new release has in its place::

    python py/tests/vllm/private_names.py ~/.cache/kvlease/sdists/vllm-0.35.0.tar.gz

prints each entry's value in that release next to its pin (``!=`` marks a
difference; ``MISSING`` a name that is gone).

What an entry checks (``kind``):

* ``class``: the class exists in ``module`` (defined there or imported into
  it); ``signature`` is its decorators and bases, e.g.
  ``(NixlBaseConnectorWorker)``.
* ``method``: defined on the class ``qualname`` names (``Class.method``), with
  ``signature`` (decorators, parameters with annotations and defaults, return
  annotation). With ``via``, the plugin reaches it through that class: the
  method must be the one that class's MRO resolves to (no class in between
  overrides it). With ``calls``, the body must make those calls
  (``self.nixl_wrapper.send_notif(notif_msg=)``: that callee, with at least
  those keyword arguments). With ``body``, the body (docstring aside) must
  hash to that value: for the methods whose logic or wire format the plugin
  repeats, where any change needs a new review.
* ``attribute``: an instance attribute assigned in a method of the class
  (``self.x: T = ...``), or a class-level field (dataclass, config, enum);
  ``signature`` is its annotation, or ``= value`` when it has none. With
  ``via``, the owner must be in that class's MRO.
* ``function``: a module-level function (also one the module imports), with
  its signature.
* ``constant``: a module-level (or class-level) assignment; ``signature`` is
  ``= value`` (or ``T = value``). ``{version}`` in it is the version of the
  tree checked (for ``vllm.__version__``).

Names are resolved the way Python would: a name a module imports
(``from x import y``) is followed to where it is defined.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11 (vLLM itself needs 3.11+)
    tomllib = None  # type: ignore[assignment]

INVENTORY = Path(__file__).with_name("private_names.toml")
KINDS = ("class", "method", "attribute", "function", "constant")


# ---- the inventory -------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    module: str
    qualname: str
    kind: str
    signature: str
    #: version -> signature, where a version differs from ``signature``.
    signature_by_version: dict[str, str] = field(default_factory=dict)
    via: str | None = None
    calls: tuple[str, ...] = ()
    body: str | None = None
    body_by_version: dict[str, str] = field(default_factory=dict)
    used_by: str = ""

    @property
    def id(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.qualname}"

    def pinned_signature(self, version: str) -> str:
        return self.signature_by_version.get(version, self.signature)

    def pinned_body(self, version: str) -> str | None:
        return self.body_by_version.get(version, self.body)


@dataclass(frozen=True)
class Inventory:
    versions: tuple[str, ...]
    entries: tuple[Entry, ...]

    def by_key(self) -> dict[tuple[str, str], Entry]:
        return {(e.module, e.qualname): e for e in self.entries}


def load_inventory(path: Path = INVENTORY) -> Inventory:
    """Reads and validates the inventory; raises ``ValueError`` naming the
    entry when one is malformed."""
    if tomllib is None:
        raise RuntimeError("reading private_names.toml needs Python 3.11+ (tomllib)")
    data = tomllib.loads(path.read_text())
    versions = tuple(data.get("versions", ()))
    if not versions:
        raise ValueError(f"{path.name}: no 'versions'")
    entries = []
    seen: set[tuple[str, str]] = set()
    for i, raw in enumerate(data.get("name", ())):
        where = f"{path.name}: [[name]] #{i + 1} ({raw.get('module')}:{raw.get('qualname')})"
        for key in ("module", "qualname", "kind", "signature", "used_by"):
            if not isinstance(raw.get(key), str) or not raw.get(key):
                raise ValueError(f"{where}: '{key}' missing")
        if raw["kind"] not in KINDS:
            raise ValueError(f"{where}: kind {raw['kind']!r} is not one of {KINDS}")
        for key in ("signature_by_version", "body_by_version"):
            odd = set(raw.get(key, {})) - set(versions)
            if odd:
                raise ValueError(f"{where}: {key} names unsupported versions {sorted(odd)}")
        unknown = set(raw) - {
            "module", "qualname", "kind", "signature", "signature_by_version", "via",
            "calls", "body", "body_by_version", "used_by",
        }
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        key = (raw["module"], raw["qualname"])
        if key in seen:
            raise ValueError(f"{where}: listed twice")
        seen.add(key)
        entries.append(
            Entry(
                module=raw["module"],
                qualname=raw["qualname"],
                kind=raw["kind"],
                signature=raw["signature"],
                signature_by_version=dict(raw.get("signature_by_version", {})),
                via=raw.get("via"),
                calls=tuple(raw.get("calls", ())),
                body=raw.get("body"),
                body_by_version=dict(raw.get("body_by_version", {})),
                used_by=raw["used_by"],
            )
        )
    return Inventory(versions=versions, entries=tuple(entries))


# ---- vLLM's sources ------------------------------------------------------------


class Sources:
    """The ``.py`` files of one vLLM tree, by module name."""

    def __init__(self, files: dict[str, str], label: str) -> None:
        self.files = files  # "vllm/a/b.py" -> text
        self.label = label
        self._trees: dict[str, ast.Module | None] = {}

    @classmethod
    def from_sdist(cls, path: str | os.PathLike[str]) -> Sources:
        """Every ``vllm/**.py`` of an sdist, read from the archive."""
        files: dict[str, str] = {}
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                if not member.isfile() or not member.name.endswith(".py"):
                    continue
                parts = member.name.split("/", 1)
                if len(parts) != 2 or not parts[1].startswith("vllm/"):
                    continue
                f = tar.extractfile(member)
                if f is not None:
                    files[parts[1]] = f.read().decode("utf-8", "replace")
        return cls(files, os.fspath(path))

    @classmethod
    def from_installed(cls, package_dir: str | os.PathLike[str]) -> Sources:
        """The sources of an installed ``vllm`` package (its directory)."""
        root = Path(package_dir)
        files = {
            "vllm/" + p.relative_to(root).as_posix(): p.read_text("utf-8", "replace")
            for p in root.rglob("*.py")
        }
        return cls(files, os.fspath(root))

    def version(self) -> str | None:
        """``__version__`` from ``vllm/_version.py`` (written at build time)."""
        tree = self.tree("vllm._version")
        if tree is None:
            return None
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
                getattr(node, "value", None), ast.Constant
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in _flatten_targets(targets):
                    if isinstance(t, ast.Name) and t.id == "__version__":
                        return str(node.value.value)
        return None

    def path_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (base + ".py", base + "/__init__.py"):
            if candidate in self.files:
                return candidate
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.path_of(module)
            try:
                self._trees[module] = ast.parse(self.files[path]) if path else None
            except SyntaxError:
                self._trees[module] = None
        return self._trees[module]


def _flatten_targets(targets: Iterable[ast.expr]) -> Iterable[ast.expr]:
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            yield from _flatten_targets(t.elts)
        else:
            yield t


# ---- resolution -------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A definition: where it is and its node."""

    module: str
    node: ast.AST

    @property
    def is_module(self) -> bool:
        """A submodule (``from package import module``)."""
        return isinstance(self.node, ast.Module)

    @property
    def is_class(self) -> bool:
        return isinstance(self.node, ast.ClassDef)


def _module_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Top-level statements, looking into ``try`` and ``if`` blocks, but not
    into ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" in test:
                continue
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            # The fallbacks first, so that what the ``try`` body binds (the
            # normal case) is what a name resolves to.
            for h in node.handlers:
                yield from _module_level(h.body)
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        else:
            yield node


def _absolute(module: str, level: int, target: str | None, is_package: bool) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(parts + ([target] if target else []))


class Resolver:
    def __init__(self, sources: Sources) -> None:
        self.src = sources

    def lookup(self, module: str, name: str, _depth: int = 0) -> Found | None:
        """The module-level definition ``name`` resolves to in ``module``
        (following ``from ... import``), or a submodule of that name."""
        if _depth > 20:
            return None
        tree = self.src.tree(module)
        if tree is None:
            return None
        found: Found | None = None
        is_package = (self.src.path_of(module) or "").endswith("__init__.py")
        for node in _module_level(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name == name:
                    found = Found(module, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in _flatten_targets(targets)):
                    found = Found(module, node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    source = _absolute(module, node.level, node.module, is_package)
                    target = self.lookup(source, alias.name, _depth + 1)
                    if target is not None:
                        found = target
        if found is None and self.src.tree(f"{module}.{name}") is not None:
            found = Found(f"{module}.{name}", ast.Module(body=[], type_ignores=[]))
        return found

    def find_class(self, module: str, name: str) -> Found | None:
        found = self.lookup(module, name)
        if found is not None and isinstance(found.node, ast.ClassDef):
            return found
        return None

    def bases(self, cls: Found) -> list[Found]:
        """The classes ``cls`` derives from that are in vLLM's sources."""
        out = []
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            dotted = ast.unparse(base)
            if "[" in dotted:  # Generic[T]
                dotted = dotted.split("[", 1)[0]
            head, _, rest = dotted.partition(".")
            found = self.lookup(cls.module, head)
            if found is not None and rest and isinstance(found.node, ast.Module):
                found = self.find_class(found.module, rest)
            if found is not None and isinstance(found.node, ast.ClassDef):
                out.append(found)
        return out

    def mro(self, cls: Found) -> list[Found]:
        """C3 linearisation over the bases found in vLLM's sources."""

        def key(f: Found) -> tuple[str, str]:
            return (f.module, f.node.name)  # type: ignore[attr-defined]

        def merge(seqs: list[list[Found]]) -> list[Found]:
            out: list[Found] = []
            seqs = [s[:] for s in seqs if s]
            while seqs:
                for seq in seqs:
                    head = seq[0]
                    if not any(key(head) in map(key, s[1:]) for s in seqs):
                        break
                else:
                    raise ValueError("inconsistent MRO")
                out.append(head)
                seqs = [[c for c in s if key(c) != key(head)] for s in seqs]
                seqs = [s for s in seqs if s]
            return out

        bases = self.bases(cls)
        return [cls] + merge([self.mro(b) for b in bases] + [bases])


# ---- what a definition looks like ------------------------------------------------------


def _norm_annotation(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return ast.unparse(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return node.value
    return ast.unparse(_unquote(node))


def _unquote(node: ast.expr) -> ast.expr:
    """Forward references written as strings (``"KVConnectorOutput"``) read
    as the expression they name, so quoting is no difference."""

    class T(ast.NodeTransformer):
        def visit_Constant(self, n: ast.Constant) -> Any:
            if isinstance(n.value, str):
                try:
                    return ast.parse(n.value, mode="eval").body
                except SyntaxError:
                    return n
            return n

    return T().visit(ast.parse(ast.unparse(node), mode="eval").body)


def function_signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = node.args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None and a.annotation is not None:
            a.annotation = _unquote(a.annotation)
    text = f"({ast.unparse(args)})"
    if node.returns is not None:
        text += f" -> {_norm_annotation(node.returns)}"
    decorators = " ".join("@" + ast.unparse(d) for d in node.decorator_list)
    return f"{decorators} {text}" if decorators else text


def class_signature(node: ast.ClassDef) -> str:
    parts = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
    decorators = " ".join("@" + ast.unparse(d) for d in node.decorator_list)
    text = f"({', '.join(parts)})"
    return f"{decorators} {text}" if decorators else text


def assignment_signature(node: ast.Assign | ast.AnnAssign) -> str:
    if isinstance(node, ast.AnnAssign):
        text = _norm_annotation(node.annotation) or ""
        if node.value is not None and node.target is not None and not isinstance(
            node.target, ast.Attribute
        ):
            text += f" = {ast.unparse(node.value)}"
        return text
    return f"= {ast.unparse(node.value)}"


def _canon(node: Any) -> str:
    """A serialisation of an AST that does not depend on the Python version
    that parsed it (``ast.dump`` output changed in 3.13)."""
    if isinstance(node, ast.AST):
        fields = [
            f"{name}={_canon(getattr(node, name, None))}"
            for name in node._fields
            if name not in ("type_params", "type_comment", "kind", "ctx")
        ]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canon(n) for n in node) + "]"
    return repr(node)


def body_hash(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]
    return "sha256:" + hashlib.sha256(_canon(body).encode()).hexdigest()[:16]


def _calls_in(node: ast.AST) -> set[tuple[str, frozenset[str]]]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            out.add((ast.unparse(n.func), frozenset(k.arg for k in n.keywords if k.arg)))
    return out


def _parse_call(spec: str) -> tuple[str, frozenset[str]]:
    """``self.a.b(x=, y=)`` -> ("self.a.b", {"x", "y"})."""
    callee, _, rest = spec.partition("(")
    kws = [k.strip().rstrip("=") for k in rest.rstrip(")").split(",") if k.strip()]
    return callee.strip(), frozenset(kws)


# ---- checking one entry --------------------------------------------------------------


def _find_method(cls: Found, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    found = None
    assert isinstance(cls.node, ast.ClassDef)
    for node in cls.node.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            found = node
    return found


def _find_attribute(cls: Found, name: str) -> ast.Assign | ast.AnnAssign | None:
    """A class-level field, else ``self.name`` assigned in a method
    (annotated first, ``__init__`` first)."""
    assert isinstance(cls.node, ast.ClassDef)
    for node in cls.node.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in _flatten_targets(targets)):
                return node
    candidates: list[tuple[int, ast.Assign | ast.AnnAssign]] = []
    for method in cls.node.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(method):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in _flatten_targets(targets):
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr == name
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    rank = (0 if isinstance(node, ast.AnnAssign) else 2) + (
                        0 if method.name == "__init__" else 1
                    )
                    candidates.append((rank, node))
    if not candidates:
        return None
    return min(candidates, key=lambda c: (c[0], c[1].lineno))[1]


def owner_in_mro(mro: list[Found], name: str) -> Found | None:
    """Where ``name`` belongs along an MRO: a method, the first class that
    defines it (what an instance calls); an attribute, the last class that
    assigns it (the one that declares it: subclasses only set it)."""
    first_method = next((c for c in mro if _find_method(c, name) is not None), None)
    if first_method is not None:
        return first_method
    return next((c for c in reversed(mro) if _find_attribute(c, name) is not None), None)


@dataclass
class Observed:
    """What one entry is in one tree."""

    signature: str | None = None
    body: str | None = None
    problems: list[str] = field(default_factory=list)


def observe(entry: Entry, resolver: Resolver) -> Observed:
    """The entry as the tree has it: its signature and body hash, and any
    structural problem (missing, moved, overridden in between, a call gone)."""
    obs = Observed()
    if resolver.src.tree(entry.module) is None:
        obs.problems.append(f"module {entry.module} is missing")
        return obs
    owner_name, _, member = entry.qualname.rpartition(".")
    if entry.kind in ("class", "function") or (entry.kind == "constant" and not owner_name):
        found = resolver.lookup(entry.module, entry.qualname)
        if found is None:
            obs.problems.append(f"{entry.qualname} is not defined in (or imported into) {entry.module}")
            return obs
        node = found.node
        if entry.kind == "class" and isinstance(node, ast.ClassDef):
            obs.signature = class_signature(node)
        elif entry.kind == "function" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            obs.signature = function_signature(node)
            obs.body = body_hash(node)
        elif entry.kind == "constant" and isinstance(node, (ast.Assign, ast.AnnAssign)):
            obs.signature = assignment_signature(node)
        else:
            obs.problems.append(
                f"{entry.qualname} in {found.module} is a {type(node).__name__}, not a {entry.kind}"
            )
        return obs
    if not owner_name:
        obs.problems.append(f"a {entry.kind} needs Class.name as its qualname")
        return obs
    cls = resolver.find_class(entry.module, owner_name)
    if cls is None:
        obs.problems.append(f"class {owner_name} is not in {entry.module}")
        return obs
    if cls.module != entry.module:
        obs.problems.append(f"class {owner_name} is defined in {cls.module}, not {entry.module}")
    if entry.kind == "method":
        node = _find_method(cls, member)
        if node is None:
            obs.problems.append(f"{owner_name} defines no method {member}")
            return obs
        obs.signature = function_signature(node)
        obs.body = body_hash(node)
        for spec in entry.calls:
            callee, kws = _parse_call(spec)
            if not any(c == callee and kws <= k for c, k in _calls_in(node)):
                obs.problems.append(f"its body no longer calls {spec}")
    else:  # attribute, or a class-level constant (enum member)
        node = _find_attribute(cls, member)
        if node is None:
            obs.problems.append(f"{owner_name} assigns no attribute {member}")
            return obs
        obs.signature = assignment_signature(node)
    if entry.via:
        via_cls = resolver.find_class(entry.module, entry.via) or _find_class_anywhere(
            resolver, entry.via
        )
        if via_cls is None:
            obs.problems.append(f"class {entry.via} (via) not found")
            return obs
        mro = resolver.mro(via_cls)
        keys = [(c.module, c.node.name) for c in mro]  # type: ignore[attr-defined]
        if (cls.module, owner_name) not in keys:
            obs.problems.append(f"{owner_name} is no longer a base of {entry.via}")
        elif entry.kind == "method":
            first = next((c for c in mro if _find_method(c, member) is not None), None)
            if first is not None and (first.module, first.node.name) != (cls.module, owner_name):  # type: ignore[attr-defined]
                obs.problems.append(
                    f"{entry.via} now gets {member} from {first.module}.{first.node.name}"  # type: ignore[attr-defined]
                )
    return obs


def _find_class_anywhere(resolver: Resolver, dotted: str) -> Found | None:
    module, _, name = dotted.rpartition(".")
    return resolver.find_class(module, name) if module else None


def expected_signature(entry: Entry, version: str, tree_version: str | None) -> str:
    """The pinned signature for ``version``; ``{version}`` in it stands for
    the version of the tree checked (``vllm.__version__``'s value)."""
    return entry.pinned_signature(version).replace("{version}", tree_version or version)


def check_entry(entry: Entry, resolver: Resolver, version: str) -> list[str]:
    """The differences of ``entry`` from its pins for ``version`` in this
    tree; empty when it is as pinned."""
    obs = observe(entry, resolver)
    problems = list(obs.problems)
    want = expected_signature(entry, version, resolver.src.version())
    if obs.signature is not None and obs.signature != want:
        problems.append(f"signature is now {obs.signature!r}, pinned {want!r}")
    body = entry.pinned_body(version)
    if body is not None and obs.body is not None and obs.body != body:
        problems.append(f"body changed: {obs.body}, pinned {body} (review it, then pin)")
    return problems


# ---- the installed vLLM, by import -----------------------------------------------------


def _split_decorators(sig: str) -> tuple[list[str], str]:
    """``"@classmethod (cls, x) -> T"`` -> (["classmethod"], "(cls, x) -> T")."""
    for i, ch in enumerate(sig):
        if ch != "(":
            continue
        head, tail = sig[:i].strip(), sig[i:]
        decorators = [d.strip() for d in head.split(" @") if d.strip()] if head else []
        decorators = [d[1:] if d.startswith("@") else d for d in decorators]
        src = "".join(f"@{d}\n" for d in decorators) + f"def _f{tail}: pass"
        try:
            ast.parse(src)
        except SyntaxError:
            continue
        return decorators, tail
    return [], sig


def _pinned_parameters(sig: str) -> list[tuple[str, str, bool, Any]]:
    """(name, kind, has default, default) of a pinned signature."""
    import inspect

    decorators, tail = _split_decorators(sig)
    fn = ast.parse(f"def _f{tail}: pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    out: list[tuple[str, str, bool, Any]] = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        kind = (
            inspect.Parameter.POSITIONAL_ONLY
            if i < len(a.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        out.append((arg.arg, kind.name, d is not None, _literal(d)))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", False, None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", d is not None, _literal(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", False, None))
    return out


_NO_LITERAL = object()


def _literal(node: ast.expr | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return _NO_LITERAL


def _compare_parameters(func: Any, sig: str, drop_first: bool) -> list[str]:
    import inspect

    if isinstance(func, property):
        func = func.fget  # a property's parameters are its getter's: (self)
    try:
        actual = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as e:
        return [f"its signature cannot be read ({e})"]
    pinned = _pinned_parameters(sig)
    if drop_first and pinned and pinned[0][0] in ("self", "cls"):
        pinned = pinned[1:]
    got = [(p.name, p.kind.name, p.default is not p.empty) for p in actual]
    want = [(n, k, d) for n, k, d, _ in pinned]
    if got != want:
        return [f"its parameters are now {got}, pinned {want}"]
    for p, (_, _, has_default, default) in zip(actual, pinned):
        if has_default and default is not _NO_LITERAL and p.default != default:
            return [f"the default of {p.name} is now {p.default!r}, pinned {default!r}"]
    return []


def check_imported(entry: Entry, version: str, tree_version: str | None) -> list[str]:
    """What differs when the entry is looked up by importing the installed
    vLLM: the module, the object, where a member is defined, and the
    parameters of callables (names, kinds, literal defaults; annotations are
    compared statically). Instance attributes assigned in ``__init__`` have
    no object to look at before an instance exists: the static check of the
    installed sources covers them."""
    import dataclasses
    import enum
    import importlib
    import inspect

    want = expected_signature(entry, version, tree_version)
    try:
        module = importlib.import_module(entry.module)
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return [f"import {entry.module} failed: {type(e).__name__}: {e}"]
    owner_name, _, member = entry.qualname.rpartition(".")
    if entry.kind in ("class", "function") or (entry.kind == "constant" and not owner_name):
        obj: Any = module
        for part in entry.qualname.split("."):
            if not hasattr(obj, part):
                return [f"{entry.module} has no {entry.qualname}"]
            obj = getattr(obj, part)
        if entry.kind == "class":
            if not inspect.isclass(obj):
                return [f"{entry.qualname} is a {type(obj).__name__}, not a class"]
            _, tail = _split_decorators(want)
            bases = ast.parse(f"class _C{tail}: pass").body[0]
            assert isinstance(bases, ast.ClassDef)
            want_bases = [ast.unparse(b).split("[")[0].rsplit(".", 1)[-1] for b in bases.bases]
            got_bases = [b.__name__ for b in obj.__bases__ if b is not object]
            problems = []
            if want_bases != got_bases:
                problems.append(f"its bases are now {got_bases}, pinned {want_bases}")
            if "@dataclass" in want and not dataclasses.is_dataclass(obj):
                problems.append("it is no longer a dataclass")
            return problems
        if entry.kind == "function":
            if not callable(obj):
                return [f"{entry.qualname} is not callable"]
            return _compare_parameters(obj, want, drop_first=False)
        value = _literal(ast.parse(want.lstrip("= ").strip() or "None", mode="eval").body) if want.startswith("= ") else _NO_LITERAL
        if value is not _NO_LITERAL and obj != value:
            return [f"{entry.qualname} is now {obj!r}, pinned {value!r}"]
        return []
    cls: Any = module
    for part in owner_name.split("."):
        cls = getattr(cls, part, None)
    if not inspect.isclass(cls):
        return [f"{entry.module} has no class {owner_name}"]
    problems: list[str] = []
    if entry.via:
        via_module, _, via_name = entry.via.rpartition(".")
        try:
            via = getattr(importlib.import_module(via_module), via_name)
        except Exception as e:  # noqa: BLE001
            return [f"{entry.via} (via) cannot be imported: {e}"]
        if cls not in via.__mro__:
            problems.append(f"{owner_name} is no longer a base of {via_name}")
        elif entry.kind == "method":
            first = next((c for c in via.__mro__ if member in vars(c)), None)
            if first is not cls:
                problems.append(f"{via_name} now gets {member} from {getattr(first, '__qualname__', first)}")
    if entry.kind == "method":
        if member not in vars(cls):
            return problems + [f"{owner_name} defines no {member}"]
        raw = inspect.getattr_static(cls, member)
        func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        if "@classmethod" in want and not isinstance(raw, classmethod):
            problems.append(f"{member} is no longer a classmethod")
        if "@staticmethod" in want and not isinstance(raw, staticmethod):
            problems.append(f"{member} is no longer a staticmethod")
        if "@property" in want and not isinstance(raw, property):
            problems.append(f"{member} is no longer a property")
        problems += _compare_parameters(func, want, drop_first=False)
        return problems
    # attribute, or a class-level constant (an enum member)
    class_level = (
        member in getattr(cls, "__dataclass_fields__", {})
        or member in getattr(cls, "model_fields", {})
        or any(member in getattr(c, "__annotations__", {}) for c in cls.__mro__)
        or member in vars(cls)
    )
    if entry.kind == "constant":
        if not class_level:
            return problems + [f"{owner_name} has no {member}"]
        obj = getattr(cls, member)
        value = _literal(ast.parse(want[2:], mode="eval").body) if want.startswith("= ") else _NO_LITERAL
        got = obj.value if isinstance(obj, enum.Enum) else obj
        if value is not _NO_LITERAL and got != value:
            problems.append(f"{entry.qualname} is now {got!r}, pinned {value!r}")
    return problems


# ---- the plugin's own use of vLLM (for the completeness test) --------------------------


@dataclass
class PluginUse:
    """What the plugin package takes from vLLM, read from its source."""

    #: (module, name) of every ``from vllm.x import name``; (module, "") of ``import vllm``.
    imports: set[tuple[str, str]] = field(default_factory=set)
    #: (module, name, attr) of every ``name.attr`` read (and ``getattr(name, "attr")``)
    #: where ``name`` was imported from vLLM (``name`` "" for ``import vllm``).
    reads: set[tuple[str, str, str]] = field(default_factory=set)
    #: plugin class -> (module, name) of its vLLM base
    bases: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: plugin class -> names it uses on ``self``, ``cls`` and ``super()``, and the
    #: methods it defines (``kvl_`` names aside: those are the plugin's)
    members: dict[str, set[str]] = field(default_factory=dict)
    #: plugin class -> names the class itself defines or assigns on ``self``
    own: dict[str, set[str]] = field(default_factory=dict)


def plugin_use(package_dir: Path) -> PluginUse:
    use = PluginUse()
    for path in sorted(package_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                if (node.module or "").split(".")[0] != "vllm":
                    continue
                for alias in node.names:
                    use.imports.add((node.module, alias.name))
                    imported[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        use.imports.add((alias.name, ""))
                        imported[alias.asname or alias.name] = (alias.name, "")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in imported:
                    use.reads.add((*imported[node.value.id], node.attr))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in imported
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                use.reads.add((*imported[node.args[0].id], node.args[1].value))
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            vllm_bases = [
                imported[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in imported
            ]
            if not vllm_bases:
                continue
            use.bases[cls.name] = vllm_bases[0]
            own_methods = {
                n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
            own_attrs = {
                t.id
                for n in cls.body
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in _flatten_targets(n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Name)
            }
            used = set(own_methods)
            for n in ast.walk(cls):
                if not isinstance(n, ast.Attribute):
                    continue
                v = n.value
                if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                    used.add(n.attr)
                elif isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                    used.add(n.attr)
                if (
                    isinstance(n.ctx, ast.Store)
                    and isinstance(v, ast.Name)
                    and v.id == "self"
                ):
                    own_attrs.add(n.attr)
            use.members[cls.name] = {u for u in used if not u.startswith(("_kvl_", "kvl_"))}
            use.own[cls.name] = own_methods | own_attrs
    return use


# ---- command line ----------------------------------------------------------------------


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[0])
        print("usage: private_names.py <vllm sdist .tar.gz | installed vllm package dir>")
        return 2
    target = Path(argv[0])
    try:
        if target.is_file():
            src = Sources.from_sdist(target)
        elif (target / "__init__.py").is_file():
            src = Sources.from_installed(target)
        else:
            print(f"{target}: neither an sdist (.tar.gz) nor a vllm package directory")
            return 2
    except (OSError, tarfile.TarError) as e:
        print(f"{target}: cannot be read: {e}")
        return 2
    version = src.version() or "?"
    inv = load_inventory()
    pin_version = version if version in inv.versions else inv.versions[-1]
    resolver = Resolver(src)
    print(f"vLLM {version} ({src.label}); pins of {pin_version}")
    bad = 0
    for e in inv.entries:
        obs = observe(e, resolver)
        problems = check_entry(e, resolver, pin_version)
        bad += bool(problems)
        mark = "!=" if problems else "=="
        print(f"{mark} {e.id} [{e.kind}] {obs.signature or 'MISSING'}")
        if obs.body is not None and e.pinned_body(pin_version) is not None:
            print(f"   body {obs.body}")
        for p in problems:
            print(f"   {p}")
    print(f"{len(inv.entries)} entries, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
