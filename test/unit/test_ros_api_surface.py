"""Every rclpy, launch, launch_ros and launch_testing name the robot-side code uses exists in ROS 2 Humble
and in Jazzy.

The package runs on Humble (rclpy 3.3, Python 3.10) and Jazzy (rclpy 7.1, Python 3.12), but a machine has
one of them installed at most, so importing would check one distribution. Instead each distribution's
public API is kept as data (test/data/ros_api/<distro>.json, recorded from the libraries' sources by
test/data/ros_api/extract.py; see the README there) and the code is read with :mod:`ast`:

* imported modules and names (``import rclpy.executors``, ``from launch.actions import X``);
* attribute chains on them (``rclpy.create_node``, ``launch_testing.asserts.assertExitCodes``,
  ``ReliabilityPolicy.BEST_EFFORT``);
* the number of positional arguments and the keyword names of calls to them: functions, constructors
  (through the base classes a ``**kwargs`` is passed on to), and methods of objects whose class is known
  (made by a recorded or local class, ``self`` in a subclass, ``super()``, a return annotation). A method
  call on an object of unknown class is checked against every recorded class with a method of that name,
  and flagged only when none of them (nor a standard-library class with such a method) accepts it.

``synflux_ros/nodes/ros_compat.py`` is the one module that may use API of one distribution only (behind
import guards and signature checks): its names need only exist in at least one distribution, so that a
misspelt name still fails.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import collections
import concurrent.futures
import functools
import inspect
import json
import logging
import queue
import subprocess
import threading
import unittest
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "test" / "data" / "ros_api"
DISTROS = ("humble", "jazzy")
ROS_PACKAGES = ("rclpy", "launch", "launch_ros", "launch_testing", "launch_testing_ros")
COMPAT = "synflux_ros/nodes/ros_compat.py"
SCANNED = ("synflux_ros/nodes/*.py", "synflux_ros/tools/*.py", "launch/*.py", "test/launch/*.py")
"""The code that runs against rclpy and launch on a robot (nodes, tools) or in a launch test."""

KNOWN_EMPTY_BASES = ("builtins.object", "typing.", "abc.ABC", "collections.abc.")
"""Bases that add no methods of interest: a class whose other bases are recorded is fully known."""

STDLIB_CLASSES = (threading.Thread, threading.Event, threading.Condition, threading.Semaphore,
                  concurrent.futures.ThreadPoolExecutor, concurrent.futures.Future, queue.Queue,
                  subprocess.Popen, collections.deque, list, dict, set, str, bytes,
                  argparse.ArgumentParser, unittest.TestCase, logging.Logger)
"""Classes the scanned code also calls methods of: a method call on an object of unknown class that one of
these accepts is not flagged (``pool.shutdown(wait=True)`` is a ThreadPoolExecutor's)."""


# ------------------------------------------------------------------ the recorded API
@dataclass
class Sig:
    """A parameter list as extract.py writes it (``a, b=, /, *args, c=, **kw>super -> ret``)."""

    positional: list = field(default_factory=list)  # (name, positional_only)
    varargs: bool = False
    keyword_only: list = field(default_factory=list)
    varkw: bool = False
    forwards: bool = False  # **kw goes on to the base class's method of the same name
    ret: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Sig":
        text, _, ret = text.partition(" -> ")
        sig = cls(ret=ret or None)
        tokens = [t.strip() for t in text.split(",") if t.strip()]
        if "/" in tokens:
            cut = tokens.index("/")
            sig.positional = [(t.rstrip("="), True) for t in tokens[:cut]]
            tokens = tokens[cut + 1:]
        kw_only = False
        for t in tokens:
            if t.startswith("**"):
                sig.varkw, sig.forwards = True, t.endswith(">super")
            elif t.startswith("*"):
                sig.varargs = sig.varargs or t != "*"
                kw_only = True
            elif kw_only:
                sig.keyword_only.append(t.rstrip("="))
            else:
                sig.positional.append((t.rstrip("="), False))
        return sig

    def too_many_positional(self, n: int) -> bool:
        return not self.varargs and n > len(self.positional)

    def takes_keyword(self, name: str) -> bool:
        return name in self.keyword_only or any(p == name and not po for p, po in self.positional)


class Api:
    """One distribution's recorded API, with name resolution through re-exports and base classes."""

    def __init__(self, data: dict):
        self.distro = data["distro"]
        self.modules = data["modules"]
        versions = {}
        for src in data["source"].values():
            versions.update(src.get("versions", {}))
        self.label = f"{self.distro} (rclpy {versions.get('rclpy')}, launch {versions.get('launch')}, " \
                     f"launch_ros {versions.get('launch_ros')})"
        self._methods = None
        self._mro = {}

    # names -----------------------------------------------------------
    def _member(self, module: str, name: str, seen=()):
        """(module that defines it, entry) of ``module``'s ``name``, through ``*`` imports; None if none."""
        entries = self.modules.get(module, {})
        if name in entries:
            return module, entries[name]
        if f"{module}.{name}" in self.modules:
            return module, "=" + f"{module}.{name}"
        for star in entries.get("*", []):
            if star not in seen:
                found = self._member(star, name, seen + (module,))
                if found is not None:
                    return found
        return None

    def resolve(self, dotted: str, depth: int = 0):
        """(kind, value): ``module``, ``class`` (dotted path), ``function`` (Sig), ``opaque`` (exists,
        contents unknown: a variable, an attribute, a C-extension type) or ``missing``."""
        if depth > 20:
            return "opaque", None
        if dotted in self.modules:
            return "module", dotted
        parts = dotted.split(".")
        if parts[0] not in ROS_PACKAGES:
            return "opaque", None
        for i in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:i])
            if module in self.modules:
                break
        else:
            return "missing", None
        name, rest = parts[i], parts[i + 1:]
        found = self._member(module, name)
        if found is None:
            return "missing", None
        module, entry = found
        if isinstance(entry, str) and entry.startswith("="):
            return self.resolve(".".join([entry[1:], *rest]), depth + 1)
        if isinstance(entry, dict):
            path = f"{module}.{name}"
            if not rest:
                return "class", path
            return self.class_member(path, rest[0])
        if isinstance(entry, str) and entry.startswith("f(") and not rest:
            sig, _, ret = entry[2:].partition(") -> ")
            return "function", Sig.parse(sig.rstrip(")") + (f" -> {ret}" if ret else ""))
        return "opaque", None

    def class_entry(self, path: str):
        kind, value = self.resolve(path)
        if kind != "class":
            return None, None
        module, _, name = value.rpartition(".")
        return value, self.modules[module][name]

    def mro(self, path: str):
        """([(class path, entry)], complete): the class and its recorded bases, depth first; complete when
        no base is outside the recorded packages (other than bases known to add nothing)."""
        if path in self._mro:
            return self._mro[path]
        chain, complete, todo = [], True, [path]
        seen = set()
        while todo:
            current = todo.pop(0)
            resolved, entry = self.class_entry(current)
            if entry is None:
                if not current.startswith(KNOWN_EMPTY_BASES):
                    complete = False
                continue
            if resolved in seen:
                continue
            seen.add(resolved)
            chain.append((resolved, entry))
            todo = list(entry["bases"]) + todo
        self._mro[path] = chain, complete
        return chain, complete

    def class_member(self, path: str, name: str):
        chain, complete = self.mro(path)
        for cls_path, entry in chain:
            if name in entry["methods"]:
                return "method", (cls_path, entry["methods"][name])
            if name in entry.get("attrs", []):
                return "opaque", None
        return ("missing" if complete else "opaque"), None

    def method_index(self) -> dict:
        """{method name: [class path, ...]} over every recorded class."""
        if self._methods is None:
            self._methods = collections.defaultdict(list)
            for module, entries in self.modules.items():
                for name, entry in entries.items():
                    if isinstance(entry, dict):
                        for method in entry["methods"]:
                            self._methods[method].append(f"{module}.{name}")
        return self._methods

    # calls -----------------------------------------------------------
    def call_problems(self, sig: Sig, n_pos: int, keywords, cls_path: str | None = None, method: str = ""):
        """What ``sig`` does not accept of a call with ``n_pos`` positional arguments and ``keywords``; a
        ``**kw`` passed on to the base class (``cls_path``'s ``method``) is followed there."""
        problems = []
        if sig.too_many_positional(n_pos):
            problems.append(f"{n_pos} positional arguments (takes {len(sig.positional)})")
        for kw in keywords:
            if sig.takes_keyword(kw):
                continue
            if sig.varkw and not (sig.forwards and cls_path):
                continue
            if sig.varkw and not self._base_takes(cls_path, method, kw):
                problems.append(f"keyword {kw}=")
            elif not sig.varkw:
                problems.append(f"keyword {kw}=")
        return problems

    def _base_takes(self, cls_path: str, method: str, kw: str) -> bool:
        chain, complete = self.mro(cls_path)
        for cls, entry in chain[1:]:
            if method in entry["methods"]:
                return not self.call_problems(Sig.parse(entry["methods"][method]), 0, [kw], cls, method)
        return not complete or method == "__init__"  # object.__init__ takes no keywords, but be lenient

    def method_problems(self, cls_path: str, method: str, n_pos: int, keywords):
        kind, value = self.class_member(cls_path, method)
        if kind == "missing" and method != "__init__":  # no __init__ recorded: object's, or made by a base
            return [f"no method {method}"]
        if kind != "method":
            return []
        owner, sig = value
        return self.call_problems(Sig.parse(sig), n_pos, keywords, owner, method)


