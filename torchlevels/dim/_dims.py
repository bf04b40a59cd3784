"""Dimension objects: ``Dim`` (one first-class dimension) and ``DimList`` (any number)."""

from __future__ import annotations

import dis
import functools
import inspect
import operator
from collections.abc import Sequence
from typing import SupportsIndex

import torch

from torchlevels.dim._base import _Tensor


class DimensionBindError(ValueError):
    """A dim's size is unknown where it is needed, or conflicts with a size it is bound to."""


class DimensionMismatchError(Exception):
    """functorch.dim's name, kept for code that catches it (functorch.dim defines it but
    raises DimensionBindError, as torchlevels.dim does)."""


_created = 0  # dims made so far (Dim._serial)


class Dim(_Tensor):
    """A first-class dimension. Its size is bound on first use (or set once); as a tensor it
    is the tensor of its own indices (``0 .. size - 1``) along itself.

    Example::

        >>> import torch
        >>> from torchlevels.dim import dims
        >>> i, j = dims(2)
        >>> A = torch.arange(6.).reshape(2, 3)
        >>> A[i, j].order(j, i).shape, i.size, j.size
        (torch.Size([3, 2]), 2, 3)
    """

    __slots__ = ("_name", "_size", "_serial")

    def __init__(self, name: str, size: int | None = None) -> None:
        global _created
        self._name = name
        # creation order: functorch.dim nests an op's vmap levels in this order, so the
        # dims of a batched op's result come in it (see _ops.batched)
        self._serial = _created
        _created += 1
        self._size = -1
        if size is not None:
            self.size = size

    @property
    def size(self) -> int:
        if self._size < 0:
            raise DimensionBindError(
                f"dimension {self._name} is unbound: bind it by indexing a tensor with it "
                f"(x[{self._name}]) or set {self._name}.size"
            )
        return self._size

    @size.setter
    def size(self, size: SupportsIndex) -> None:
        try:  # any int: Python's, numpy's, an integer tensor of one element
            n = -1 if isinstance(size, bool) else operator.index(size)
        except TypeError:
            n = -1
        if n < 0:
            raise DimensionBindError(
                f"Dim '{self._name}' size must be a non-negative int, got {size!r}"
            )
        if self._size == -1:
            self._size = n
        elif self._size != n:
            raise DimensionBindError(
                f"Dim '{self._name}' previously bound to a dimension of size {self._size} "
                f"cannot bind to a dimension of size {n}"
            )

    @property
    def is_bound(self) -> bool:
        return self._size >= 0

    # -- as a tensor (Rule 3) ---------------------------------------------------------
    @property
    def _dims(self) -> tuple[Dim, ...]:
        return (self,)

    @property
    def _tensor(self) -> torch.Tensor:
        return self.range(torch.get_default_device())

    def range(self, device: torch.device) -> torch.Tensor:
        """``arange(size)`` on ``device``, a new tensor each time: results that are views
        of it (``i.order(i)``, ``i.expand(j)``) may be written to."""
        return torch.arange(self.size, device=device)

    @property
    def ndim(self) -> int:
        return 0

    def __len__(self) -> int:
        raise TypeError(
            f"len() of dim {self._name}, which has no positional dims (dims(1) returns a "
            f"single Dim, not a tuple of one: write {self._name} = dims(1))"
        )

    def __repr__(self) -> str:
        return self._name

    __hash__ = object.__hash__


class DimList:
    """A list of dims whose length may be bound later, by the first tensor it indexes.

    Example::

        >>> import torch
        >>> from torchlevels.dim import dimlists, dims
        >>> batch = dimlists()
        >>> k = dims(1)
        >>> x = torch.rand(2, 3, 4)
        >>> y = x[batch, k].sum(k)
        >>> len(batch), y.order(*batch).shape
        (2, torch.Size([2, 3]))
    """

    def __init__(
        self, len_or_dims: int | Sequence[Dim | int] | None = None, name: str | None = None
    ) -> None:
        """functorch.dim's signature: ``len_or_dims`` is the list's length (new dims), or
        its dims (a Dim is taken as it is, an int makes a new dim of that size), or None
        to bind the length later; ``name`` names the list and the dims it makes."""
        self._name = name
        self._dims: list[Dim] | None = None
        if isinstance(len_or_dims, int):
            self.bind_len(len_or_dims)
        elif isinstance(len_or_dims, Sequence) and not isinstance(len_or_dims, str):
            self._dims = [self._new_dim(k, item) for k, item in enumerate(len_or_dims)]
        elif len_or_dims is not None:
            raise TypeError(
                f"DimList({len_or_dims!r}): the first argument is the list's length or a "
                "sequence of its dims (Dims or sizes); name the list with "
                f"DimList(name={len_or_dims!r})"
            )

    def _new_dim(self, k: int, item: Dim | int) -> Dim:
        if isinstance(item, Dim):
            return item
        if not isinstance(item, int):
            raise TypeError(f"DimList: a dim of the list is a Dim or a size (an int), got "
                            f"{item!r}")
        return Dim(f"{self._name or 'dim'}{k}", item)

    @property
    def is_bound(self) -> bool:
        return self._dims is not None

    def bind_len(self, n: int) -> None:
        """Give the list ``n`` fresh dims (or check it has ``n`` if already bound)."""
        if n < 0:
            raise DimensionBindError(f"DimList {self!r}: cannot bind it to length {n}")
        if self._dims is None:
            self._dims = [Dim(f"{self._name or 'dim'}{k}") for k in range(n)]
        elif len(self._dims) != n:
            raise DimensionBindError(
                f"DimList {self!r} has {len(self._dims)} dims, cannot bind it to {n}"
            )

    def bind(self, sizes: Sequence[int]) -> None:
        """Bind the list's length and each of its dims' sizes."""
        self.bind_len(len(sizes))
        for d, s in zip(self._dims, sizes):
            d.size = s

    def _bound(self) -> list[Dim]:
        if self._dims is None:
            raise DimensionBindError(
                f"DimList {self!r} is unbound: bind it by indexing a tensor with it or "
                "call its .bind_len(n)"
            )
        return self._dims

    def size(self) -> int:
        """The number of dims in the list (functorch.dim's ``DimList.size()``)."""
        return len(self._bound())

    def __len__(self) -> int:
        return len(self._bound())

    def __getitem__(self, key: int | slice) -> Dim | tuple[Dim, ...]:
        r = self._bound()[key]
        return tuple(r) if isinstance(key, slice) else r

    def __iter__(self):
        return iter(self._bound())

    def __repr__(self) -> str:
        if self._dims is not None:
            return repr(tuple(self._dims))
        return "<unbound_dimlist>" if self._name is None else f"*{self._name}"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from torchlevels.dim import _ops

        return _ops.torch_function(func, args, kwargs or {})


