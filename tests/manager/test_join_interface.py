"""The join's collective operations keep one interface: ``Joins`` (recover_hsdp/manager/joins.py)
is what ``Rejoin`` calls, ``CollectiveJoins`` the real implementation and ``FakeJoins``
(tests/fake_join.py) the in-process tests'. A method added, renamed or given other parameters
in one of them and not in the protocol fails here, before an in-process test passes against a
fake the real code no longer matches.
"""

from __future__ import annotations

import inspect

import pytest

from fake_join import FakeJoins
from recover_hsdp.manager.joins import CollectiveJoins, Joins


def _methods(cls) -> set[str]:
    return {name for name, value in vars(cls).items()
            if not name.startswith("_") and isinstance(value, (staticmethod, type(_methods)))}


def _parameters(cls, name: str) -> list[tuple[str, inspect._ParameterKind, object]]:
    """The parameters a caller passes (``self`` dropped), with their kinds and defaults;
    annotations aside (the fake's name the fake world)."""
    params = list(inspect.signature(getattr(cls, name)).parameters.values())
    if not isinstance(inspect.getattr_static(cls, name), staticmethod):
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("implementation", [CollectiveJoins, FakeJoins])
def test_the_implementation_has_the_protocols_methods(implementation):
    assert _methods(implementation) == _methods(Joins)


@pytest.mark.parametrize("name", sorted(_methods(Joins)))
@pytest.mark.parametrize("implementation", [CollectiveJoins, FakeJoins])
def test_every_method_takes_the_protocols_parameters(implementation, name):
    assert _parameters(implementation, name) == _parameters(Joins, name)


def test_the_protocol_is_what_rejoin_calls():
    """Every ``self.joins.<name>`` in rejoin.py is a protocol method (and every one is used)."""
    import re
    from pathlib import Path

    import recover_hsdp.manager.rejoin as rejoin

    called = set(re.findall(r"self\.joins\.(\w+)", Path(rejoin.__file__).read_text()))
    assert called == _methods(Joins)
