"""Partial evaluation of a traced function: what does not depend on its inputs runs once.

``linearize(f, *primals)`` needs ``jvp_fn(*tangents)``: the tangent part of ``jvp(f)`` at
fixed primals. Traced with the tangents as the only inputs (make_fx, through every level),
each op of the graph either depends on a tangent or is fixed by the primals and the
tensors ``f`` captures. :func:`partially_evaluated` runs the fixed ops once, now, with
autograd recording as it would eagerly (so the results keep their history to primals
that require grad), and returns a function that replays the rest: a fixed linear map,
whose random ops drew their numbers once, as JAX's and torch.func's linearize give.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_arg

from torchlevels.tools.fx_sources import sources_forgotten
from torchlevels.tools.trace import drop_aliases


def partially_evaluated(func: Callable[..., list], inputs: Sequence[torch.Tensor]
                        ) -> Callable[..., list]:
    """``func`` (of flat tensors, returning a flat list) traced on ``inputs``, with every
    op that does not depend on the inputs run once, now; the function returned runs the
    rest on new inputs of the same shapes.

    Example::

        >>> import torch
        >>> from torchlevels.tools.partial_eval import partially_evaluated
        >>> w = torch.randn(3)
        >>> f = partially_evaluated(lambda t: [t * w.exp()], [torch.zeros(3)])
        >>> torch.allclose(f(torch.ones(3))[0], w.exp())  # exp(w) was computed once
        True
    """
    with sources_forgotten():  # only the graph is read
        gm = make_fx(func)(*inputs)
    drop_aliases(gm)
    graph = gm.graph
    graph.eliminate_dead_code()  # (forward AD's checks of shapes, on meta tensors)
    dynamic = _dynamic_nodes(graph)
    known: dict[Node, Any] = {}
    for node in graph.nodes:
        if node in dynamic or node.op == "output":
            continue
        if node.op == "get_attr":
            known[node] = getattr(gm, node.target)
        else:  # make_fx graphs call functions only
            args, kwargs = map_arg((node.args, node.kwargs), known.__getitem__)
            known[node] = node.target(*args, **kwargs)
    return _rest(graph, dynamic, known)


def _dynamic_nodes(graph: Graph) -> set[Node]:
    """The nodes that must run on every call: those that depend on an input, and a fixed
    tensor (with the fixed tensors it is a view of) that is written in place either by
    such a node or after such a node read it. Run once, every call would write into one
    tensor that earlier results alias, or the node would read it written."""
    nodes = list(graph.nodes)
    writes = [(i, writer, _view_chain(arg)) for i, writer in enumerate(nodes)
              for arg in _written(writer)]
    dynamic: set[Node] = set()
    while True:
        first_read: dict[Node, int] = {}  # base -> where a dynamic node first reads it
        for i, node in enumerate(nodes):
            if node.op == "placeholder" or any(n in dynamic for n in node.all_input_nodes):
                dynamic.add(node)
                for n in node.all_input_nodes:
                    first_read.setdefault(_view_chain(n)[-1], i)
        fresh = set()
        for i, writer, chain in writes:
            base = chain[-1]
            if base in dynamic or base.op == "get_attr":
                continue  # made per call already, or a captured tensor: written once
            if writer in dynamic or first_read.get(base, i) < i:
                fresh.update(chain)
        if not fresh:
            return dynamic
        dynamic |= fresh


def _written(node: Node) -> list[Node]:
    """The argument nodes that ``node``'s op writes in place."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    schema = target._schema
    if not schema.is_mutable:
        return []
    bound = dict(zip((a.name for a in schema.arguments), node.args)) | node.kwargs
    return [bound[a.name] for a in schema.arguments if a.alias_info is not None
            and a.alias_info.is_write and isinstance(bound.get(a.name), Node)]


def _view_chain(node: Node) -> list[Node]:
    """``node`` and the nodes it is a view of, through ops that return a view of their
    first argument (or an element of a tuple of views: ``split``)."""
    chain = [node]
    while node.op == "call_function":
        if node.target is operator.getitem:
            node = node.args[0]
            continue
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target._schema.returns
                and target._schema.returns[0].alias_info is not None
                and isinstance(node.args[0], Node)):
            break
        node = node.args[0]
        chain.append(node)
    return chain


def _rest(graph: Graph, dynamic: set[Node], known: dict[Node, Any]) -> Callable[..., list]:
    """A function of the inputs that runs the ``dynamic`` nodes on them, reading the
    ``known`` values the nodes use. It interprets the graph rather than compiling it to
    Python: torch.fx keeps the source of every module it compiles for the rest of the
    process, one per ``linearize`` call."""
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    calls = [node for node in graph.nodes if node in dynamic and node.op == "call_function"]
    (output,) = (node for node in graph.nodes if node.op == "output")
    used = {n: known[n] for node in (*calls, output) for n in node.all_input_nodes
            if n in known}  # only these stay alive with the function

    def run(*values: torch.Tensor) -> list:
        env = dict(used)
        env.update(zip(inputs, values))
        for node in calls:
            args, kwargs = map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = node.target(*args, **kwargs)
        return list(map_arg(output.args[0], env.__getitem__))

    return run
