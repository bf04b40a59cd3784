"""Plain tensors: the types of tensor no transform wraps.

A level's inner tensors, a user's captured tensors and the results outside every
transform are of these types; ``type(t) in PLAIN`` is the test (a foreign subclass of
``torch.Tensor``, a user's logging tensor, is not plain).

Example::

    >>> import torch
    >>> type(torch.nn.Parameter(torch.ones(2))) in PLAIN
    True
"""

import torch

PLAIN = (torch.Tensor, torch.nn.Parameter)
