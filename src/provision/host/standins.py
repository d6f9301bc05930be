"""Stand-ins for standard modules the host side imports, installed by host/bundle.py on hosts
only: importing the real dataclasses module costs a host ~14 ms of CPU (inspect, ast, re...),
as much as the agent's whole probe. Same behaviour for what host/protocol.py uses (frozen
dataclasses with defaults and default factories); tests/test_host_standins.py holds them to it.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

_MISSING: Any = object()


class FrozenInstanceError(AttributeError):
    pass


class _Field:
    def __init__(self, default: Any, default_factory: Any) -> None:
        self.default = default
        self.default_factory = default_factory


def field(*, default: Any = _MISSING, default_factory: Any = _MISSING) -> Any:
    return _Field(default, default_factory)


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


def dataclass(cls: Any = None, *, frozen: bool = False) -> Any:  # noqa: C901  a stand-in for the stdlib's dataclass, as cheap to import: its options in one place
    def wrap(cls: Any) -> Any:  # noqa: C901  (the class builder of dataclass above: one branch per option)
        names = list(cls.__dict__.get("__annotations__", {}))
        defaults: dict[str, Callable[[], Any]] = {}
        for n in names:
            if n not in cls.__dict__:
                continue
            v = cls.__dict__[n]
            if isinstance(v, _Field):
                if v.default_factory is not _MISSING:
                    defaults[n] = v.default_factory
                    delattr(cls, n)
                    continue
                v = v.default
                setattr(cls, n, v)
            defaults[n] = _constant(v)

        def __init__(self: Any, *args: Any, **kw: Any) -> None:
            if len(args) > len(names):
                raise TypeError("%s() takes %d positional arguments" % (cls.__name__, len(names)))
            vals = dict(zip(names, args))
            for k, v in kw.items():
                if k not in names or k in vals:
                    raise TypeError("%s() got an unexpected or repeated argument %r" % (cls.__name__, k))
                vals[k] = v
            for n in names:
                if n not in vals:
                    if n not in defaults:
                        raise TypeError("%s() missing required argument: %r" % (cls.__name__, n))
                    vals[n] = defaults[n]()
                object.__setattr__(self, n, vals[n])

        def __eq__(self: Any, other: Any) -> Any:
            if other.__class__ is not self.__class__:
                return NotImplemented
            return all(getattr(self, n) == getattr(other, n) for n in names)

        def __repr__(self: Any) -> str:
            return "%s(%s)" % (cls.__qualname__, ", ".join("%s=%r" % (n, getattr(self, n)) for n in names))

        cls.__init__ = __init__
        cls.__eq__ = __eq__
        cls.__repr__ = __repr__
        if frozen:

            def __setattr__(self: Any, name: str, value: Any) -> None:
                raise FrozenInstanceError("cannot assign to field %r" % name)

            def __delattr__(self: Any, name: str) -> None:
                raise FrozenInstanceError("cannot delete field %r" % name)

            cls.__setattr__ = __setattr__
            cls.__delattr__ = __delattr__
            cls.__hash__ = lambda self: hash(tuple(getattr(self, n) for n in names))
        else:
            cls.__hash__ = None
        return cls

    return wrap if cls is None else wrap(cls)
