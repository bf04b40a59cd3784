"""PyTorch's process-wide state that levels change while they are live.

A level is entered and exited per call, in any thread, and a level entered by hand
(``with vmap() as B`` in a generator) may exit out of order. PyTorch's switches are
process-wide: saved and restored by each level, they would be restored too early by
another thread's level or by a level that exits first. So each is held by a count of
live holders, under a lock: the first holder changes it, the last restores it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.autograd.forward_ad as fwAD


class SwitchedOff:
    """A process-wide flag of PyTorch's held off while any holder is inside ``with``.

    Example::

        >>> import torch
        >>> mha = SwitchedOff(torch.backends.mha.get_fastpath_enabled,
        ...                   torch.backends.mha.set_fastpath_enabled)
        >>> with mha, mha:
        ...     torch.backends.mha.get_fastpath_enabled()
        False
        >>> torch.backends.mha.get_fastpath_enabled()
        True
    """

    def __init__(self, get: Callable[[], bool], set_: Callable[[bool], None]) -> None:
        self._get, self._set = get, set_
        self._lock = threading.Lock()
        self._holders = 0
        self._before = True

    def __enter__(self) -> None:
        with self._lock:
            if not self._holders:
                self._before = self._get()
                self._set(False)
            self._holders += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._holders -= 1
            if not self._holders:
                self._set(self._before)


# nn.TransformerEncoderLayer's and nn.MultiheadAttention's fused inference kernels, which
# have no derivatives (see autodiff.py)
mha_fastpath_off = SwitchedOff(torch.backends.mha.get_fastpath_enabled,
                               torch.backends.mha.set_fastpath_enabled)
# oneDNN's RNN layer kernel, which has no forward AD (see lifting.py)
mkldnn_off = SwitchedOff(torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled)
# cuDNN's RNN kernel, likewise without forward AD or a batching rule (see lifting.py)
cudnn_off = SwitchedOff(torch._C._get_cudnn_enabled, torch._C._set_cudnn_enabled)

# PyTorch has one forward-AD level per process. The jvp levels of a thread share it, and
# a thread holds it, through this lock, from its first jvp level's entry to its last's
# exit: another thread's jvp waits, where it would use (or delete) a level in use.
_forward_ad = threading.RLock()
_forward_ad_users = 0
_entered_here = False  # whether the level in use was entered here (not by the user)
_entries = 0  # how many levels were entered here: each entry is a new level


def own_dual_level() -> int | None:
    """An id of PyTorch's forward-AD level in use if it was entered here, and so lives
    until the last jvp level using it exits (one the user entered, the user may exit and
    enter anew, clearing every tangent); None otherwise."""
    return _entries if _entered_here and _forward_ad_users else None


@contextlib.contextmanager
def dual_level() -> Iterator[int]:
    """PyTorch's forward-AD level: the user's if one is active, else entered by its
    first user here and exited by its last.

    Example::

        >>> with dual_level() as level, dual_level() as same:
        ...     level == same >= 0
        True
    """
    global _forward_ad_users, _entered_here, _entries
    with _forward_ad:
        if not _forward_ad_users:
            _entered_here = fwAD._current_level < 0
            if _entered_here:
                fwAD.enter_dual_level()
                _entries += 1
        _forward_ad_users += 1
        try:
            yield fwAD._current_level
        finally:
            _forward_ad_users -= 1
            if not _forward_ad_users and _entered_here:
                fwAD.exit_dual_level()