@functools.lru_cache(maxsize=None)
def _stdlib_accepts(method: str, n_pos: int, keywords: tuple):
    """(has, accepts): whether a class of STDLIB_CLASSES has ``method``, and whether one accepts the call."""
    has = False
    for cls in STDLIB_CLASSES:
        fn = getattr(cls, method, None)
        if fn is None or not callable(fn):
            continue
        has = True
        try:
            params = list(inspect.signature(fn).parameters.values())[1:]  # without self
        except (TypeError, ValueError):
            return True, True
        kinds = inspect.Parameter
        if any(p.kind == kinds.VAR_KEYWORD for p in params):
            ok_kw = True
        else:
            names = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
            ok_kw = all(k in names for k in keywords)
        positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        ok_pos = any(p.kind == kinds.VAR_POSITIONAL for p in params) or n_pos <= len(positional)
        if ok_kw and ok_pos:
            return True, True
    return has, False


# ------------------------------------------------------------------ uses in the scanned code
@dataclass
class Use:
    """One use of the recorded API at ``line``: a ``name``, a ``call`` of a dotted name (function or
    class), a ``method`` call or an ``attr`` read on an object of a known recorded class, or an ``any``
    method call on an object of unknown class."""

    line: int
    kind: str
    target: str
    n_pos: int = 0
    keywords: tuple = ()
    shown: str = ""

    def symbol(self) -> str:
        if self.kind in ("name", "attr"):
            return self.shown or self.target
        args = ", ".join(([f"<{self.n_pos} positional>"] if self.n_pos else []) +
                         [f"{k}=" for k in self.keywords])
        return f"{self.shown or self.target}({args})"

    def problems(self, api: Api, union_methods: set) -> list:
        if self.kind == "name":
            kind, _ = api.resolve(self.target)
            return ["missing"] if kind == "missing" else []
        if self.kind == "call":
            kind, value = api.resolve(self.target)
            if kind == "function":
                return api.call_problems(value, self.n_pos, self.keywords)
            if kind == "class":
                return api.method_problems(value, "__init__", self.n_pos, self.keywords)
            if kind == "method":
                owner, sig = value
                return api.call_problems(Sig.parse(sig), self.n_pos, self.keywords, owner,
                                         self.target.rpartition(".")[2])
            return []  # missing names are reported as such by their import or attribute use
        if self.kind in ("method", "attr"):
            cls_path, _, member = self.target.rpartition(".")
            if api.resolve(cls_path)[0] != "class":
                return []
            if self.kind == "attr":
                return [f"no attribute {member}"] if api.class_member(cls_path, member)[0] == "missing" else []
            return api.method_problems(cls_path, member, self.n_pos, self.keywords)
        # "any": an object of unknown class
        has_std, std_ok = _stdlib_accepts(self.target, self.n_pos, self.keywords)
        if std_ok:
            return []
        candidates = api.method_index().get(self.target, [])
        if not candidates:
            if self.target in union_methods and not has_std:
                return [f"no recorded class has a method {self.target}"]
            return []
        found = []
        for cls_path in candidates:
            problems = api.method_problems(cls_path, self.target, self.n_pos, self.keywords)
            if not problems:
                return []
            found.append(problems)
        return min(found, key=len)


