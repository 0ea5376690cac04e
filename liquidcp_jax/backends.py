"""Backend registries of the attention ops (as tokamax's attention ``api.py``): each backend says
whether it can run a call and, if not, why; ``backend="auto"`` takes the first of an ordered list
that can, and a named backend that cannot run raises ``ValueError`` with its reason.

    BACKENDS = Registry("megadcp_attention", [Backend("xla", run_xla)], auto=("xla",))
    backend = BACKENDS.select(name, call)      # a Backend, or ValueError
    out = backend.run(call)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence


def _always(call) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to run an op.

    Fields:
      name: what ``backend=`` names it by.
      run: ``run(call) -> output``, ``call`` the op's validated arguments.
      unsupported: ``unsupported(call) -> str | None``: why it cannot run ``call`` here (a
        sentence for the user), ``None`` when it can.
    """

    name: str
    run: Callable[[Any], Any]
    unsupported: Callable[[Any], str | None] = _always


class Registry:
    """The backends of one op, by name.

    Args:
      op: the op's name (for messages).
      backends: the :class:`Backend` s.
      auto: the backends ``"auto"`` tries, in order (the last one should run anything).
      aliases: other names, each for an ordered tuple of backends (the first that can run wins),
        e.g. ``{"pallas": ("pallas_one_step", "pallas_segment_ring")}``.
    """

    def __init__(self, op: str, backends: Sequence[Backend], *, auto: Sequence[str],
                 aliases: dict[str, Sequence[str]] | None = None):
        self.op = op
        self.backends = {b.name: b for b in backends}
        self.aliases = {k: tuple(v) for k, v in (aliases or {}).items()}
        self.auto = tuple(auto)
        for name in self.auto + sum(self.aliases.values(), ()):
            if name not in self.backends:
                raise ValueError(f"{op}: unknown backend {name!r} in auto / aliases")

    @property
    def names(self) -> tuple[str, ...]:
        return ("auto",) + tuple(self.backends) + tuple(self.aliases)

    def candidates(self, backend: str) -> tuple[str, ...]:
        """The backends ``backend`` stands for, in order; ``ValueError`` for an unknown name."""
        if backend == "auto":
            return self.auto
        if backend in self.aliases:
            return self.aliases[backend]
        if isinstance(backend, str) and backend in self.backends:
            return (backend,)
        names = ", ".join(f'"{n}"' for n in self.names)
        raise ValueError(f"backend must be one of {names}; got {backend!r}")

    def select(self, backend: str, call, *, auto: Sequence[str] | None = None):
        """``(the Backend to run call, why the earlier candidates cannot)``.

        ``auto`` replaces the registry's ``"auto"`` order for this call. A named backend (or
        alias) none of whose candidates can run raises ``ValueError`` with their reasons.
        """
        names = tuple(auto) if backend == "auto" and auto is not None else self.candidates(backend)
        reasons = []
        for name in names:
            why = self.backends[name].unsupported(call)
            if why is None:
                return self.backends[name], "; ".join(reasons)
            if why not in reasons:
                reasons.append(why)
        raise ValueError(f'backend="{backend}" cannot run here: {"; ".join(reasons)}')