@functools.lru_cache(maxsize=1024)
def _assignment(code, lasti: int) -> tuple[int, tuple[str, ...]]:
    """How many targets the call at ``lasti`` in ``code`` is assigned to (0 if it is not
    assigned), and the names of its leading targets that are plain variables: functorch.dim
    names no dim from the first other target (an attribute, an item) on."""
    instructions = list(dis.get_instructions(code))
    # the running CALL: the last instruction at or before f_lasti (which may be in its cache)
    at = max((k for k, ins in enumerate(instructions) if ins.offset <= lasti), default=None)
    if at is None:
        return 0, ()
    following = instructions[at + 1:]
    if not following:
        return 0, ()
    first = following[0]
    if first.opname.startswith("STORE_") and first.opname != "STORE_FAST_STORE_FAST":
        return 1, (str(first.argval),)
    if first.opname != "UNPACK_SEQUENCE":
        return 0, ()
    names: list[str] = []
    for ins in following[1:]:
        if len(names) >= first.argval:
            break
        if ins.opname == "STORE_FAST_STORE_FAST":
            names.extend(ins.argval)
        elif ins.opname.startswith("STORE_"):
            names.append(str(ins.argval))
        else:  # a target made of several instructions (y.x, y[0]) is not a plain variable
            break
    return first.argval, tuple(names[:first.argval])


def _assigned_names(code, lasti: int) -> tuple[str, ...]:
    """The variable names the call at ``lasti`` in ``code`` is assigned to (debug names),
    or () unless every target is a plain variable."""
    count, names = _assignment(code, lasti)
    return names if len(names) == count else ()


def _make(kind: str, n: int | None, sizes: Sequence | None, factory) -> object:
    frame = inspect.currentframe().f_back.f_back
    try:
        targets, names = _assignment(frame.f_code, frame.f_lasti)
    finally:
        del frame
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ValueError(f"{kind}(n={n!r}): n must be an int >= 0 (or None, to count the "
                         "names assigned)")
    if sizes is not None and n is not None and len(sizes) != n:
        raise ValueError(f"{kind}(n={n}, sizes={list(sizes)}): n and len(sizes) differ")
    count = n if n is not None else (len(sizes) if sizes is not None else targets)
    if count == 0 and n is None and sizes is None:
        raise SyntaxError(
            f"{kind}() must be assigned to a sequence of variable names or have argument n "
            "specified"
        )
    # named after the targets as functorch.dim names them, d<k> where it has no name
    named = names if targets == count else ()
    names = [*named, *(f"d{k}" for k in range(len(named), count))]
    made = [factory(name, None if sizes is None else sizes[k]) for k, name in enumerate(names)]
    return made[0] if count == 1 else tuple(made)


def dims(n: int | None = None, sizes: Sequence[int | None] | None = None) -> Dim | tuple[Dim, ...]:
    """Make ``n`` new first-class dims (one ``Dim`` for ``n == 1``, else a tuple: ``()`` for
    ``n == 0``), named after the variables they are assigned to. ``sizes`` sets sizes up
    front (None leaves one unbound); with neither argument, as many dims as there are names
    on the left.

    Example::

        >>> from torchlevels.dim import dims
        >>> batch, channel = dims(sizes=[None, 3])
        >>> batch, channel.size
        (batch, 3)
    """
    return _make("dims", n, sizes, Dim)


def dimlists(
    n: int | None = None, sizes: Sequence[int | Sequence[int] | None] | None = None
) -> DimList | tuple[DimList, ...]:
    """Make ``n`` new dim lists (see :class:`DimList`); ``sizes`` gives each list's length
    (an int) or its dims' sizes (a list), or None to bind it on first use.

    Example::

        >>> import torch
        >>> from torchlevels.dim import dimlists
        >>> b = dimlists()
        >>> torch.rand(2, 3)[b].dims
        (b0, b1)
    """

    def factory(name: str, size) -> DimList:
        dl = DimList(name=name)
        if isinstance(size, int):
            dl.bind_len(size)
        elif size is not None:
            dl.bind(size)
        return dl

    return _make("dimlists", n, sizes, factory)