LOCAL, FOREIGN = "local", "foreign"


@dataclass
class LocalClass:
    module: str
    name: str
    bases: list  # ("ros", dotted) | ("local", key) | ("foreign", text)
    methods: dict
    attr_types: dict = field(default_factory=dict)


class Scanner:
    """The uses of the recorded API in a set of source files (classes may derive from each other's)."""

    def __init__(self, apis: list, sources: dict):
        """``sources``: {path relative to the repository: source text}."""
        self.apis = apis
        self._union = None
        self.trees = {path: ast.parse(text, path) for path, text in sources.items()}
        self.module_of = {path: _module_name(path) for path in sources}
        self.imports = {path: self._imports(path, tree) for path, tree in self.trees.items()}
        self.classes = {}
        for path, tree in self.trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    key = f"{self.module_of[path]}.{node.name}"
                    methods = {s.name: s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
                    self.classes[key] = LocalClass(self.module_of[path], node.name, [], methods)
        for path, tree in self.trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    cls = self.classes[f"{self.module_of[path]}.{node.name}"]
                    cls.bases = [self._expr_ref(path, b) for b in node.bases]
        for path, tree in self.trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self._attr_types(path, self.classes[f"{self.module_of[path]}.{node.name}"])

    # imports and names ------------------------------------------------
    def _imports(self, path: str, tree) -> dict:
        """{local name: ("ros" | "foreign", dotted)} for every import in the file (any scope)."""
        module = self.module_of[path]
        table = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    bound, target = (a.asname, a.name) if a.asname else (top, top)
                    table[bound] = self._classify(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")[:-node.level] if "." in module else []
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for a in node.names:
                    if a.name != "*":
                        table[a.asname or a.name] = self._classify(f"{origin}.{a.name}")
        return table

    @staticmethod
    def _classify(dotted: str):
        return ("ros" if dotted.split(".")[0] in ROS_PACKAGES else FOREIGN, dotted)

    def _ref(self, path: str, dotted: str):
        """A dotted name as the file sees it, resolved through its imports and its own classes."""
        head, _, rest = dotted.partition(".")
        module = self.module_of[path]
        if f"{module}.{head}" in self.classes and not rest:
            return (LOCAL, f"{module}.{head}")
        if head in self.imports[path]:
            kind, target = self.imports[path][head]
            full = f"{target}.{rest}" if rest else target
            if kind == "ros":
                return ("ros", full)
            if full in self.classes:
                return (LOCAL, full)
            return (FOREIGN, full)
        if hasattr(builtins, head):
            return (FOREIGN, f"builtins.{dotted}")
        return None

    def _expr_ref(self, path: str, node):
        dotted = _dotted(node.value if isinstance(node, ast.Subscript) else node)
        return (self._ref(path, dotted) if dotted else None) or (FOREIGN, dotted or "?")

    # types ------------------------------------------------------------
    def _ros_kind(self, dotted: str):
        """(kind, value) from the first distribution that records ``dotted`` as more than missing."""
        for api in self.apis:
            kind, value = api.resolve(dotted)
            if kind != "missing":
                return kind, value
        return "missing", None

    def _ros_method_ret(self, cls_path: str, method: str):
        for api in self.apis:
            kind, value = api.class_member(cls_path, method)
            if kind == "method":
                ret = Sig.parse(value[1]).ret
                if ret:
                    return ("ros", ret)
        return None

    def type_of(self, path: str, node, scope: dict, cls: LocalClass | None):
        """("ros", class path) | ("local", class key) | ("foreign", ...) | None (unknown)."""
        if isinstance(node, ast.Name):
            if node.id == "self" and cls is not None:
                return (LOCAL, f"{cls.module}.{cls.name}")
            if node.id in scope:
                return scope[node.id]
            return None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and cls is not None:
            return self._local_attr_type(cls, node.attr)
        if isinstance(node, (ast.Constant, ast.List, ast.Dict, ast.Set, ast.Tuple, ast.JoinedStr,
                             ast.ListComp, ast.DictComp, ast.SetComp, ast.BinOp)):
            return (FOREIGN, type(node).__name__)
        if isinstance(node, ast.Call):
            func = node.func
            dotted = _dotted(func)
            ref = self._ref(path, dotted) if dotted and dotted.split(".")[0] not in scope else None
            if ref is not None:
                kind, target = ref
                if kind == LOCAL:
                    return ref
                if kind == FOREIGN:
                    return self._foreign_call_type(target)
                rkind, value = self._ros_kind(target)
                if rkind == "class":
                    return ("ros", value)
                if rkind == "function" and value.ret:
                    return ("ros", value.ret)
                if rkind == "method" and Sig.parse(value[1]).ret:
                    return ("ros", Sig.parse(value[1]).ret)
                return None
            if isinstance(func, ast.Attribute):
                recv = self.type_of(path, func.value, scope, cls)
                if recv and recv[0] == "ros":
                    return self._ros_method_ret(recv[1], func.attr)
                if recv and recv[0] == LOCAL:
                    owner = self._local_lookup(recv[1], func.attr)
                    if owner and owner[0] == "ros":
                        return self._ros_method_ret(owner[1], func.attr)
        return None

    def _foreign_call_type(self, target: str):
        """What a call of a name from outside the recorded packages makes: an object of a class from
        elsewhere (a class, a builtin type, any function of a third-party or standard module), or unknown
        (a function of the package's own, which may return a node; a builtin function such as getattr)."""
        name = target.rpartition(".")[2]
        if target.startswith("builtins."):
            return (FOREIGN, target) if isinstance(getattr(builtins, name, None), type) else None
        if name[:1].isupper():
            return (FOREIGN, target)
        top = target.split(".")[0]
        if top == "synflux_ros" or top in self.module_of.values():
            return None
        return (FOREIGN, target)

    def _local_attr_type(self, cls: LocalClass, attr: str):
        for key in self._local_mro(f"{cls.module}.{cls.name}"):
            if key[0] == LOCAL and attr in self.classes[key[1]].attr_types:
                return self.classes[key[1]].attr_types[attr]
        return None

    def _attr_types(self, path: str, cls: LocalClass) -> None:
        """Types of ``self.x = <call>`` in the class's methods (unknown when they disagree)."""
        seen = {}
        for fn in cls.methods.values():
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    t = node.targets[0]
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        if isinstance(node.value, ast.Constant) and node.value.value is None:
                            continue
                        typ = self.type_of(path, node.value, {}, None) if isinstance(node.value, ast.Call) \
                            else None
                        seen.setdefault(t.attr, set()).add(typ)
        cls.attr_types = {k: next(iter(v)) for k, v in seen.items() if len(v) == 1}

    def _local_mro(self, key: str):
        """[("local", key) | ("ros", path) | ("foreign", text)]: the class, then its bases depth first."""
        out, todo, seen = [], [(LOCAL, key)], set()
        while todo:
            item = todo.pop(0)
            if item in seen:
                continue
            seen.add(item)
            out.append(item)
            if item[0] == LOCAL and item[1] in self.classes:
                todo = list(self.classes[item[1]].bases) + todo
        return out

    def _local_lookup(self, key: str, method: str, skip_first: bool = False):
        """Where ``method`` of local class ``key`` comes from: ("local", key), ("ros", class path), None
        (from a foreign base: not checked)."""
        for item in self._local_mro(key)[1 if skip_first else 0:]:
            kind, target = item
            if kind == LOCAL and target in self.classes:
                if method in self.classes[target].methods:
                    return item
            elif kind == "ros":
                return item
            elif kind == FOREIGN and target not in ("builtins.object",):
                return None
        return None

    # the walk ---------------------------------------------------------
    def uses(self, path: str) -> list:
        tree = self.trees[path]
        found = []
        module_scope = {}
        for stmt in tree.body:
            self._bind(path, stmt, module_scope, None)
        self._walk(path, tree.body, dict(module_scope), None, found)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in ROS_PACKAGES:
                        found.append(Use(node.lineno, "name", a.name))
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    node.module.split(".")[0] in ROS_PACKAGES:
                found.append(Use(node.lineno, "name", node.module))
                found += [Use(node.lineno, "name", f"{node.module}.{a.name}") for a in node.names if a.name != "*"]
        parents = {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(parents.get(id(node)), ast.Attribute):
                dotted = _dotted(node)
                ref = self._ref(path, dotted) if dotted else None
                if ref and ref[0] == "ros" and "." in dotted:
                    found.append(Use(node.lineno, "name", ref[1]))
        return found

    def _bind(self, path, stmt, scope, cls) -> None:
        """Record the types of the names ``stmt`` assigns."""
        if isinstance(stmt, ast.Assign):
            if isinstance(stmt.value, ast.Constant) and stmt.value.value is None:
                return
            typ = self.type_of(path, stmt.value, scope, cls)
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    scope[t.id] = typ
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            scope[stmt.target.id] = self.type_of(path, stmt.value, scope, cls)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if isinstance(item.optional_vars, ast.Name):
                    scope[item.optional_vars.id] = self.type_of(path, item.context_expr, scope, cls)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            for n in ast.walk(stmt.target):
                if isinstance(n, ast.Name):
                    scope[n.id] = None

    def _walk(self, path, body, scope, cls, found) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = dict(scope)
                args = stmt.args
                for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                    if a is not None:
                        inner[a.arg] = self._annotation_type(path, a.annotation)
                for d in stmt.decorator_list:
                    self._calls(path, d, scope, cls, found)
                self._walk(path, stmt.body, inner, cls, found)
                continue
            if isinstance(stmt, ast.ClassDef):
                key = f"{self.module_of[path]}.{stmt.name}"
                for d in stmt.decorator_list + stmt.bases:
                    self._calls(path, d, scope, cls, found)
                self._walk(path, stmt.body, dict(scope), self.classes.get(key), found)
                continue
            for expr in _own_expressions(stmt):
                self._calls(path, expr, scope, cls, found)
            nested = [getattr(stmt, f, None) for f in ("body", "orelse", "finalbody")]
            nested += [h.body for h in getattr(stmt, "handlers", [])]
            nested += [c.body for c in getattr(stmt, "cases", [])]
            self._bind(path, stmt, scope, cls)
            for block in nested:
                if block:
                    self._walk(path, block, scope, cls, found)

    def _annotation_type(self, path, annotation):
        """("ros", class path) for a parameter annotated with a recorded class, else unknown."""
        dotted = _dotted(annotation) if annotation is not None else ""
        ref = self._ref(path, dotted) if dotted else None
        if ref and ref[0] == "ros" and self._ros_kind(ref[1])[0] == "class":
            return ref
        return None

    def _calls(self, path, expr, scope, cls, found) -> None:
        """The calls in ``expr``, and the attributes it reads of objects of a recorded class."""
        called = {id(n.func) for n in _walk_expr(expr) if isinstance(n, ast.Call)}
        for node in _walk_expr(expr):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in called:
                typ = self.type_of(path, node.value, scope, cls)
                if typ and typ[0] == "ros":
                    found.append(Use(node.lineno, "attr", f"{typ[1]}.{node.attr}",
                                     shown=f"{_short(node.value)}.{node.attr} [{typ[1]}]"))
            if not isinstance(node, ast.Call):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args):
                n_pos = 0
            else:
                n_pos = len(node.args)
            keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
            use = self._call_use(path, node, scope, cls, n_pos, keywords)
            if use is not None:
                found.append(use)

    def _call_use(self, path, node, scope, cls, n_pos, keywords):
        func = node.func
        dotted = _dotted(func)
        if dotted and dotted.split(".")[0] not in scope:
            ref = self._ref(path, dotted)
            if ref is not None:
                kind, target = ref
                if kind == "ros":
                    return Use(node.lineno, "call", target, n_pos, keywords, shown=dotted)
                if kind == LOCAL:  # a local class: its constructor, from a recorded base when not its own
                    owner = self._local_lookup(target, "__init__")
                    if owner and owner[0] == "ros":
                        return Use(node.lineno, "method", f"{owner[1]}.__init__", n_pos, keywords,
                                   shown=f"{dotted} -> {owner[1]}")
                return None
        if not isinstance(func, ast.Attribute):
            return None
        method = func.attr
        recv = func.value
        if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name) and recv.func.id == "super" and cls:
            owner = self._local_lookup(f"{cls.module}.{cls.name}", method, skip_first=True)
            if owner and owner[0] == "ros":
                return Use(node.lineno, "method", f"{owner[1]}.{method}", n_pos, keywords,
                           shown=f"super().{method} -> {owner[1]}")
            return None
        typ = self.type_of(path, recv, scope, cls)
        if typ is None:
            if not (n_pos or keywords) and method not in self._union_methods():
                return None
            return Use(node.lineno, "any", method, n_pos, keywords, shown=f"{_short(recv)}.{method}")
        kind, target = typ
        if kind == "ros":
            return Use(node.lineno, "method", f"{target}.{method}", n_pos, keywords,
                       shown=f"{_short(recv)}.{method} [{target}]")
        if kind == LOCAL:
            owner = self._local_lookup(target, method)
            if owner and owner[0] == "ros":
                return Use(node.lineno, "method", f"{owner[1]}.{method}", n_pos, keywords,
                           shown=f"{_short(recv)}.{method} [{owner[1]}]")
        return None

    def _union_methods(self) -> set:
        """The method names of every recorded class of every distribution."""
        if self._union is None:
            self._union = set().union(*(api.method_index() for api in self.apis))
        return self._union


def _module_name(path: str) -> str:
    parts = path[:-3].split("/")
    if parts[0] in ("launch", "test"):  # launch files and launch tests import each other by file name
        return parts[-1]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(node.id)
    return ".".join(reversed(parts))


def _short(node) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 40 else text[:37] + "..."


def _own_expressions(stmt):
    """The expressions of a statement, without its nested statement blocks."""
    for name, value in ast.iter_fields(stmt):
        if name in ("body", "orelse", "finalbody", "handlers", "cases"):
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, ast.AST):
                yield item


