"""The extension's stubs (`_lifecycle.pyi`) list exactly what the extension has, and every public
name of the package is documented."""

import ast
import inspect
import os

import lifecycle
from lifecycle import _lifecycle


def stub_names():
    path = os.path.join(os.path.dirname(lifecycle.__file__), "_lifecycle.pyi")
    tree = ast.parse(open(path).read())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef)
            }
    return top, members


def test_the_stubs_match_the_extension():
    top, members = stub_names()
    have = {n for n in dir(_lifecycle) if not n.startswith("__") or n == "__version__"}
    assert top == have, f"stubs only: {top - have}, extension only: {have - top}"
    for cls, names in members.items():
        if issubclass(getattr(_lifecycle, cls), Exception):
            continue
        runtime = {
            n for n in dir(getattr(_lifecycle, cls)) if not n.startswith("_") or n in names
        }
        assert names - runtime == set(), f"{cls}: stubs only: {names - runtime}"
        public = {n for n in runtime if not n.startswith("_")}
        assert public - names == set(), f"{cls}: not in the stubs: {public - names}"


def test_every_public_name_is_documented_and_typed():
    assert isinstance(lifecycle.__version__, str) and lifecycle.__version__.count(".") == 2
    for name in lifecycle.__all__:
        obj = getattr(lifecycle, name)
        if isinstance(obj, str):
            continue
        assert (obj.__doc__ or "").strip(), f"lifecycle.{name} has no docstring"
    for cls in (lifecycle.Switch, lifecycle.RolloutWeights, lifecycle.Masters, lifecycle.Engine, lifecycle.GroupStream):
        for attr, member in vars(cls).items():
            if attr.startswith("_") or not callable(member) and not isinstance(member, (property, classmethod)):
                continue
            func = member.__func__ if isinstance(member, classmethod) else member
            func = func.fget if isinstance(func, property) else func
            assert (func.__doc__ or "").strip(), f"{cls.__name__}.{attr} has no docstring"
            sig = inspect.signature(func)
            assert sig.return_annotation is not inspect.Signature.empty, f"{cls.__name__}.{attr}"


def test_help_shows_no_private_types():
    import pydoc

    text = pydoc.render_doc(lifecycle.Switch, renderer=pydoc.plaintext)
    assert "_Source" not in text and "_lifecycle._Switch" not in text
