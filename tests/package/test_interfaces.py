"""The fakes and the real classes keep the contracts they are written against.

``World`` (collectives/interface.py) and ``DataPlane`` (recovery/planes.py) are Protocols; each
real implementation and each fake used by the in-process tests must have every member they
name, with the same parameters (names, kinds and defaults) for the methods. Read from the
source with ``ast`` so that the check needs neither MPI nor a torch.distributed group.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _class(path: Path, name: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"{name} not found in {path}")


def _signature(fn: ast.FunctionDef) -> list[tuple[str, str, str | None]]:
    """(name, kind, default) of every parameter after ``self`` / ``cls``."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [(a.arg, "positional", ast.unparse(d) if d is not None else None)
           for a, d in zip(positional, defaults)][1:]
    if args.vararg:
        out.append((args.vararg.arg, "*args", None))
    out += [(a.arg, "keyword", ast.unparse(d) if d is not None else None)
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, "**kwargs", None))
    return out


def _members(cls: ast.ClassDef) -> dict[str, object]:
    """name -> the method's signature, "property", or "attribute" (a class-level annotation or
    constant, or ``self.<name> = ...`` in any method)."""
    found: dict[str, object] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            decorators = {ast.unparse(d) for d in node.decorator_list}
            found[node.name] = "property" if "property" in decorators else _signature(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = "attribute"
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = "attribute"
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for leaf in ast.walk(target):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == "self"):
                    found.setdefault(leaf.attr, "attribute")
    return found


def _differences(protocol: dict[str, object], impl: dict[str, object]) -> list[str]:
    wrong = []
    for name, want in protocol.items():
        if name not in impl:
            wrong.append(f"{name}: missing")
        elif isinstance(want, list):
            if impl[name] != want:
                wrong.append(f"{name}: {impl[name]} != {want}")
        elif want == "attribute" and impl[name] not in ("attribute", "property"):
            wrong.append(f"{name}: an attribute in the Protocol, a method here")
        elif want == "property" and impl[name] not in ("attribute", "property"):
            wrong.append(f"{name}: a property in the Protocol, a method here")
    return wrong


WORLD = (ROOT / "recover_hsdp/collectives/interface.py", "World")
DATA_PLANE = (ROOT / "recover_hsdp/recovery/planes.py", "DataPlane")
#: implementation -> (its Protocol, the classes it is made of: (file, class), the class first,
#: then its bases in the package)
CASES = {
    "FaultTolerantWorld": (WORLD, [(ROOT / "recover_hsdp/collectives/world.py", "FaultTolerantWorld"),
                                   (ROOT / "recover_hsdp/collectives/guarded.py", "GuardedCalls")]),
    "FakeWorld": (WORLD, [(ROOT / "tests/fakes.py", "FakeWorld")]),
    "MpiDataPlane": (DATA_PLANE, [(ROOT / "recover_hsdp/recovery/planes.py", "MpiDataPlane")]),
    "TorchDataPlane": (DATA_PLANE, [(ROOT / "recover_hsdp/groups/data_plane.py", "TorchDataPlane")]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_implementation_matches_its_protocol(name):
    (protocol_path, protocol_name), parts = CASES[name]
    protocol = _members(_class(protocol_path, protocol_name))
    members: dict[str, object] = {}
    for path, cls in reversed(parts):  # the class's own members override its bases'
        members.update(_members(_class(path, cls)))
    wrong = _differences(protocol, members)
    assert not wrong, f"{name} differs from {protocol_name}: {wrong}"


def test_the_check_sees_a_difference(tmp_path):
    """A changed default, a missing method and a renamed parameter are all found."""
    source = tmp_path / "impl.py"
    source.write_text("class P:\n    x: int\n    def f(self, a, b=1): ...\n    def g(self): ...\n"
                      "class Q:\n    def f(self, a, b=2): ...\n"
                      "class R:\n    def f(self, c, b=1): ...\n    def g(self): ...\n"
                      "    def h(self):\n        self.x = 1\n")
    protocol = _members(_class(source, "P"))
    assert _differences(protocol, _members(_class(source, "Q"))) == [
        "x: missing", "f: [('a', 'positional', None), ('b', 'positional', '2')] != "
        "[('a', 'positional', None), ('b', 'positional', '1')]", "g: missing"]
    assert [w.split(":")[0] for w in _differences(protocol, _members(_class(source, "R")))] == ["f"]