def _walk_expr(node):
    """ast.walk without entering nested function or class definitions (walked with their own scope)."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                todo.append(child)


# ------------------------------------------------------------------ the checks
def load_apis() -> list:
    return [Api(json.loads((DATA / f"{d}.json").read_text(encoding="utf-8"))) for d in DISTROS]


APIS = load_apis()


def findings(sources: dict, apis=None, compat: tuple = ()) -> list:
    """``file:line: symbol: <problem> in <distro>`` for every use of the recorded API in ``sources``
    ({path: text}) that a distribution lacks; a file in ``compat`` is flagged only where every
    distribution lacks it."""
    apis = apis or APIS
    scanner = Scanner(apis, sources)
    union = scanner._union_methods()
    out = []
    for path in sorted(sources):
        seen = set()
        for use in sorted(scanner.uses(path), key=lambda u: (u.line, u.kind, u.target)):
            key = (use.line, use.kind, use.target, use.n_pos, use.keywords)
            if key in seen:
                continue
            seen.add(key)
            lacking = [(api, problems) for api in apis for problems in [use.problems(api, union)] if problems]
            if path in compat and len(lacking) < len(apis):
                continue
            for api, problems in lacking:
                out.append(f"{path}:{use.line}: {use.symbol()}: {', '.join(problems)} in {api.label}")
    return out


def scanned_sources() -> dict:
    files = sorted({p for pattern in SCANNED for p in REPO.glob(pattern)})
    return {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8") for p in files}


def test_the_data_records_both_distributions_at_a_commit():
    for api, distro in zip(APIS, DISTROS):
        data = json.loads((DATA / f"{distro}.json").read_text(encoding="utf-8"))
        assert api.distro == distro
        assert set(data["source"]) == {"rclpy", "launch", "launch_ros"}
        for source in data["source"].values():
            assert len(source["commit"]) == 40 and source["repository"].startswith("https://github.com/ros2/")
        for module in ("rclpy", "rclpy.executors", "rclpy.node", "rclpy.lifecycle", "launch.actions",
                       "launch_ros.actions", "launch_testing.asserts"):
            assert module in api.modules, (distro, module)
    humble, jazzy = APIS
    assert humble.resolve("rclpy.event_handler")[0] == "missing"
    assert jazzy.resolve("rclpy.event_handler.SubscriptionEventCallbacks")[0] == "class"


def test_the_robot_side_code_uses_only_api_common_to_humble_and_jazzy():
    sources = scanned_sources()
    assert len(sources) > 15 and "synflux_ros/nodes/process.py" in sources  # the scan sees the code
    strict = {path: text for path, text in sources.items() if path != COMPAT}
    problems = findings(strict)
    assert not problems, "API missing in a supported distribution (use synflux_ros/nodes/ros_compat.py):\n" + \
        "\n".join(problems)


def test_ros_compat_names_exist_in_at_least_one_distribution():
    path = REPO / COMPAT
    if not path.exists():
        pytest.skip(f"{COMPAT} does not exist")
    problems = findings({COMPAT: path.read_text(encoding="utf-8")}, compat=(COMPAT,))
    assert not problems, "API missing in every distribution:\n" + "\n".join(problems)


# ------------------------------------------------------------------ the checker itself
def test_the_checker_flags_the_iron_module_humble_lacks():
    found = findings({"snippet.py": "from rclpy.event_handler import SubscriptionEventCallbacks\n"})
    assert any("rclpy.event_handler.SubscriptionEventCallbacks" in f and "in humble" in f for f in found), found
    assert not any("in jazzy" in f for f in found), found
    assert all(f.startswith("snippet.py:1: ") for f in found), found


def test_the_checker_flags_a_keyword_newer_than_both_distributions():
    snippet = ("from rclpy.executors import MultiThreadedExecutor\n"
               "def stop(executor):\n"
               "    executor.shutdown(timeout_sec=1, wait_for_threads=True)\n"
               "ex = MultiThreadedExecutor()\n"
               "ex.shutdown(timeout_sec=1, wait_for_threads=True)\n")
    found = findings({"snippet.py": snippet})
    for line in (3, 5):
        for distro in DISTROS:
            assert any(f.startswith(f"snippet.py:{line}: ") and "wait_for_threads=" in f and f"in {distro}" in f
                       for f in found), (line, distro, found)
    assert not any("keyword timeout_sec=" in f for f in found), found


def test_the_checker_flags_typos_and_keywords_passed_on_to_base_classes():
    snippet = ("import rclpy\n"
               "from launch_ros.actions import Node\n"
               "rclpy.create_nod('x')\n"
               "rclpy.create_node('x', start_parameter_service=False)\n"
               "Node(package='p', executable='e', output='screen', respawn=True, respwan=True)\n")
    found = findings({"snippet.py": snippet})
    assert any(f.startswith("snippet.py:3: rclpy.create_nod: missing") for f in found), found
    assert any(f.startswith("snippet.py:4: ") and "start_parameter_service=" in f for f in found), found
    assert any(f.startswith("snippet.py:5: ") and "keyword respwan=" in f for f in found), found
    assert not any("keyword respawn=" in f or "keyword output=" in f for f in found), found
    compat = findings({"c.py": "from rclpy.qos_event import SubscriptionEventCallbacks\n"
                                "from rclpy.event_handler import SubscriptionEventCallbacks\n"
                                "from rclpy.event_handlr import SubscriptionEventCallbacks\n"}, compat=("c.py",))
    assert compat and all(f.startswith("c.py:3: ") for f in compat), compat


def test_the_checker_passes_code_both_distributions_accept():
    snippet = """
import threading
import rclpy
import launch
import launch_testing.actions
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch_ros.actions import Node
from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.lifecycle import Node as LifecycleNode, State, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.qos_event import SubscriptionEventCallbacks
from rclpy.signals import SignalHandlerOptions


class Worker(LifecycleNode):
    def __init__(self, **kwargs):
        super().__init__('worker', **kwargs)
        self.sub = self.create_subscription(str, 't', print, qos_profile_sensor_data,
                                            event_callbacks=SubscriptionEventCallbacks())
        self.get_logger().warning('x', throttle_duration_sec=2.0)

    def on_configure(self, state: State) -> TransitionCallbackReturn:
        return TransitionCallbackReturn.SUCCESS


class Pool(MultiThreadedExecutor):
    def shutdown(self, timeout_sec=None):
        pool = getattr(self, '_executor', None)
        pool.shutdown(wait=True)
        return super().shutdown(timeout_sec)


def main():
    rclpy.init(args=None, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node('n', namespace='/x', start_parameter_services=False, enable_rosout=False)
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    executor.spin_once(timeout_sec=0.1)
    executor.shutdown(timeout_sec=1.0)
    Pool(num_threads=2).shutdown()
    QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
    threading.Thread(target=main, daemon=True).join(timeout=1.0)
    rclpy.try_shutdown()
    return launch.LaunchDescription([
        DeclareLaunchArgument('a', default_value='1', description='d', choices=['1']),
        Node(package='p', executable='e', name='e', namespace='n', output='screen', parameters=[],
             remappings=[], ros_arguments=['--log-level', 'info']),
        OpaqueFunction(function=main, args=[]),
        launch_testing.actions.ReadyToTest(),
    ])
"""
    assert findings({"snippet.py": snippet}) == []
